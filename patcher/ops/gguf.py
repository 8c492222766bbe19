"""GGUF block-quantized linears (kernels/gguf/): the decode GEMV of 1 to 8 rows against GGUF blocks as GGUFLinear holds
them (uint8 [out_features, bytes per row]), and the two ops of the prefill path, which hands more rows to a GEMM: the
weights dequantized to the activations' dtype, and (W4A8) the activations rounded through Q8_1. Its reference is
patcher/gguf/reference.py: W4A8 (activations quantized to Q8_1 blocks, integer dot products a block, scaled in fp32) or
W4A16 (the weights dequantized and cast to the activations' dtype, then F.linear). The CUDA kernels take Q4_0, Q4_1,
Q8_0 and the K-quants Q4_K, Q5_K, Q6_K (GEMV_KINDS: every type patcher.gguf.format reads), whose rows are whole
super-blocks of 256 values; the reference takes the same types, so on the CPU the op runs them all."""

from __future__ import annotations

import torch

from .library import define

GEMV_KINDS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K")  # the block types the CUDA kernels take
GEMV_MAX_ROWS = 8  # rows of x the CUDA kernel takes (a decode step)


def gguf_gemv(
    x: torch.Tensor,
    blocks: torch.Tensor,
    kind: str,
    bias: torch.Tensor | None = None,
    quantize_activations: bool = True,
) -> torch.Tensor:
    """x [..., K] @ W^T (+ bias) -> [..., N] in x's dtype, W the GGUF rows `blocks` [N, K / block * type size] of
    `kind`: reference.linear_w4a8 with quantize_activations, else reference.linear_w4a16."""
    from ..gguf import reference  # (patcher.gguf imports the patching module, which imports this one)

    if quantize_activations:
        return reference.linear_w4a8(x, blocks, kind, bias)
    return reference.linear_w4a16(x, blocks, kind, bias)


def _gguf_gemv_fake(x, blocks, kind, bias=None, quantize_activations=True):
    return x.new_empty((*x.shape[:-1], blocks.shape[0]))


define(
    "gguf_gemv(Tensor x, Tensor blocks, str kind, Tensor? bias=None, bool quantize_activations=True) -> Tensor",
    gguf_gemv,
    _gguf_gemv_fake,
)


MAX_CAT = 3  # weights one gguf_gemv_cat takes (a projection's q, k and v): kGgufMaxSegments (kernels/gguf/params.h)


def gguf_gemv_cat(
    x: torch.Tensor,
    blocks: list[torch.Tensor],
    kinds: str,
    biases: list[torch.Tensor | None],
    quantize_activations: bool = True,
) -> torch.Tensor:
    """[gguf_gemv(x, blocks[i], kind i, biases[i]) for each i] concatenated along the last dimension: the modules of
    one projection (q, k, v; gate, up) sharing x, in one input kernel and one GEMV launch per block type on CUDA.
    `kinds`: the weights' block types, comma-separated ("Q4_K,Q4_K,Q6_K")."""
    names = kinds.split(",")
    if not 1 <= len(blocks) <= MAX_CAT or len(names) != len(blocks) or len(biases) != len(blocks):
        raise ValueError(
            f"gguf_gemv_cat takes 1 to {MAX_CAT} weights with a kind and a bias (or None) each, got {len(blocks)} "
            f"weights, kinds {kinds!r} and {len(biases)} biases"
        )
    return torch.cat([gguf_gemv(x, w, kind, b, quantize_activations) for w, kind, b in zip(blocks, names, biases)], -1)


def _gguf_gemv_cat_fake(x, blocks, kinds, biases, quantize_activations=True):
    return x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in blocks)))


define(
    "gguf_gemv_cat(Tensor x, Tensor[] blocks, str kinds, Tensor?[] biases, bool quantize_activations=True) -> Tensor",
    gguf_gemv_cat,
    _gguf_gemv_cat_fake,
)


def gguf_norm_gemv_cat(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    blocks: list[torch.Tensor],
    kinds: str,
    biases: list[torch.Tensor | None],
    quantize_activations: bool = True,
    feeds_attention: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A GGUF projection behind its RMSNorm: (gguf_gemv_cat(rms_norm(s), ...), s) with s = x + delta, or (..., an
    empty tensor) where delta is None and s is x itself. On CUDA the norm kernel writes the GEMV's workspace (Q8_1
    blocks, or fp32 for W4A16) in place of the input kernel, for 16-bit values of a hidden size a multiple of 256.
    `feeds_attention` (scheduling only): the output goes straight to decode_attention_qkv, which reads the cache
    before its grid-dependency wait, so the GEMV's last launch lets it start only after its own wait."""
    from .norm import add_rms_norm, rms_norm

    if delta is None:
        h, total = rms_norm(x, norm_weight, eps), x.new_empty(0)
    else:
        h, total = add_rms_norm(x, delta, norm_weight, eps)
    return gguf_gemv_cat(h, blocks, kinds, biases, quantize_activations), total


def _gguf_norm_gemv_cat_fake(
    x, delta, norm_weight, eps, blocks, kinds, biases, quantize_activations=True, feeds_attention=False
):
    out = x.new_empty((*x.shape[:-1], sum(w.shape[0] for w in blocks)))
    return out, x.new_empty(0) if delta is None else torch.empty_like(x, memory_format=torch.contiguous_format)


define(
    "gguf_norm_gemv_cat(Tensor x, Tensor? delta, Tensor norm_weight, float eps, Tensor[] blocks, str kinds, "
    "Tensor?[] biases, bool quantize_activations=True, bool feeds_attention=False) -> (Tensor, Tensor)",
    gguf_norm_gemv_cat,
    _gguf_norm_gemv_cat_fake,
)


