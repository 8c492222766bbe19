"""The `patcher::` torch ops: one schema line each, the pure-torch reference as the CPU kernel, a fake kernel.

The schemas live here, in Python, beside their references. The CUDA kernels are registered for the same names
by the compiled extension (`kernels/torch_bindings.cpp`, `TORCH_LIBRARY_IMPL(patcher, CUDA, m)`), which is
loaded on first use on a CUDA machine. The fake kernels give shapes to torch.compile and FakeTensor tracing;
every op returns fresh contiguous tensors that alias none of its inputs. The ops that also write into an argument
(the decode path's KV caches, workspaces and loop state) mark it `Tensor(a!)` in their schema; all are safe to
capture in CUDA graphs.
"""

from __future__ import annotations

import functools

import torch

from . import reference as ref

_lib = torch.library.Library("patcher", "DEF")


def _fresh(t: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """A contiguous output that shares no memory with any input (a custom op's output must not alias)."""
    storage = t.untyped_storage().data_ptr()
    shares = any(isinstance(i, torch.Tensor) and i.untyped_storage().data_ptr() == storage for i in inputs)
    if t.is_contiguous() and not shares:
        return t
    return t.clone(memory_format=torch.contiguous_format)


_NAMES: list[str] = []


@functools.cache  # once per process
def _register_inductor_fallbacks() -> None:
    """Registers Inductor's fallback (the op called as it is) for every patcher:: op, once, when torch.compile
    first traces one of them (from the fake kernels below, which tracing runs before Inductor lowers the graph).

    Inductor creates the same fallback by itself the first time it meets an op without a lowering ("implicit
    fallback"), with the same layout constraint, but torch up to 2.11 first formats the whole IR behind the op's
    inputs into a log message, even with logging off. That text grows exponentially with the depth of the graph:
    GPT-NeoX's final add_layer_norm is first met after all the layers, and the Pythia-2.8B decode step (32
    layers) was still compiling after 4 minutes on the H100 with torch 2.11.
    """
    try:  # Inductor internals; where they differ, Inductor's implicit fallback still works
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return
    for name in _NAMES:
        op = getattr(torch.ops.patcher, name).default
        if op not in lowerings:
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False)


def _define(schema: str, reference, fake) -> None:
    name = schema.split("(", 1)[0]
    _lib.define(schema)
    _NAMES.append(name)

    def cpu_kernel(*args):
        out = reference(*args)
        if out is None:  # an op that only writes into its (a!) arguments
            return None
        if isinstance(out, tuple):
            return tuple(_fresh(o, args) for o in out)
        return _fresh(out, args)

    def fake_kernel(*args, **kwargs):
        _register_inductor_fallbacks()
        return fake(*args, **kwargs)

    _lib.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"patcher::{name}", fake_kernel, lib=_lib)


