"""The ops `python -m evals.ops` times at a token count (1 = decode, 4096 = prefill), each with the unfused
PyTorch sequence it replaces (the HF modules' own code), and what the decode-path cases share: the architecture
shapes, random inputs, int4 weights.

A case builder returns (fused call, unfused call, bytes the fused op must move at least), or None where the op is
not measured at that token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ARCHS = {  # hidden, intermediate, q heads, kv heads, head_dim, rotary dim, interleaved qkv
    "pythia-2.8b": (2560, 10240, 32, 32, 80, 20, True),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128, False),
    "qwen2-1.5b": (1536, 8960, 12, 2, 128, 128, False),
    "hidden-4096": (4096, 4096, 32, 32, 128, 128, False),  # the 4096 x 4096 reference shape
}


def rand(*shape, dtype):
    return torch.randn(*shape, device="cuda").to(dtype)


def case_add_rms_norm(tokens, arch, dtype, ops):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    H = ARCHS[arch][0]
    x, d = rand(tokens, H, dtype=dtype), rand(tokens, H, dtype=dtype)
    norm = LlamaRMSNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.add_rms_norm(x, d, norm.weight, 1e-5)
    unfused = lambda: norm(x + d)
    return fused, unfused, (4 * tokens * H + H) * dtype.itemsize


def case_add_dual_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x, a, m = (rand(tokens, H, dtype=dtype) for _ in range(3))
    ln1, ln2 = (torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype) for _ in range(2))
    fused = lambda: ops.add_dual_layer_norm(x, a, m, ln1.weight, ln1.bias, ln2.weight, ln2.bias, 1e-5)

    def unfused():  # GPTNeoXLayer (parallel residual), then the next layer's two norms
        h = m + a + x
        return ln1(h), ln2(h)

    return fused, unfused, (6 * tokens * H + 4 * H) * dtype.itemsize


def case_add_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x, d = rand(tokens, H, dtype=dtype), rand(tokens, H, dtype=dtype)
    ln = torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.add_layer_norm(x, d, None, ln.weight, ln.bias, 1e-5)
    unfused = lambda: ln(d + x)
    return fused, unfused, (4 * tokens * H + 2 * H) * dtype.itemsize


def case_rms_norm(tokens, arch, dtype, ops):
    """The first layer's input norm (no residual add yet)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    H = ARCHS[arch][0]
    x = rand(tokens, H, dtype=dtype)
    norm = LlamaRMSNorm(H, eps=1e-5).to("cuda", dtype)
    return lambda: ops.rms_norm(x, norm.weight, 1e-5), lambda: norm(x), (2 * tokens * H + H) * dtype.itemsize


def case_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x = rand(tokens, H, dtype=dtype)
    ln = torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.layer_norm(x, ln.weight, ln.bias, 1e-5)
    return fused, lambda: ln(x), (2 * tokens * H + 2 * H) * dtype.itemsize


def case_dual_layer_norm(tokens, arch, dtype, ops):
    """GPT-NeoX's first layer (parallel residual): both LayerNorms of the embedding output in one pass."""
    H = ARCHS[arch][0]
    x = rand(tokens, H, dtype=dtype)
    ln1, ln2 = (torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype) for _ in range(2))
    fused = lambda: ops.dual_layer_norm(x, ln1.weight, ln1.bias, ln2.weight, ln2.bias, 1e-5)
    return fused, lambda: (ln1(x), ln2(x)), (3 * tokens * H + 4 * H) * dtype.itemsize


def case_int4_linear(tokens, arch, dtype, ops):
    """A GPTQ int4 g128 linear (the MLP's first projection) at prefill (more than 8 rows): ours (the weight
    dequantized by our kernel, then cuBLAS) against the pure-torch dequantize-then-matmul."""
    from patcher.ops import reference

    if tokens <= 8:
        return None  # up to 8 rows int4_linear is the int4 GEMV, measured by the decode-path "int4" rows
    H, inter = ARCHS[arch][:2]
    linear = random_int4(H, [inter])
    x = rand(tokens, H, dtype=dtype)
    weight_bytes = H * inter // 2 + (H // 128) * inter * (2 + 4 / 8)
    fused = lambda: ops.int4_linear(x, *linear.args())
    unfused = lambda: reference.int4_linear(x, *linear.args())
    return fused, unfused, int(weight_bytes + (tokens * H + tokens * inter) * dtype.itemsize)