def gguf_silu_mul_gemv_cat(
    gate_up: torch.Tensor,
    blocks: list[torch.Tensor],
    kinds: str,
    biases: list[torch.Tensor | None],
    quantize_activations: bool = True,
) -> torch.Tensor:
    """gguf_gemv_cat(silu_and_mul(gate_up), ...): a gated MLP's activation (gate_up [..., 2K] = [gate | up]) into its
    GGUF down projection. On CUDA the GEMV's input kernel computes the activation, as silu_and_mul rounds it."""
    from .activation import silu_and_mul

    return gguf_gemv_cat(silu_and_mul(gate_up), blocks, kinds, biases, quantize_activations)


define(
    "gguf_silu_mul_gemv_cat(Tensor gate_up, Tensor[] blocks, str kinds, Tensor?[] biases, "
    "bool quantize_activations=True) -> Tensor",
    gguf_silu_mul_gemv_cat,
    _gguf_gemv_cat_fake,
)


def gguf_attention_gemv_cat(
    qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, interleaved: bool, scale: float, splits: int,
    workspace, blocks: list[torch.Tensor], kinds: str, biases: list[torch.Tensor | None],
    quantize_activations: bool = True,
) -> torch.Tensor:  # fmt: skip
    """gguf_gemv_cat(decode_attention_qkv(qkv, ...), ...): the attention over the cache (RoPE and the current token's
    K/V from the QKV's output qkv) into its GGUF output projection. On CUDA the attention writes the GEMV's input
    (Q8_1 blocks, or fp32 for W4A16) in place of the input kernel; head_dim a multiple of 32."""
    from .attention import decode_attention_qkv

    out = decode_attention_qkv(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, interleaved, scale, splits,
                               workspace)  # fmt: skip
    return gguf_gemv_cat(out, blocks, kinds, biases, quantize_activations)


define(
    "gguf_attention_gemv_cat(Tensor qkv, Tensor cos, Tensor sin, Tensor slot, Tensor pad, Tensor(a!) k_cache, "
    "Tensor(b!) v_cache, int num_q_heads, bool interleaved, float scale, int splits, Tensor(c!) workspace, "
    "Tensor[] blocks, str kinds, Tensor?[] biases, bool quantize_activations=True) -> Tensor",
    gguf_attention_gemv_cat,
    lambda qkv, cos, sin, slot, pad, kc, vc, hq, inter, scale, splits, ws, blocks, kinds, biases, qa=True: (
        qkv.new_empty((qkv.shape[0], sum(w.shape[0] for w in blocks)))
    ),
)


def gguf_dequantize(blocks: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """GGUF rows `blocks` [N, K / block * type size] of `kind` -> W [N, K] in dtype: format.dequantize (bit-identical
    to gguf.quants, fp32), rounded to dtype once."""
    from ..gguf import format as fmt

    return fmt.dequantize(blocks, kind).to(dtype)


def _gguf_dequantize_fake(blocks, kind, dtype):
    from ..gguf import format as fmt

    t = fmt.block_type(kind)
    return blocks.new_empty((blocks.shape[0], blocks.shape[1] // t.type_size * t.block_size), dtype=dtype)


define("gguf_dequantize(Tensor blocks, str kind, ScalarType dtype) -> Tensor", gguf_dequantize, _gguf_dequantize_fake)


def gguf_dequantize_cat(blocks: list[torch.Tensor], kinds: str, dtype: torch.dtype) -> torch.Tensor:
    """Several GGUF weights of one K (a projection's modules; `kinds` comma-separated, one a weight) -> one
    [sum of their N, K] in dtype: each one's gguf_dequantize, one after another along the rows (on CUDA written in
    place, no concatenation)."""
    return torch.cat([gguf_dequantize(b, kind, dtype) for b, kind in zip(blocks, kinds.split(","), strict=True)])


def _gguf_dequantize_cat_fake(blocks, kinds, dtype):
    parts = [_gguf_dequantize_fake(b, kind, dtype) for b, kind in zip(blocks, kinds.split(","), strict=True)]
    return parts[0].new_empty((sum(p.shape[0] for p in parts), parts[0].shape[1]))


define(
    "gguf_dequantize_cat(Tensor[] blocks, str kinds, ScalarType dtype) -> Tensor",
    gguf_dequantize_cat,
    _gguf_dequantize_cat_fake,
)


def round_q8_1(x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded through Q8_1 blocks as the W4A8 GEMV quantizes it: q * d, exact in
    fp32, rounded to x's dtype. A GEMM of these values with gguf_dequantize's weights is the W4A8 product (reference.
    linear_w4a8) up to the dtype's rounding of q * d and the GEMM's summation order. silu_mul: x is a gated MLP's
    [gate | up] [..., 2K], and the values rounded are silu_and_mul(x), in one kernel on CUDA."""
    from ..gguf import reference
    from .activation import silu_and_mul

    if silu_mul:
        x = silu_and_mul(x)
    q, d, _ = reference.quantize_q8_1(x)
    return (q.float() * d.unsqueeze(-1)).reshape(x.shape).to(x.dtype)


define(
    "round_q8_1(Tensor x, bool silu_mul=False) -> Tensor",
    round_q8_1,
    lambda x, silu_mul=False: x.new_empty((*x.shape[:-1], x.shape[-1] // 2 if silu_mul else x.shape[-1])),
)