def _like(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


# Norms: one CUDA kernel template (kernels/norm.cu) serves all six.
_define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", ref.rms_norm, lambda x, w, eps: _like(x))
_define(
    "add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
    ref.add_rms_norm,
    lambda x, d, w, eps: (_like(x), _like(x)),
)
_define(
    "layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    ref.layer_norm,
    lambda x, w, b, eps: _like(x),
)
_define(
    "dual_layer_norm(Tensor x, Tensor weight, Tensor? bias, Tensor weight2, Tensor? bias2, float eps)"
    " -> (Tensor, Tensor)",
    ref.dual_layer_norm,
    lambda x, w, b, w2, b2, eps: (_like(x), _like(x)),
)
_define(
    "add_layer_norm(Tensor x, Tensor delta, Tensor? delta2, Tensor weight, Tensor? bias, float eps)"
    " -> (Tensor, Tensor)",
    ref.add_layer_norm,
    lambda x, d, d2, w, b, eps: (_like(x), _like(x)),
)
_define(
    "add_dual_layer_norm(Tensor x, Tensor delta, Tensor? delta2, Tensor weight, Tensor? bias, Tensor weight2,"
    " Tensor? bias2, float eps) -> (Tensor, Tensor, Tensor)",
    ref.add_dual_layer_norm,
    lambda x, d, d2, w, b, w2, b2, eps: (_like(x), _like(x), _like(x)),
)


def _rope_qkv_fake(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim, interleaved):
    B, T, _ = qkv.shape
    q = qkv.new_empty((B, num_q_heads, T, head_dim))
    kv = (B, num_kv_heads, T, head_dim)
    return q, qkv.new_empty(kv), qkv.new_empty(kv)


_define(
    "rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int num_q_heads, int num_kv_heads, int head_dim,"
    " bool interleaved) -> (Tensor, Tensor, Tensor)",
    ref.rope_qkv,
    _rope_qkv_fake,
)
_define(
    "silu_and_mul(Tensor x) -> Tensor",
    ref.silu_and_mul,
    lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
)
_define("bias_gelu(Tensor x, Tensor? bias, bool tanh) -> Tensor", ref.bias_gelu, lambda x, b, tanh: _like(x))


# Decode path: matrix-vector products with fused epilogues, the attention prologue writing into a static KV cache,
# and attention over the filled part of that cache.
def _gemv_fake(x, weight, bias, activation):
    n = weight.shape[0] // 2 if activation == "silu_mul" else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


_define("gemv(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor", ref.gemv, _gemv_fake)

# The decode GEMVs behind the fused residual add + norm (the same prologue as the int4 ops): (out, sum, h2).
_PROLOGUE = (
    "Tensor x, Tensor? delta, Tensor? delta2, Tensor? norm_weight, Tensor? norm_bias, Tensor? norm_weight2,"
    " Tensor? norm_bias2, float eps, bool rms"
)


def _prologue_fakes(x, delta, norm_weight2):
    return (_like(x) if delta is not None else x.new_empty(0)), (
        _like(x) if norm_weight2 is not None else x.new_empty(0)
    )


_define(
    f"norm_gemv({_PROLOGUE}, Tensor weight, Tensor? bias, str activation) -> (Tensor, Tensor, Tensor)",
    ref.norm_gemv,
    lambda x, d, d2, w, b, w2, b2, eps, rms, weight, bias, act: (
        _gemv_fake(x, weight, bias, act),
        *_prologue_fakes(x, d, w2),
    ),
)
_define(
    f"norm_gemv_rope_cache({_PROLOGUE}, Tensor weight, Tensor? bias, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(a!) k_cache, Tensor(b!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved)"
    " -> (Tensor, Tensor, Tensor)",
    ref.norm_gemv_rope_cache,
    lambda x, d, d2, w, b, w2, b2, eps, rms, weight, bias, cos, sin, slot, pad, kc, vc, hq, hkv, hd, inter: (
        x.new_empty((x.shape[0], hq, hd)),
        *_prologue_fakes(x, d, w2),
    ),
)
_define(
    "rope_qkv_cache(Tensor qkv, Tensor cos, Tensor sin, Tensor slot, Tensor pad, Tensor(a!) k_cache,"
    " Tensor(b!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved) -> Tensor",
    ref.rope_qkv_cache,
    lambda qkv, cos, sin, slot, pad, kc, vc, hq, hkv, d, inter: qkv.new_empty((qkv.shape[0], hq, d)),
)
_define(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot, Tensor pad, float scale, int splits,"
    " Tensor(a!) workspace) -> Tensor",
    ref.decode_attention,
    lambda q, kc, vc, slot, pad, scale, splits, ws: q.new_empty((q.shape[0], q.shape[1] * q.shape[2])),
)
_define(
    "decode_attention_qkv_acc(Tensor acc, Tensor? bias_rows, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(a!) k_cache, Tensor(b!) v_cache, int num_q_heads, bool interleaved, float scale, int splits,"
    " Tensor(c!) workspace) -> Tensor",
    ref.decode_attention_qkv_acc,
    lambda acc, bias, cos, sin, slot, pad, kc, vc, hq, inter, scale, splits, ws: kc.new_empty(
        (kc.shape[0], hq * kc.shape[3])
    ),
)

# The decode loop's step after the lm_head (or the sampling warpers): it writes the decode state in place.
_define(
    "next_token(Tensor scores, Tensor(a!) tokens, Tensor(b!) slot, Tensor(c!) finished, Tensor eos, Tensor pad_token,"
    " Tensor? embed_weight, Tensor(d!) x, Tensor(e!) workspace) -> ()",
    ref.next_token,
    lambda *args: None,
)

# GPTQ int4: a linear is given as parallel lists of its segments' tensors (q, k, v or gate, up side by side).
_INT4 = (
    "Tensor[] qweight, Tensor[] qzeros, Tensor[] scales, Tensor[] g_idx, Tensor?[] bias, int group_size,"
    " bool act_order, int zero_offset"
)


def _int4_gemv_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, activation, splits, ws):
    n = qw[0].shape[1] if activation == "silu_mul" else sum(q.shape[1] for q in qw)
    return (x.new_empty((*x.shape[:-1], n)), *_prologue_fakes(x, delta, w2))


