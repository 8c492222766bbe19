"""Per-op benchmark: each fused op against the unfused PyTorch sequence it replaces: `python -m evals.ops` (GPU).

The unfused side is the HF modules' own code (LlamaRMSNorm after a residual add, two nn.LayerNorms after GPT-NeoX's
three-way sum, apply_rotary_pos_emb on the split projection, act(gate) * up, F.linear for a decode GEMV, SDPA over
HF's static cache, ...). For each op, architecture shape, dtype and token count (1 = decode, 4096 = prefill; the
decode-path ops at batch 1, 4 and 8) it reports the median GPU time of both, the fused op's achieved bandwidth (the
fewest bytes it must move: every input read once, every output written once) as GB/s and as a percentage of the HBM
read bandwidth measured in the same run, and the speedup.

Timing: prefill shapes with CUDA events around each call, the L2 cache flushed before each run. Decode shapes are
timed inside a CUDA graph of many calls (launch gaps as in the decode path, not Python overhead), cycling over
enough copies of the inputs that they come from HBM, not from the 50 MB L2.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import common

ARCHS = {  # hidden, intermediate, q heads, kv heads, head_dim, rotary dim, interleaved qkv
    "pythia-2.8b": (2560, 10240, 32, 32, 80, 20, True),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128, False),
    "qwen2-1.5b": (1536, 8960, 12, 2, 128, 128, False),
    "hidden-4096": (4096, 4096, 32, 32, 128, 128, False),  # the 4096 x 4096 reference shape
}


def _rand(*shape, dtype):
    return torch.randn(*shape, device="cuda").to(dtype)


def case_add_rms_norm(tokens, arch, dtype, ops):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    H = ARCHS[arch][0]
    x, d = _rand(tokens, H, dtype=dtype), _rand(tokens, H, dtype=dtype)
    norm = LlamaRMSNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.add_rms_norm(x, d, norm.weight, 1e-5)
    unfused = lambda: norm(x + d)
    return fused, unfused, (4 * tokens * H + H) * dtype.itemsize


def case_add_dual_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x, a, m = (_rand(tokens, H, dtype=dtype) for _ in range(3))
    ln1, ln2 = (torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype) for _ in range(2))
    fused = lambda: ops.add_dual_layer_norm(x, a, m, ln1.weight, ln1.bias, ln2.weight, ln2.bias, 1e-5)

    def unfused():  # GPTNeoXLayer (parallel residual), then the next layer's two norms
        h = m + a + x
        return ln1(h), ln2(h)

    return fused, unfused, (6 * tokens * H + 4 * H) * dtype.itemsize


def case_add_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x, d = _rand(tokens, H, dtype=dtype), _rand(tokens, H, dtype=dtype)
    ln = torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.add_layer_norm(x, d, None, ln.weight, ln.bias, 1e-5)
    unfused = lambda: ln(d + x)
    return fused, unfused, (4 * tokens * H + 2 * H) * dtype.itemsize


def case_rms_norm(tokens, arch, dtype, ops):
    """The first layer's input norm (no residual add yet)."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    H = ARCHS[arch][0]
    x = _rand(tokens, H, dtype=dtype)
    norm = LlamaRMSNorm(H, eps=1e-5).to("cuda", dtype)
    return lambda: ops.rms_norm(x, norm.weight, 1e-5), lambda: norm(x), (2 * tokens * H + H) * dtype.itemsize


def case_layer_norm(tokens, arch, dtype, ops):
    H = ARCHS[arch][0]
    x = _rand(tokens, H, dtype=dtype)
    ln = torch.nn.LayerNorm(H, eps=1e-5).to("cuda", dtype)
    fused = lambda: ops.layer_norm(x, ln.weight, ln.bias, 1e-5)
    return fused, lambda: ln(x), (2 * tokens * H + 2 * H) * dtype.itemsize


