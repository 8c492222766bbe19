"""The decode step's ops `python -m evals.ops` times at batch 1-8, each against the unfused sequence it replaces
(F.linear through cuBLAS, SDPA over HF's static cache, our own separate kernels where the fusion joins two of
them). A case builder returns (fused calls, unfused calls, bytes the fused op must move at least): one call per
copy of the inputs, so that a graph of them reads HBM, not L2; or None where the variant does not apply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .op_cases import ARCHS, gguf_blocks, input_copies, rand, random_int4


def _rope_cache_args(batch, arch, dtype, capacity=1024):
    """cos, sin, slot, pad, k_cache, v_cache, heads of a decode step at position 500 (rope_qkv_cache's arguments
    after qkv)."""
    _, _, hq, hkv, D, rot, interleaved = ARCHS[arch]
    kc, vc = rand(batch, hkv, capacity, D, dtype=dtype), rand(batch, hkv, capacity, D, dtype=dtype)
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
    qkv = rand(batch, W, dtype=dtype)
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
    d = rand(batch, k, dtype=dtype)
    w1, b1 = rand(k, dtype=dtype), rand(k, dtype=dtype)
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
    copies = input_copies(rows * k * dtype.itemsize)
    weights = [rand(rows, k, dtype=dtype) * k**-0.5 for _ in range(copies)]
    bias = rand(rows, dtype=dtype) if which.startswith("qkv") and arch == "qwen2-1.5b" else None
    x = rand(batch, k, dtype=dtype)
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
    copies = input_copies(cache_bytes * context // capacity)
    caches = [
        (rand(batch, hkv, capacity, D, dtype=dtype), rand(batch, hkv, capacity, D, dtype=dtype)) for _ in range(copies)
    ]
    q = rand(batch, hq, D, dtype=dtype)
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
    the torch ops it replaces (argmax, index_copy_, the slot add, the token read and the embedding lookup). The
    logits are read where the lm_head left them (L2) on both sides; the slot grows by one per call, so the token
    table is wide enough for every call of the timing."""
    from patcher import random_models
    from patcher.ops import next_token_workspace

    H, V = ARCHS[arch][0], random_models.config(arch).vocab_size
    logits = rand(batch, V, dtype=dtype)
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


