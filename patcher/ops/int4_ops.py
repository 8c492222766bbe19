"""GPTQ int4 ops (kernels/int4/): a GPTQ linear arrives as parallel lists, one entry per segment (q, k, v or gate,
up), read side by side. Each segment computes what GPTQLinear.forward computes: x @ dequantize().to(x.dtype), then
+ bias.to(x.dtype). The decode ops (1 to 8 rows) fuse the residual add + norm in front (norm.PROLOGUE, whose delta
may be an int4_gemv_acc accumulator) and an epilogue behind; `splits` and `workspace` only shape the CUDA kernels'
work (int4.py: splits_for, workspace_numel). Planning (Int4Linear, the split rule) is in int4.py.
"""

from __future__ import annotations

import torch

from .activation import activate
from .library import define, like
from .norm import PROLOGUE, norm_prologue, prologue_fakes
from .rope import rope_qkv_cache

# The fixed point of int4_gemv_acc's accumulators, as the CUDA kernels form it (kernels/common/common.cuh: to_fixed):
# value * 2^28 in int64, each added term clamped to +-2^24 in fp32 first.
FIXED_SCALE = 2.0**28
FIXED_CLAMP = 2.0**24


def to_fixed(y: torch.Tensor) -> torch.Tensor:
    """fp32 sums -> int64 fixed point (round half to even, as __float2ll_rn). NaN -> -2^24, as the kernels' clamp."""
    y = torch.nan_to_num(y.float(), nan=-FIXED_CLAMP).clamp(-FIXED_CLAMP, FIXED_CLAMP)
    return torch.round(y * FIXED_SCALE).to(torch.int64)


def from_fixed(acc: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An accumulator as values in `dtype`: to fp32 (one rounding), then to dtype, as an op's output is rounded."""
    return (acc.to(torch.float32) / FIXED_SCALE).to(dtype)


def _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool):
    """norm.norm_prologue, with delta an int4_gemv_acc accumulator (int64) rounded to x's dtype first."""
    if norm_weight is not None and delta is not None and delta.dtype == torch.int64:
        delta = from_fixed(delta, x.dtype)
    return norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)


def int4_weight(
    qweight, qzeros, scales, g_idx, group_size: int, act_order: bool, zero_offset: int, dtype=None
) -> torch.Tensor:
    """W [K, N]: scales[g] * (q - zero[g]), g = g_idx[k] (act-order) or k // group_size. In the scales' dtype (fp16:
    each weight rounded once, as HF's GPTQ linears form it), or in `dtype` (float64: the exact weights)."""
    from ..gptq import format as fmt  # (patcher.gptq imports the patching module, which imports this one)

    K = qweight.shape[0] * fmt.PACK
    g = g_idx.long() if act_order else torch.arange(K, device=qweight.device) // group_size
    scales = scales if dtype is None else scales.to(dtype)
    return fmt.dequantize(qweight, qzeros, scales, g, version=2 if zero_offset == 0 else 1)


def int4_linear(x, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int):
    """x @ W (+ bias) per segment, side by side. A float64 x (the tests' precise runs) takes the exact weights rather
    than their fp16 rounding: the precise product of what the checkpoint means. The tensor-core decode kernel,
    which multiplies x by the exact q - zero and applies the scales to the fp32 sums (kernels/int4/int4_mma.cuh), is
    closer to it than the fp16 weights are; the other int4 kernels round each weight as HF does."""
    exact = torch.float64 if x.dtype == torch.float64 else None
    outs = []
    for qw, qz, sc, gi, b in zip(qweight, qzeros, scales, g_idx, bias):
        out = x @ int4_weight(qw, qz, sc, gi, group_size, act_order, zero_offset, exact).to(x.dtype)
        outs.append(out + b.to(x.dtype) if b is not None else out)
    return torch.cat(outs, dim=-1)


def int4_gemv(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    activation: str, splits: int, workspace,
):  # fmt: skip
    """A decode-step int4 linear (1 to 8 rows), optionally behind the fused residual add + norm of the stack.

    Returns (out, sum, h2): out = act(int4_linear(h)); h = x, or norm(sum) with sum = x + delta (+ delta2); h2 the
    second LayerNorm of sum (GPT-NeoX's MLP input). sum/h2 are empty when not asked for. `splits` and `workspace`
    only shape the CUDA kernel's work.
    """
    h, s, h2 = _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    y = int4_linear(h, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)
    return activate(y, activation), s, h2