def case_dual_layer_norm(tokens, arch, dtype, ops):
    """GPT-NeoX's first layer (parallel residual): both LayerNorms of the embedding output in one pass."""
    H = ARCHS[arch][0]
    x = _rand(tokens, H, dtype=dtype)
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
    linear = _random_int4(H, [inter])
    x = _rand(tokens, H, dtype=dtype)
    weight_bytes = H * inter // 2 + (H // 128) * inter * (2 + 4 / 8)
    fused = lambda: ops.int4_linear(x, *linear.args())
    unfused = lambda: reference.int4_linear(x, *linear.args())
    return fused, unfused, int(weight_bytes + (tokens * H + tokens * inter) * dtype.itemsize)


def case_rope_qkv(tokens, arch, dtype, ops):
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb as neox_rope
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_rope

    _, _, hq, hkv, D, R, interleaved = ARCHS[arch]
    W = (hq + 2 * hkv) * D
    qkv = _rand(1, tokens, W, dtype=dtype)
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
    gate_up = _rand(tokens, 2 * inter, dtype=dtype)
    gate, up = _rand(tokens, inter, dtype=dtype), _rand(tokens, inter, dtype=dtype)
    fused = lambda: ops.silu_and_mul(gate_up)
    unfused = lambda: F.silu(gate) * up
    return fused, unfused, 3 * tokens * inter * dtype.itemsize


def case_bias_gelu(tokens, arch, dtype, ops):
    inter = ARCHS[arch][1]
    h, b = _rand(tokens, inter, dtype=dtype), _rand(inter, dtype=dtype)
    fused = lambda: ops.bias_gelu(h, b, False)
    # HF adds this bias inside the GEMM (addmm epilogue) and then runs GELU alone; we compare with that GELU.
    unfused = lambda: F.gelu(h)
    return fused, unfused, (2 * tokens * inter + inter) * dtype.itemsize