def case_sample_survivors(batch, arch, dtype, ops, variant):
    """The sampling step after the lm_head, with top-k on: sample_survivors (the 2 x top_k largest logits, the warpers
    and the draw as one kernel) against the torch ops it replaces (the float32 cast, torch.topk over the vocabulary,
    then the warpers and the draw). Variants: the `sampling` preset (temperature 0.7, top-k 20, top-p 0.8) and
    transformers' default top-k with the Llama instruct configuration (0.6, 50, 0.9)."""
    from patcher import random_models
    from patcher.ops import sample_survivors_workspace
    from patcher.ops.sampling import warp_survivors

    warpers = {"k20": (0.7, 20, 0.8, 0.0), "k50": (0.6, 50, 0.9, 0.0)}[variant]
    V, m = random_models.config(arch).vocab_size, 2 * warpers[1]
    logits = rand(batch, V, dtype=dtype)
    noise = torch.empty(batch, m, device="cuda").exponential_(1.0)
    out = (torch.empty(batch, m, device="cuda"), torch.empty(batch, m, dtype=torch.long, device="cuda"),
           torch.empty(batch, m, device="cuda"))  # fmt: skip
    workspace = sample_survivors_workspace(batch, V, m, "cuda")

    def fused():
        ops.sample_survivors(logits, noise, *warpers, *out, workspace)

    def unfused():
        values, ids = torch.topk(logits.float(), m, dim=-1)
        warp_survivors(values, ids, noise, *warpers, *out)

    return [fused], [unfused], batch * V * dtype.itemsize


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
    linears = [random_int4(k, widths) for _ in range(input_copies(weight_bytes))]
    head = D if which == "norm_qkv" else None
    splits = int4_ops.splits_for(batch, linears[0], sms, head, dtype)  # as the decode step picks them
    workspace = torch.zeros(int4_ops.workspace_numel(batch, linears[0], splits, head), dtype=torch.int32, device="cuda")
    x = rand(batch, k, dtype=dtype)
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
    """GPT-NeoX's merged int4 decode ops (g128) against the two launches each replaces: "qkv_mlp", the adds, both
    LayerNorms, QKV with RoPE and the cache writes, and the MLP's input projection with GELU in one launch
    (int4_qkv_mlp_in), against int4_qkv_rope_cache (writing the second LayerNorm) then int4_gemv on it;
    "out_pair", both output projections as one GEMV over [attention | MLP hidden] (int4_gemv_cat), against two
    int4_gemv."""
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
            (random_int4(H, [(hq + 2 * hkv) * D]), random_int4(H, [inter])) for _ in range(input_copies(weight_bytes))
        ]
        merged = [int4_ops.side_by_side(qkv, mlp) for qkv, mlp in pairs]
        x = rand(batch, H, dtype=dtype)
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
    pairs = [(random_int4(k1, [H]), random_int4(inter, [H])) for _ in range(input_copies(weight_bytes))]
    stacked = [random_int4(k1 + inter, [H]) for _ in pairs]  # the same sizes; the values do not matter here
    attn, hidden = rand(batch, k1, dtype=dtype), rand(batch, inter, dtype=dtype)
    splits, workspace = setup(stacked[0], None)
    dense_splits, dense_ws = setup(pairs[0][0], None)
    out_splits, out_ws = setup(pairs[0][1], None)
    fused = [lambda w=w: ops.int4_gemv_cat(attn, hidden, *w.args(), splits, workspace) for w in stacked]

    def unfused_call(dense, out):
        a = ops.int4_gemv(attn, *none, *dense.args(), "none", dense_splits, dense_ws)[0]
        return a, ops.int4_gemv(hidden, *none, *out.args(), "none", out_splits, out_ws)[0]

    nbytes = weight_bytes + (batch * (k1 + inter) + batch * H) * dtype.itemsize
    return fused, [lambda p=p: unfused_call(*p) for p in pairs], int(nbytes)


def case_gguf(batch, arch, dtype, ops, variant):
    """A decode-step GGUF linear in W4A8 (gguf_gemv: its input kernel quantizes the activations to Q8_1), variant
    "<type>_<which>" (qkv, out, mlp_in: gate and up as one width, mlp_out), against cuBLAS on the same weight held
    dense in the dtype: the fp16 model's GEMV, which reads about 3.6x the bytes."""
    kind, which = variant[:4], variant[5:]  # "Q4_0_mlp_in" -> "Q4_0", "mlp_in"
    H, inter, hq, hkv, D = ARCHS[arch][:5]
    k, n = {"qkv": (H, (hq + 2 * hkv) * D), "out": (hq * D, H), "mlp_in": (H, 2 * inter), "mlp_out": (inter, H)}[which]
    first = gguf_blocks(kind, n, k)
    blocks = [first] + [first.clone() for _ in range(input_copies(first.numel()) - 1)]
    dense = [ops.gguf_dequantize(b, kind, dtype) for b in blocks[: input_copies(n * k * dtype.itemsize)]]
    x = rand(batch, k, dtype=dtype)
    fused = [lambda b=b: ops.gguf_gemv(x, b, kind, None, True) for b in blocks]
    unfused = [lambda w=w: F.linear(x, w) for w in dense]
    return fused, unfused, first.numel() + batch * (k + n) * dtype.itemsize


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
    "sample_survivors": (
        case_sample_survivors,
        ["smollm2-135m", "pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"],
        ["k20", "k50"],
    ),
    "gguf": (
        case_gguf,
        ["llama-3.1-8b", "qwen2-1.5b"],
        [f"{kind}_{which}" for kind in ("Q4_0", "Q4_K", "Q6_K") for which in ("qkv", "out", "mlp_in", "mlp_out")],
    ),
}