def case_rope_qkv(tokens, arch, dtype, ops):
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    _, _, hq, hkv, D, R, interleaved = ARCHS[arch]
    W = (hq + 2 * hkv) * D
    qkv = rand(1, tokens, W, dtype=dtype)
    angles = torch.randn(1, tokens, R // 2, device="cuda")
    emb = torch.cat([angles, angles], -1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    fused = lambda: ops.rope_qkv(qkv, cos, sin, hq, hkv, D, interleaved)

    def unfused():  # the attention modules' own prologue
        if interleaved:
            q, k, v = qkv.view(1, tokens, -1, 3 * D).transpose(1, 2).chunk(3, dim=-1)
            q, k = neox_rope(q, k, cos, sin)
        else:
            q, k, v = qkv.split([hq * D, hkv * D, hkv * D], dim=-1)
            q = q.view(1, tokens, -1, D).transpose(1, 2)
            k = k.view(1, tokens, -1, D).transpose(1, 2)
            v = v.view(1, tokens, -1, D).transpose(1, 2)
            q, k = llama_rope(q, k, cos, sin)
        return q, k, v

    return fused, unfused, (2 * tokens * W + 2 * tokens * R) * dtype.itemsize


def case_silu_and_mul(tokens, arch, dtype, ops):
    inter = ARCHS[arch][1]
    gate_up = rand(tokens, 2 * inter, dtype=dtype)
    gate, up = rand(tokens, inter, dtype=dtype), rand(tokens, inter, dtype=dtype)
    fused = lambda: ops.silu_and_mul(gate_up)
    unfused = lambda: F.silu(gate) * up
    return fused, unfused, 3 * tokens * inter * dtype.itemsize


def case_bias_gelu(tokens, arch, dtype, ops):
    inter = ARCHS[arch][1]
    h, b = rand(tokens, inter, dtype=dtype), rand(inter, dtype=dtype)
    fused = lambda: ops.bias_gelu(h, b, False)
    # HF adds this bias inside the GEMM (addmm epilogue) and then runs GELU alone; we compare with that GELU.
    unfused = lambda: F.gelu(h)
    return fused, unfused, (2 * tokens * inter + inter) * dtype.itemsize


def gguf_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    """Random GGUF blocks of `kind` [n, bytes per row] on the GPU (patcher.gguf.random_weights)."""
    from patcher.gguf.random_weights import random_blocks

    return random_blocks(kind, n, k, torch.Generator("cuda").manual_seed(n + k))


def case_gguf_linear(tokens, arch, dtype, ops, kind="Q4_0"):
    """A GGUF Q4_0 linear in W4A8 (the MLP's first projection) at prefill (more than 8 rows), as GGUFLinear runs it
    on a GPU (activations rounded through Q8_1, the weight dequantized to the dtype, then cuBLAS), against F.linear
    on the same weight held dense in the dtype: the cost of keeping the weights quantized."""
    if tokens <= 8:
        return None  # up to 8 rows it is the GGUF GEMV, measured by the decode-path "gguf" rows
    from patcher.gguf import GGUFLinear

    H, inter = ARCHS[arch][:2]
    blocks = gguf_blocks(kind, inter, H)
    layer = GGUFLinear.from_blocks(blocks, kind)
    dense = ops.gguf_dequantize(blocks, kind, dtype)
    x = rand(tokens, H, dtype=dtype)
    fused = lambda: layer.gemm(ops.round_q8_1(x), ops)
    unfused = lambda: torch.nn.functional.linear(x, dense)
    return fused, unfused, int(blocks.numel() + (tokens * H + tokens * inter) * dtype.itemsize)


def input_copies(nbytes: int) -> int:
    """Input copies to cycle through so that repeated calls read HBM, not L2 (>= 256 MB in all)."""
    return max(1, min(64, (256 << 20) // max(nbytes, 1) + 1))


def random_int4(k, widths, group_size=128):
    from patcher.ops.int4 import Int4Linear

    def seg(n):
        groups = k // group_size
        qweight = torch.randint(-(2**31), 2**31 - 1, (k // 8, n), dtype=torch.int32, device="cuda")
        qzeros = torch.full((groups, n // 8), 0x77777777, dtype=torch.int32, device="cuda")
        scales = (torch.rand(groups, n, device="cuda") / (4 * k**0.5)).half()
        g_idx = torch.arange(k, dtype=torch.int32, device="cuda") // group_size
        return qweight, qzeros, scales, g_idx, None

    parts = [list(t) for t in zip(*(seg(n) for n in widths))]
    return Int4Linear(*parts, group_size=group_size, act_order=False, zero_offset=1)


CASES = {  # op -> (case builder, architectures it applies to)
    "rms_norm": (case_rms_norm, ["llama-3.1-8b", "qwen2-1.5b", "hidden-4096"]),
    "add_rms_norm": (case_add_rms_norm, ["llama-3.1-8b", "qwen2-1.5b", "hidden-4096"]),
    "layer_norm": (case_layer_norm, ["pythia-2.8b", "hidden-4096"]),
    "dual_layer_norm": (case_dual_layer_norm, ["pythia-2.8b", "hidden-4096"]),
    "add_dual_layer_norm": (case_add_dual_layer_norm, ["pythia-2.8b", "hidden-4096"]),
    "add_layer_norm": (case_add_layer_norm, ["pythia-2.8b", "hidden-4096"]),
    "rope_qkv": (case_rope_qkv, ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b", "hidden-4096"]),
    "silu_and_mul": (case_silu_and_mul, ["llama-3.1-8b", "qwen2-1.5b", "hidden-4096"]),
    "bias_gelu": (case_bias_gelu, ["pythia-2.8b", "hidden-4096"]),
    "int4_linear": (case_int4_linear, ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b", "hidden-4096"]),
    "gguf_linear": (case_gguf_linear, ["llama-3.1-8b", "qwen2-1.5b"]),
}