def _int4_qkv_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, *rope):
    hq, d = rope[6], rope[8]  # (cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, ...)
    return (x.new_empty((x.shape[0], hq, d)), *_prologue_fakes(x, delta, w2))


_define(
    f"int4_linear(Tensor x, {_INT4}) -> Tensor",
    ref.int4_linear,
    lambda x, qw, qz, sc, gi, b, gs, ao, zo: x.new_empty((*x.shape[:-1], sum(q.shape[1] for q in qw))),
)
_define(
    f"int4_gemv({_PROLOGUE}, {_INT4}, str activation, int splits, Tensor(a!) workspace) -> (Tensor, Tensor, Tensor)",
    ref.int4_gemv,
    _int4_gemv_fake,
)
_define(
    f"int4_gemv_cat(Tensor x, Tensor x2, {_INT4}, int splits, Tensor(a!) workspace, bool x2_early=False) -> Tensor",
    ref.int4_gemv_cat,
    lambda x, x2, qw, qz, sc, gi, b, gs, ao, zo, splits, ws, early=False: x.new_empty(
        (x.shape[0], sum(q.shape[1] for q in qw))
    ),
)
_define(
    f"int4_gemv_acc(Tensor x, Tensor? x2, {_INT4}, int splits, Tensor(a!) workspace, Tensor(b!) acc,"
    " Tensor(c!)? clear=None, bool x2_early=False) -> ()",
    ref.int4_gemv_acc,
    lambda *args, **kwargs: None,
)
_define(
    f"int4_norm_gemv_acc({_PROLOGUE}, {_INT4}, int splits, Tensor(a!) workspace, Tensor(b!) acc,"
    " Tensor(c!)? clear=None) -> (Tensor, Tensor)",
    ref.int4_norm_gemv_acc,
    lambda x, delta, d2, w, b, w2, b2, *rest, **kwargs: _prologue_fakes(x, delta, w2),
)
_define(
    f"int4_norm_prologue({_PROLOGUE}) -> (Tensor, Tensor, Tensor)",
    ref.int4_norm_prologue,
    lambda x, delta, d2, w, b, w2, b2, eps, rms: (_like(x), *_prologue_fakes(x, delta, w2)),
)
_define(
    f"int4_qkv_rope_cache({_PROLOGUE}, {_INT4}, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(b!) k_cache, Tensor(c!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved,"
    " int splits, Tensor(a!) workspace) -> (Tensor, Tensor, Tensor)",
    ref.int4_qkv_rope_cache,
    _int4_qkv_fake,
)


def _int4_qkv_mlp_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, *rest):
    hq, d, qkv_segments = rest[6], rest[8], rest[10]  # (cos, sin, slot, pad, k_cache, v_cache, hq, hkv, d, inter, n)
    hidden = sum(q.shape[1] for q in qw[qkv_segments:])
    sum_ = _like(x) if delta is not None else x.new_empty(0)
    return x.new_empty((x.shape[0], hq, d)), x.new_empty((x.shape[0], hidden)), sum_


_define(
    f"int4_qkv_mlp_in({_PROLOGUE}, {_INT4}, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(b!) k_cache, Tensor(c!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved,"
    " int qkv_segments, str activation, int splits, Tensor(a!) workspace, Tensor? x2=None)"
    " -> (Tensor, Tensor, Tensor)",
    ref.int4_qkv_mlp_in,
    _int4_qkv_mlp_fake,
)


# The int4 decode step as one persistent kernel (kernels/step.cuh), for the decode runner (patcher/decode/step.py).
# CUDA only: its pure-torch reference is the runner's per-op step, which the GPU tests compare it against. The plan
# holds pointers into the tensors it is built from; int4_step writes the caches and buffers of that plan.
_lib.define(
    "int4_step_plan(Tensor[] qweight, Tensor[] qzeros, Tensor[] scales, Tensor?[] bias, int[] segments,"
    " int group_size, int zero_offset, Tensor[] norm_weight, Tensor?[] norm_bias, float eps, bool rms,"
    " bool parallel_residual, str mlp_act, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved,"
    " float scale, int splits, Tensor cos, Tensor sin, Tensor slot, Tensor pad, Tensor k_cache, Tensor v_cache,"
    " Tensor resid, Tensor delta, Tensor qkv, Tensor attn, Tensor act, Tensor? timeline=None)"
    " -> (Tensor, Tensor, Tensor, int)"
)
_lib.define("int4_step(Tensor header, Tensor arrays, Tensor(a!) workspace) -> ()")
