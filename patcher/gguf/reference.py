"""Pure-torch reference matmuls for GGUF weights: W4A16 (dequantize, then a float GEMM) and W4A8 (activations
quantized to Q8_1 blocks, integer dot products per block, scaled in fp32), as the GGUF kernels compute them.

Q8_1 (llama.cpp's quantize_row_q8_1_ref), per 32 consecutive activations x[0..31] of a row:

    d = max|x| / 127 (fp32);  id = 1 / d (0 where d = 0);  q[i] = roundf(x[i] * id) (int8, halves away from zero)
    d is stored as fp16; s = d * sum(q), from the stored d, in fp32   (llama.cpp stores s as fp16 too)
    block_q8_1 bytes (`pack_q8_1`): d fp16 | s fp16 | qs int8[32], 36 bytes

s stays fp32 here (a kernel that quantizes its activations itself needs no packed s, and should do the same): an fp16 s
adds to a Q4_1 product an error as large as the activation quantization's own (m_w * s is large and cancels
against d_w * d_a * isum): on SmolLM2-135M Q4_1 and a 10-token prompt it raised the logits' max error against
W4A16 from 1.7 to 2.4. So a packed block's s (fp16) is not the s the products use.

Every supported weight type is read as an affine form over groups of its input dimension (`affine`):

    w[n, k] = scale[n, k // G] * q[n, k] + offset[n, k // 32]      (offset absent for Q4_0, Q8_0, Q6_K)

    Q4_0: G = 32, q = nibble - 8, scale = d             Q4_1: G = 32, q = nibble, scale = d, offset = m
    Q8_0: G = 32, q = int8, scale = d                    Q4_K, Q5_K: G = 32, scale = d * sc, offset = -dmin * mn
    Q6_K: G = 16, q = 6-bit - 32, scale = d * scales

and the W4A8 product of activation row m and weight row n is, with isum[g] = sum of q_w * q_a over group g
(an integer, exact: |isum| < 2^24):

    y[m, n] = sum_g (scale[n, g] * d_a[m, b(g)]) * isum[g]  +  sum_b offset[n, b] * s_a[m, b]

as llama.cpp's vec_dot forms it for Q4_0 / Q4_1 / Q8_0 against Q8_1 (each block's (d_w * d_a) * isum, plus
m_w * s_a for Q4_1). The K-quants use the same form against Q8_1 blocks (as llama.cpp's CUDA MMVQ path does, not
the CPU's Q8_K blocks); Q6_K's 16-value groups take the d_a of the 32-block they lie in. Block sums are added in
fp32, so a kernel matches this up to the order of those fp32 additions.
"""

from __future__ import annotations

import torch

from . import format as fmt

Q8_1_BLOCK = 32
Q8_1_BYTES = 36
_CHUNK_ELEMENTS = 1 << 25  # fp32 elements of one [groups, rows, N] partial-sum tensor (128 MiB)


def roundf(v: torch.Tensor) -> torch.Tensor:
    """C's roundf (halves away from zero), exact for every fp32 value (torch.round rounds halves to even)."""
    a = v.abs()
    whole = torch.floor(a)
    return torch.sign(v) * (whole + torch.floor(2 * (a - whole)))