def int4_qkv_mlp_in(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool,
    qkv_segments: int, activation: str, splits: int, workspace, x2=None,
):  # fmt: skip
    """GPT-NeoX's parallel residual in one decode-step op: [add +] both LayerNorms, then the int4 QKV projection of
    the first (segments [0, qkv_segments)) with rope_qkv_cache, and the MLP's int4 input projection of the second
    (the other segments) with its activation. Returns (q [B, Hq, D], hidden [B, MLP width], sum). Or, with x2 and
    no norm prologue, x and x2 are the two LayerNorms' outputs (int4_norm_prologue's h and h2); sum is empty."""
    if x2 is not None:
        if norm_weight is not None or delta is not None:
            raise ValueError("int4_qkv_mlp_in takes x2 only without the norm prologue")
    elif norm_weight is None or norm_weight2 is None or rms:
        raise ValueError(
            "int4_qkv_mlp_in takes both LayerNorms (norm_weight and norm_weight2), or their outputs as x and x2"
        )
    if not 1 <= qkv_segments < len(qweight):
        raise ValueError(f"int4_qkv_mlp_in needs q/k/v segments followed by the MLP's, got {qkv_segments} of "
                         f"{len(qweight)}")  # fmt: skip
    if activation not in ("none", "gelu", "gelu_tanh"):
        raise ValueError(f"int4_qkv_mlp_in takes none, gelu or gelu_tanh, got {activation!r}")
    if x2 is None:
        h, s, h2 = _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    else:
        h, s, h2 = x, x.new_empty(0), x2
    parts = [(t[:qkv_segments], t[qkv_segments:]) for t in (qweight, qzeros, scales, g_idx, bias)]
    first, second = ([p[i] for p in parts] for i in (0, 1))
    qkv = int4_linear(h, *first, group_size, act_order, zero_offset)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    hidden = int4_linear(h2, *second, group_size, act_order, zero_offset)
    return q, activate(hidden, activation), s


def int4_gemv_cat(
    x, x2, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, x2_early: bool = False,
):  # fmt: skip
    """[x | x2] @ W + b: one decode-step int4 linear over two activations side by side along k (GPT-NeoX's
    attention output and MLP hidden through its two output projections stacked along k, patcher/layers/out_pair.py).
    x [B, k1], x2 [B, k - k1]. `splits` and `workspace` only shape the CUDA kernel's work; `x2_early` promises the
    CUDA kernel that x2 was written before the stream's previous kernel began (its blocks that read only x2 then
    start before that kernel ends)."""
    return int4_linear(_cat(x, x2, qweight), qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)


def _cat(x, x2, qweight):
    """[x | x2] along k, checked against the weight's in_features."""
    if x.dim() != 2 or x2.dim() != 2 or x.shape[0] != x2.shape[0] or x.dtype != x2.dtype:
        raise ValueError(
            f"[x | x2] takes x [batch, k1] and x2 [batch, k2] of one dtype, got {x.dtype} {list(x.shape)} "
            f"and {x2.dtype} {list(x2.shape)}"
        )
    k = qweight[0].shape[0] * 8
    if x.shape[1] + x2.shape[1] != k:
        raise ValueError(f"x and x2 widths {x.shape[1]} + {x2.shape[1]} do not add up to the weight's in_features {k}")
    return torch.cat([x, x2], dim=-1)


def int4_gemv_acc(
    x, x2, qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, acc, clear=None, x2_early: bool = False, feeds_attention: bool = False,
):  # fmt: skip
    """acc += [x | x2] @ W in fixed point (to_fixed; x2 may be None): the product of int4_gemv_cat without its
    rounding, bias and epilogue, which the op reading acc as its prologue's delta applies (from_fixed, then delta2
    = the bias rows). The CUDA kernel's blocks add their K slices' sums into acc, so the slices need not meet.
    `clear` (int64, may be None) is zeroed: an accumulator whose reader has run, for its next use.
    `feeds_attention` (scheduling only, like `x2_early`): the op runs right before decode_attention_qkv_acc, so the
    CUDA kernel lets the next kernel launch only after its own wait (kernels/common/common.cuh)."""
    if any(b is not None for b in bias):
        raise ValueError("int4_gemv_acc adds no bias (the reader of acc adds it, as its prologue's delta2)")
    h = x if x2 is None else _cat(x, x2, qweight)
    n = sum(q.shape[1] for q in qweight)
    if acc.dtype != torch.int64 or tuple(acc.shape) != (h.shape[0], n):
        raise ValueError(f"acc must be int64 [{h.shape[0]}, {n}], got {acc.dtype} {list(acc.shape)}")
    if clear is not None:
        if clear.dtype != torch.int64 or clear is acc:
            raise ValueError("clear must be an int64 tensor other than acc")
        clear.zero_()
    outs = [h.float() @ int4_weight(*w, group_size, act_order, zero_offset).to(h.dtype).float()
            for w in zip(qweight, qzeros, scales, g_idx)]  # fmt: skip
    acc += to_fixed(torch.cat(outs, dim=-1))


def int4_norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool):
    """The int4 ops' add + norm prologue as an op of its own: (h, sum, h2) as int4_gemv's prologue computes them
    (delta may be an int4_gemv_acc accumulator). The decode step runs it in front of the int4 op that reads the norm,
    and the op then reads h (and GPT-NeoX's h2) with no prologue of its own."""
    if norm_weight is None:
        raise ValueError("int4_norm_prologue needs norm_weight")
    return _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)