def _copies(nbytes: int) -> int:
    """Input copies to cycle through so that repeated calls read HBM, not L2 (>= 256 MB in all)."""
    return max(1, min(64, (256 << 20) // max(nbytes, 1) + 1))


def _rope_cache_args(batch, arch, dtype, capacity=1024):
    """cos, sin, slot, pad, k_cache, v_cache, heads of a decode step at position 500 (rope_qkv_cache's arguments
    after qkv)."""
    _, _, hq, hkv, D, rot, interleaved = ARCHS[arch]
    kc, vc = _rand(batch, hkv, capacity, D, dtype=dtype), _rand(batch, hkv, capacity, D, dtype=dtype)
    angles = torch.randn(capacity, rot // 2, device="cuda")
    cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
    slot, pad = torch.tensor([500], device="cuda"), torch.zeros(batch, dtype=torch.long, device="cuda")
    return cos, sin, slot, pad, kc, vc, hq, hkv, D, interleaved


def case_rope_qkv_cache(batch, arch, dtype, ops, _variant):
    """The attention prologue of a decode step on its own (after a cuBLAS QKV projection, batch 4-8): RoPE on q
    and k, K and V written into the static cache slot; against HF's apply_rotary_pos_emb and StaticCache's
    index_copy_ of the new key and value."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    _, _, hq, hkv, D, R, _ = ARCHS[arch]
    W = (hq + 2 * hkv) * D
    rope = _rope_cache_args(batch, arch, dtype)
    cos, sin, slot, _, kc, vc = rope[:6]
    qkv = _rand(batch, W, dtype=dtype)
    fused = lambda: ops.rope_qkv_cache(qkv, *rope)

    def unfused():  # the non-interleaved layout for every shape: the HF-side cost is the same
        q, k, v = qkv.view(batch, 1, -1, D).transpose(1, 2).split([hq, hkv, hkv], dim=1)
        c, s_ = cos[slot][None], sin[slot][None]
        if R < D:  # partial rotary, as GPT-NeoX applies it
            q_rot, k_rot = apply_rotary_pos_emb(q[..., :R], k[..., :R], c, s_)
            q, k = torch.cat([q_rot, q[..., R:]], -1), torch.cat([k_rot, k[..., R:]], -1)
        else:
            q, k = apply_rotary_pos_emb(q, k, c, s_)
        kc.index_copy_(2, slot, k)
        vc.index_copy_(2, slot, v)
        return q

    return [fused], [unfused], (2 * batch * W + 2 * R) * dtype.itemsize


def _norm_prologue(batch, k, arch, dtype, ops, x):
    """The decode step's add + norm in front of a projection: the prologue arguments, and the same work as our
    separate kernel (LLaMA/Qwen2: x + delta, RMSNorm; Pythia: x + attn + mlp, both LayerNorms)."""
    d = _rand(batch, k, dtype=dtype)
    w1, b1 = _rand(k, dtype=dtype), _rand(k, dtype=dtype)
    if arch != "pythia-2.8b":
        return (d, None, w1, None, None, None, 1e-5, True), lambda: ops.add_rms_norm(x, d, w1, 1e-5)[0]
    pro = (d, d, w1, b1, w1, b1, 1e-5, False)
    return pro, lambda: ops.add_dual_layer_norm(x, d, d, w1, b1, w1, b1, 1e-5)[0]


def case_gemv(batch, arch, dtype, ops, which):
    """A decode-step linear: ours (activation fused) against F.linear (cuBLAS) and the separate activation;
    "qkv_rope": the QKV GEMV with RoPE and the KV-cache writes fused, against F.linear and rope_qkv_cache;
    "norm_qkv_rope" / "norm_mlp_in": also the residual add + norm in the prologue, against the same with our
    separate add + norm kernel in front (what the step runs at 4-8 rows)."""
    H, inter, hq, hkv, D, _, _ = ARCHS[arch]
    gated = arch != "pythia-2.8b"
    if which == "norm_mlp_in" and not gated:
        return None  # GPT-NeoX's MLP reads the second LayerNorm that the QKV op's prologue wrote
    n, k, act = {
        "qkv": ((hq + 2 * hkv) * D, H, "none"),
        "qkv_rope": ((hq + 2 * hkv) * D, H, "none"),
        "norm_qkv_rope": ((hq + 2 * hkv) * D, H, "none"),
        "norm_mlp_in": (inter, H, "silu_mul"),
        "out": (H, hq * D, "none"),
        "mlp_in": (inter, H, "silu_mul" if gated else "gelu"),
        "mlp_out": (H, inter, "none"),
    }[which]
    rows = 2 * n if act == "silu_mul" else n
    nbytes = (rows * k + batch * k + batch * n) * dtype.itemsize
    copies = _copies(rows * k * dtype.itemsize)
    weights = [_rand(rows, k, dtype=dtype) * k**-0.5 for _ in range(copies)]
    bias = _rand(rows, dtype=dtype) if which.startswith("qkv") and arch == "qwen2-1.5b" else None
    x = _rand(batch, k, dtype=dtype)
    if which in ("qkv_rope", "norm_qkv_rope"):  # the dense attention prologue in one kernel
        rope = _rope_cache_args(batch, arch, dtype)
        if which == "qkv_rope":  # RoPE and the cache writes in the GEMV's epilogue
            fused = [lambda w=w: ops.norm_gemv_rope_cache(x, *(None,) * 6, 0.0, False, w, bias, *rope) for w in weights]
            return fused, [lambda w=w: ops.rope_qkv_cache(F.linear(x, w, bias), *rope) for w in weights], nbytes
        # and the add + norm of the residual stream in its prologue (the decode step at 1-3 rows)
        pro, separate_norm = _norm_prologue(batch, k, arch, dtype, ops, x)
        fused = [lambda w=w: ops.norm_gemv_rope_cache(x, *pro, w, bias, *rope) for w in weights]
        unfused = [lambda w=w: ops.rope_qkv_cache(F.linear(separate_norm(), w, bias), *rope) for w in weights]
        return fused, unfused, nbytes + (2 if gated else 4) * batch * k * dtype.itemsize
    if which == "norm_mlp_in":  # the add + norm before the MLP (LLaMA/Qwen2) fused into the gate/up GEMV
        pro, separate_norm = _norm_prologue(batch, k, arch, dtype, ops, x)
        fused = [lambda w=w: ops.norm_gemv(x, *pro, w, bias, act) for w in weights]
        unfused = [lambda w=w: ops.gemv(separate_norm(), w, bias, act) for w in weights]
        return fused, unfused, nbytes + 2 * batch * k * dtype.itemsize
    fused = [lambda w=w: ops.gemv(x, w, bias, act) for w in weights]

    def unfused_call(w):
        y = F.linear(x, w, bias)
        if act == "silu_mul":
            gate, up = y.chunk(2, dim=-1)
            return F.silu(gate) * up
        return F.gelu(y) if act == "gelu" else y

    return fused, [lambda w=w: unfused_call(w) for w in weights], nbytes


def case_decode_attention(batch, arch, dtype, ops, context):
    """Attention of one new token over `context` cached tokens: ours reads the filled part of the static cache;
    HF's static cache + SDPA reads all of it (here 8192 slots, as a cache sized for long generations would be)."""
    from patcher.ops import decode_attention_workspace

    _, _, hq, hkv, D, _, _ = ARCHS[arch]
    capacity = 8192
    cache_bytes = 2 * batch * hkv * capacity * D * dtype.itemsize
    copies = _copies(cache_bytes * context // capacity)
    caches = [
        (_rand(batch, hkv, capacity, D, dtype=dtype), _rand(batch, hkv, capacity, D, dtype=dtype))
        for _ in range(copies)
    ]
    q = _rand(batch, hq, D, dtype=dtype)
    slot = torch.tensor([context - 1], device="cuda")
    pad = torch.zeros(batch, dtype=torch.long, device="cuda")
    splits = max(1, min(16, -(-2 * torch.cuda.get_device_properties(0).multi_processor_count // (batch * hkv))))
    workspace = decode_attention_workspace(batch, hq, hkv, D, splits, "cuda")
    mask = torch.zeros(batch, 1, 1, capacity, dtype=dtype, device="cuda")
    mask[..., context:] = float("-inf")
    fused = [lambda k=k, v=v: ops.decode_attention(q, k, v, slot, pad, D**-0.5, splits, workspace) for k, v in caches]
    q4 = q[:, :, None, :]
    unfused = [
        lambda k=k, v=v: F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, enable_gqa=hq != hkv)
        for k, v in caches
    ]
    nbytes = (2 * batch * hkv * context * D + 2 * batch * hq * D) * dtype.itemsize
    return fused, unfused, nbytes


def case_next_token(batch, arch, dtype, ops, _variant):
    """The decode step's end: next_token (argmax, token write, slot advance, the next input's embedding) against
    the torch ops it replaced (argmax, index_copy_, the slot add, the token read and the embedding lookup). The
    logits are read where the lm_head left them (L2) on both sides; the slot grows by one per call, so the token
    table is wide enough for every call of the timing."""
    from patcher import random_models
    from patcher.ops import next_token_workspace

    H, V = ARCHS[arch][0], random_models.config(arch).vocab_size
    logits = _rand(batch, V, dtype=dtype)
    embed = torch.zeros(V, H, dtype=dtype, device="cuda")
    tokens = torch.zeros(batch, 1 << 15, dtype=torch.long, device="cuda")
    slot = torch.zeros(1, dtype=torch.long, device="cuda")
    finished = torch.zeros(batch, dtype=torch.bool, device="cuda")
    eos = torch.full((8,), -1, dtype=torch.long, device="cuda")
    pad = torch.zeros((), dtype=torch.long, device="cuda")
    x = torch.empty(batch, H, dtype=dtype, device="cuda")
    workspace = next_token_workspace(batch, "cuda")

    def fused():
        ops.next_token(logits, tokens, slot, finished, eos, pad, embed, x, workspace)

    def unfused():
        tokens.index_copy_(1, slot + 1, logits.argmax(dim=-1)[:, None])
        slot.add_(1)
        return F.embedding(tokens.index_select(1, slot).squeeze(1), embed)

    return [fused], [unfused], (batch * V + 2 * batch * H) * dtype.itemsize


def _random_int4(k, widths, group_size=128):
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


def case_int4(batch, arch, dtype, ops, which):
    """A decode-step GPTQ int4 linear (g128). "norm_qkv": the fused [add +] norm -> int4 QKV -> RoPE -> cache op,
    against the same work as separate ops (add+norm kernel, int4 matrix-vector product, rope_qkv_cache).
    "norm_mlp_in" (LLaMA/Qwen2): the add + RMSNorm -> int4 gate/up -> SwiGLU op of the decode step, against the
    separate add+norm kernel in front of the int4 gate/up."""
    from patcher.ops import int4 as int4_ops

    H, inter, hq, hkv, D, _, interleaved = ARCHS[arch]
    gated = arch != "pythia-2.8b"
    if which == "norm_mlp_in" and not gated:
        return None  # GPT-NeoX's MLP input runs in the QKV op (int4_neox: qkv_mlp)
    k, widths, act = {
        "norm_qkv": (H, [(hq + 2 * hkv) * D] if interleaved else [hq * D, hkv * D, hkv * D], "none"),
        "out": (hq * D, [H], "none"),
        "mlp_in": (H, [inter, inter] if gated else [inter], "silu_mul" if gated else "gelu"),
        "norm_mlp_in": (H, [inter, inter], "silu_mul"),
        "mlp_out": (inter, [H], "none"),
    }[which]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n_total = sum(widths)
    weight_bytes = k * n_total // 2 + (k // 128) * n_total * 2 + (k // 128) * n_total // 8 * 4
    linears = [_random_int4(k, widths) for _ in range(_copies(weight_bytes))]
    head = D if which == "norm_qkv" else None
    splits = int4_ops.splits_for(batch, linears[0], sms, head, dtype)  # as the decode step picks them
    workspace = torch.zeros(int4_ops.workspace_numel(batch, linears[0], splits, head), dtype=torch.int32, device="cuda")
    x = _rand(batch, k, dtype=dtype)
    nbytes = weight_bytes + (batch * k + batch * (widths[0] if act == "silu_mul" else n_total)) * dtype.itemsize
    if which == "norm_mlp_in":
        pro, separate_norm = _norm_prologue(batch, k, arch, dtype, ops, x)
        fused = [lambda w=w: ops.int4_gemv(x, *pro, *w.args(), act, splits, workspace) for w in linears]
        unfused = [lambda w=w: ops.silu_and_mul(ops.int4_linear(separate_norm(), *w.args())) for w in linears]
        return fused, unfused, nbytes + 2 * batch * k * dtype.itemsize  # the delta read, the residual sum written
    if which != "norm_qkv":
        none = (None,) * 6 + (0.0, False)
        fused = [lambda w=w: ops.int4_gemv(x, *none, *w.args(), act, splits, workspace) for w in linears]

        def unfused_call(w):
            y = ops.int4_linear(x, *w.args())
            return ops.silu_and_mul(y) if act == "silu_mul" else (F.gelu(y) if act == "gelu" else y)

        return fused, [lambda w=w: unfused_call(w) for w in linears], nbytes
    # Pythia: the whole parallel-residual junction, both LayerNorms (the second one is the MLP's input)
    pro, separate_norm = _norm_prologue(batch, k, arch, dtype, ops, x)
    rope = _rope_cache_args(batch, arch, dtype)
    fused = [lambda w=w: ops.int4_qkv_rope_cache(x, *pro, *w.args(), *rope, splits, workspace) for w in linears]

    def unfused_call(w):
        qkv = ops.int4_linear(separate_norm(), *w.args())
        return ops.rope_qkv_cache(qkv, *rope)

    nbytes += (2 if gated else 4) * batch * k * dtype.itemsize  # the delta(s) read and the residual sum written
    return fused, [lambda w=w: unfused_call(w) for w in linears], nbytes


def case_int4_neox(batch, arch, dtype, ops, which):
    """GPT-NeoX's merged int4 decode ops (g128) against the two launches each replaces, as the decode step ran them
    before (patcher/decode/runner.py): "qkv_mlp", the adds, both LayerNorms, QKV with RoPE and the cache writes, and
    the MLP's input projection with GELU in one launch (int4_qkv_mlp_in), against int4_qkv_rope_cache (writing the
    second LayerNorm) then int4_gemv on it; "out_pair", both output projections as one GEMV over [attention | MLP
    hidden] (int4_gemv_cat), against two int4_gemv."""
    from patcher.ops import int4 as int4_ops

    H, inter, hq, hkv, D, _, _ = ARCHS[arch]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    none = (None,) * 6 + (0.0, False)

    def setup(linear, head):
        splits = int4_ops.splits_for(batch, linear, sms, head, dtype)
        workspace = torch.zeros(int4_ops.workspace_numel(batch, linear, splits, head), dtype=torch.int32, device="cuda")
        return splits, workspace

    if which == "qkv_mlp":
        weight_bytes = int(H * ((hq + 2 * hkv) * D + inter) * (1 / 2 + 2 / 128 + 1 / 256))
        pairs = [
            (_random_int4(H, [(hq + 2 * hkv) * D]), _random_int4(H, [inter])) for _ in range(_copies(weight_bytes))
        ]
        merged = [int4_ops.side_by_side(qkv, mlp) for qkv, mlp in pairs]
        x = _rand(batch, H, dtype=dtype)
        pro, _ = _norm_prologue(batch, H, arch, dtype, ops, x)
        rope = _rope_cache_args(batch, arch, dtype)
        splits, workspace = setup(merged[0], D)
        qkv_splits, qkv_ws = setup(pairs[0][0], D)
        mlp_splits, mlp_ws = setup(pairs[0][1], None)
        fused = [
            lambda w=w: ops.int4_qkv_mlp_in(x, *pro, *w.args(), *rope, 1, "gelu", splits, workspace) for w in merged
        ]

        def unfused_call(qkv, mlp):
            _, _, h2 = ops.int4_qkv_rope_cache(x, *pro, *qkv.args(), *rope, qkv_splits, qkv_ws)
            return ops.int4_gemv(h2, *none, *mlp.args(), "gelu", mlp_splits, mlp_ws)

        nbytes = weight_bytes + (4 * batch * H + batch * inter) * dtype.itemsize
        return fused, [lambda p=p: unfused_call(*p) for p in pairs], int(nbytes)
    k1 = hq * D  # out_pair: [attention | MLP hidden] @ [W_dense; W_out]
    weight_bytes = int((k1 + inter) * H * (1 / 2 + 2 / 128 + 1 / 256))
    pairs = [(_random_int4(k1, [H]), _random_int4(inter, [H])) for _ in range(_copies(weight_bytes))]
    stacked = [_random_int4(k1 + inter, [H]) for _ in pairs]  # the same sizes; the values do not matter here
    attn, hidden = _rand(batch, k1, dtype=dtype), _rand(batch, inter, dtype=dtype)
    splits, workspace = setup(stacked[0], None)
    dense_splits, dense_ws = setup(pairs[0][0], None)
    out_splits, out_ws = setup(pairs[0][1], None)
    fused = [lambda w=w: ops.int4_gemv_cat(attn, hidden, *w.args(), splits, workspace) for w in stacked]

    def unfused_call(dense, out):
        a = ops.int4_gemv(attn, *none, *dense.args(), "none", dense_splits, dense_ws)[0]
        return a, ops.int4_gemv(hidden, *none, *out.args(), "none", out_splits, out_ws)[0]

    nbytes = weight_bytes + (batch * (k1 + inter) + batch * H) * dtype.itemsize
    return fused, [lambda p=p: unfused_call(*p) for p in pairs], int(nbytes)


DECODE_CASES = {  # op -> (builder, architectures, variants)
    "gemv": (
        case_gemv,
        ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"],
        ["qkv", "qkv_rope", "norm_qkv_rope", "out", "mlp_in", "norm_mlp_in", "mlp_out"],
    ),
    "decode_attention": (case_decode_attention, ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"], [256, 512, 4096]),
    "rope_qkv_cache": (case_rope_qkv_cache, ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"], [""]),
    "int4": (
        case_int4,
        ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"],
        ["norm_qkv", "out", "mlp_in", "norm_mlp_in", "mlp_out"],
    ),
    "int4_neox": (case_int4_neox, ["pythia-2.8b"], ["qkv_mlp", "out_pair"]),
    "next_token": (case_next_token, ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"], [""]),
}


def graph_time_us(calls: list, reps: int = 20) -> float:
    """GPU time per call (us) of `calls` run round-robin inside one CUDA graph (200 calls per replay)."""
    per_replay = 200
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(per_replay):
            calls[i % len(calls)]()
    return common.gpu_time_ms(graph.replay, reps=reps, warmup=2) * 1e3 / per_replay


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
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m evals.ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ops", default=None, help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--dtypes", default="fp32,fp16,bf16")
    parser.add_argument("--tokens", default="1,4096")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--decode-batches", default="1,4,8", help="batch sizes for the decode-path ops")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("error: evals.ops times CUDA kernels and needs a GPU")

    from patcher.ops import backend_for

    ops = backend_for(torch.device("cuda"), "kernels")
    names = args.ops.split(",") if args.ops else list(CASES) + list(DECODE_CASES)
    dtypes = [common.DTYPES[d] for d in args.dtypes.split(",")]
    token_counts = [int(t) for t in args.tokens.split(",")]
    bandwidth = common.hbm_read_bandwidth_gbs(torch.device("cuda"))
    jobs = [
        (op, arch, dt, t, None)
        for op in names
        if op in CASES
        for arch in CASES[op][1]
        for dt in dtypes
        for t in token_counts
    ]
    batches = [int(b) for b in args.decode_batches.split(",")]
    jobs += [
        (op, arch, dt, b, v)
        for op in names
        if op in DECODE_CASES
        for arch in DECODE_CASES[op][1]
        for dt in dtypes
        if dt != torch.float32
        for b in batches
        for v in DECODE_CASES[op][2]
    ]
    rows = []
    for op, arch, dtype, tokens, variant in tqdm(jobs, desc="ops", file=sys.stderr):
        if op in CASES:
            case = CASES[op][0](tokens, arch, dtype, ops)
            if case is None:  # not measured at this token count
                continue
            fused, unfused, nbytes = case
            if tokens > 1:
                fused_us = common.gpu_time_ms(fused, reps=args.reps, flush=True) * 1e3
                unfused_us = common.gpu_time_ms(unfused, reps=args.reps, flush=True) * 1e3
            else:
                fused_us, unfused_us = graph_time_us([fused]), graph_time_us([unfused])
        else:
            case = DECODE_CASES[op][0](tokens, arch, dtype, ops, variant)
            if case is None:  # the variant does not apply to this architecture
                continue
            fused, unfused, nbytes = case
            fused_us, unfused_us = graph_time_us(fused), graph_time_us(unfused)
        gbs = nbytes / (fused_us * 1e-6) / 1e9
        rows.append(
            {
                "op": f"{op}[{variant}]" if variant else op,
                "arch": arch,
                "tokens": tokens,
                "dtype": str(dtype).replace("torch.", ""),
                "fused_us": fused_us,
                "unfused_us": unfused_us,
                "speedup": unfused_us / fused_us,
                "bytes": nbytes,
                "fused_gbs": gbs,
                "pct_hbm": 100 * gbs / bandwidth,
            }
        )
        del fused, unfused
        torch.cuda.empty_cache()
    print(
        common.table(
            rows,
            [
                ("op", "op", ""),
                ("arch", "shape", ""),
                ("tokens", "tokens/batch", "d"),
                ("dtype", "dtype", ""),
                ("fused_us", "fused us", ".1f"),
                ("unfused_us", "unfused us", ".1f"),
                ("speedup", "speedup", ".2f"),
                ("fused_gbs", "fused GB/s", ".0f"),
                ("pct_hbm", "% HBM", ".0f"),
            ],
        )
    )
    print(f"measured HBM read bandwidth: {bandwidth:.0f} GB/s")
    common.write_json(
        args.json,
        {
            "tool": "evals.ops",
            "hbm_read_bandwidth_gbs": bandwidth,
            "environment": common.environment(torch.device("cuda"), "evals.ops"),
            "results": rows,
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