def quantize_q8_1(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [..., K] (K a multiple of 32, any float dtype, read as fp32) -> q int8 [..., K/32, 32], d fp32 [..., K/32]
    (the value its fp16 storage holds) and s = d * sum(q) fp32 [..., K/32] (from that d, one rounding)."""
    if x.shape[-1] % Q8_1_BLOCK:
        raise ValueError(f"Q8_1 needs a multiple of {Q8_1_BLOCK} values per row, got {x.shape[-1]}")
    blocks = x.float().reshape(*x.shape[:-1], x.shape[-1] // Q8_1_BLOCK, Q8_1_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    # A tensor divisor: torch's CUDA division by a Python scalar multiplies by its reciprocal, which can differ from
    # the quotient in the last bit; dividing by a tensor divides on every device.
    d = amax / torch.full_like(amax, 127.0)
    inv = torch.where(d == 0, torch.zeros_like(d), 1 / d)
    q = roundf(blocks * inv.unsqueeze(-1)).to(torch.int8)
    d = d.to(torch.float16).float()
    return q, d, q.to(torch.int32).sum(dim=-1).float() * d


def pack_q8_1(q: torch.Tensor, d: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """quantize_q8_1's tensors -> block_q8_1 bytes uint8 [..., K/32 * 36] (d fp16 | s fp16 | qs int8[32])."""
    halves = torch.stack((d, s), dim=-1).to(torch.float16).contiguous().view(torch.uint8)  # [..., nb, 4]
    data = torch.cat((halves, q.contiguous().view(torch.uint8)), dim=-1)
    return data.reshape(*q.shape[:-2], q.shape[-2] * Q8_1_BYTES)


def unpack_q8_1(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """block_q8_1 bytes uint8 [..., nb * 36] -> q int8 [..., nb, 32], d, s fp32 [..., nb]."""
    blocks = data.reshape(*data.shape[:-1], data.shape[-1] // Q8_1_BYTES, Q8_1_BYTES)
    halves = blocks[..., :4].contiguous().view(torch.float16).float()
    return blocks[..., 4:].contiguous().view(torch.int8), halves[..., 0], halves[..., 1]


def affine(data: torch.Tensor, kind: str | int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """GGUF rows uint8 [N, bytes] -> (q int16 [N, K], scale fp32 [N, K/G], offset fp32 [N, K/32] or None, G)."""
    t = fmt.block_type(kind)
    n = data.shape[0]
    p = fmt.unpack(data.reshape(-1, t.type_size), t.name)
    q = p["q"].reshape(n, -1)
    if t.name in ("Q4_0", "Q4_1", "Q8_0"):
        return q, p["d"].reshape(n, -1), p["m"].reshape(n, -1) if "m" in p else None, 32
    if t.name in ("Q4_K", "Q5_K"):
        return q, p["d"].reshape(n, -1), -p["dm"].reshape(n, -1), 32
    return q, p["d"].reshape(n, -1), None, 16


def _check(x: torch.Tensor, data: torch.Tensor, kind) -> fmt.BlockType:
    t = fmt.block_type(kind)
    if data.dtype != torch.uint8 or data.dim() != 2:
        raise ValueError(
            f"GGUF weight blocks must be uint8 [out_features, bytes], got {data.dtype} {tuple(data.shape)}"
        )
    in_features = data.shape[1] // t.type_size * t.block_size
    if data.shape[1] % t.type_size or x.shape[-1] != in_features:
        raise ValueError(
            f"{t.name} weight of {data.shape[1]} bytes per row ({in_features} inputs) "
            f"does not take {x.shape[-1]} inputs"
        )
    return t


def linear_w4a16(x: torch.Tensor, data: torch.Tensor, kind, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + b in the dtype of x, W the weights dequantized (bit-identical to gguf.quants) and cast to x's dtype:
    what transformers' dequantized model computes."""
    _check(x, data, kind)
    weight = fmt.dequantize(data, kind).to(x.dtype)
    return torch.nn.functional.linear(x, weight, None if bias is None else bias.to(x.dtype))


def linear_w4a8(x: torch.Tensor, data: torch.Tensor, kind, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T + b with x quantized to Q8_1 blocks: the W4A8 product of the module docstring, in fp32, then cast to
    x's dtype (the bias added in fp32 first)."""
    _check(x, data, kind)
    q_w, scale, offset, group = affine(data, kind)
    n, k = q_w.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    groups = k // group
    w_groups = q_w.float().reshape(n, groups, group).permute(1, 2, 0)  # [groups, G, N]
    per_block = Q8_1_BLOCK // group
    chunk = max(1, _CHUNK_ELEMENTS // max(1, groups * n))
    outs = []
    for start in range(0, rows.shape[0], chunk):
        q_a, d_a, s_a = quantize_q8_1(rows[start : start + chunk])
        a_groups = q_a.float().reshape(q_a.shape[0], groups, group).permute(1, 0, 2)  # [groups, M, G]
        isum = torch.bmm(a_groups, w_groups)  # exact integers in fp32
        d_groups = d_a.repeat_interleave(per_block, dim=1)  # [M, groups]
        factor = scale.T.unsqueeze(1) * d_groups.T.unsqueeze(2)  # [groups, M, N]
        out = (factor * isum).sum(dim=0)
        if offset is not None:
            out = out + s_a @ offset.T
        outs.append(out)
    out = torch.cat(outs) if outs else rows.new_zeros(0, n, dtype=torch.float32)
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*lead, n)