def int4_norm_gemv_acc(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int, splits: int,
    workspace, acc, clear=None,
):  # fmt: skip
    """int4_gemv_acc behind int4_gemv's add + norm prologue: acc += norm(sum) @ W in fixed point, `clear` zeroed.
    Returns (sum, h2) as int4_gemv does. The decode step's QKV projection, whose sums decode_attention_qkv_acc
    finishes (rounding, bias, RoPE, the cache writes)."""
    h, s, h2 = _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    int4_gemv_acc(h, None, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset, splits,
                  workspace, acc, clear)  # fmt: skip
    return s, h2


def int4_qkv_rope_cache(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    qweight, qzeros, scales, g_idx, bias, group_size: int, act_order: bool, zero_offset: int,
    cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int, interleaved: bool,
    splits: int, workspace,
):  # fmt: skip
    """The decode-step attention prologue of an int4 model in one op: [add +] norm -> int4 QKV -> rope_qkv_cache.
    Returns (q, sum, h2) as int4_gemv does, with q [B, Hq, D] and K/V written into the caches at `slot`."""
    h, s, h2 = _prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    qkv = int4_linear(h, qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return q, s, h2


# The schemas: a linear as parallel lists of its segments' tensors (q, k, v or gate, up side by side).
_INT4 = (
    "Tensor[] qweight, Tensor[] qzeros, Tensor[] scales, Tensor[] g_idx, Tensor?[] bias, int group_size,"
    " bool act_order, int zero_offset"
)


def _int4_gemv_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, activation, splits, ws):
    n = qw[0].shape[1] if activation == "silu_mul" else sum(q.shape[1] for q in qw)
    return (x.new_empty((*x.shape[:-1], n)), *prologue_fakes(x, delta, w2))


def _int4_qkv_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, *rope):
    hq, d = rope[6], rope[8]  # (cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, ...)
    return (x.new_empty((x.shape[0], hq, d)), *prologue_fakes(x, delta, w2))


def _int4_qkv_mlp_fake(x, delta, d2, w, b, w2, b2, eps, rms, qw, qz, sc, gi, bias, gs, ao, zo, *rest):
    hq, d, qkv_segments = rest[6], rest[8], rest[10]  # (cos, sin, slot, pad, k_cache, v_cache, hq, hkv, d, inter, n)
    hidden = sum(q.shape[1] for q in qw[qkv_segments:])
    sum_ = like(x) if delta is not None else x.new_empty(0)
    return x.new_empty((x.shape[0], hq, d)), x.new_empty((x.shape[0], hidden)), sum_


define(
    f"int4_linear(Tensor x, {_INT4}) -> Tensor",
    int4_linear,
    lambda x, qw, qz, sc, gi, b, gs, ao, zo: x.new_empty((*x.shape[:-1], sum(q.shape[1] for q in qw))),
)
define(
    f"int4_gemv({PROLOGUE}, {_INT4}, str activation, int splits, Tensor(a!) workspace) -> (Tensor, Tensor, Tensor)",
    int4_gemv,
    _int4_gemv_fake,
)
define(
    f"int4_gemv_cat(Tensor x, Tensor x2, {_INT4}, int splits, Tensor(a!) workspace, bool x2_early=False) -> Tensor",
    int4_gemv_cat,
    lambda x, x2, qw, qz, sc, gi, b, gs, ao, zo, splits, ws, early=False: x.new_empty(
        (x.shape[0], sum(q.shape[1] for q in qw))
    ),
)
define(
    f"int4_gemv_acc(Tensor x, Tensor? x2, {_INT4}, int splits, Tensor(a!) workspace, Tensor(b!) acc,"
    " Tensor(c!)? clear=None, bool x2_early=False, bool feeds_attention=False) -> ()",
    int4_gemv_acc,
    lambda *args, **kwargs: None,
)
define(
    f"int4_norm_gemv_acc({PROLOGUE}, {_INT4}, int splits, Tensor(a!) workspace, Tensor(b!) acc,"
    " Tensor(c!)? clear=None) -> (Tensor, Tensor)",
    int4_norm_gemv_acc,
    lambda x, delta, d2, w, b, w2, b2, *rest, **kwargs: prologue_fakes(x, delta, w2),
)
define(
    f"int4_norm_prologue({PROLOGUE}) -> (Tensor, Tensor, Tensor)",
    int4_norm_prologue,
    lambda x, delta, d2, w, b, w2, b2, eps, rms: (like(x), *prologue_fakes(x, delta, w2)),
)
define(
    f"int4_qkv_rope_cache({PROLOGUE}, {_INT4}, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(b!) k_cache, Tensor(c!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved,"
    " int splits, Tensor(a!) workspace) -> (Tensor, Tensor, Tensor)",
    int4_qkv_rope_cache,
    _int4_qkv_fake,
)
define(
    f"int4_qkv_mlp_in({PROLOGUE}, {_INT4}, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(b!) k_cache, Tensor(c!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved,"
    " int qkv_segments, str activation, int splits, Tensor(a!) workspace, Tensor? x2=None)"
    " -> (Tensor, Tensor, Tensor)",
    int4_qkv_mlp_in,
    _int4_qkv_mlp_fake,
)
