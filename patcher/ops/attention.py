"""Decode attention over the filled part of a static KV cache (kernels/attention/): flash-decoding, with the keys of
a (row, kv head) split over `splits` blocks; and the forms that take q and the current token's K/V from the int4 QKV
projection's fixed-point accumulator (int4_ops.int4_norm_gemv_acc) or from a QKV projection's output (rope_qkv_cache
in the attention's kernel)."""

from __future__ import annotations

import torch

from .int4_ops import from_fixed
from .library import define
from .rope import rope_qkv_cache


def decode_attention(q, k_cache, v_cache, slot, pad, scale: float, splits: int, workspace) -> torch.Tensor:
    """Softmax attention of q [B, Hq, D] over keys pad[b] .. slot of the static cache; returns [B, Hq * D].

    fp32 scores, softmax and weighted sum (as SDPA computes them), rounded to the dtype once.
    `splits` and `workspace` only shape the CUDA kernel's work; the result does not depend on them.
    """
    B, Hq, D = q.shape
    Hkv = k_cache.shape[1]
    length = int(slot.max().item()) + 1
    acc = torch.promote_types(q.dtype, torch.float32)  # fp32 math for fp16/bf16, float64 stays float64
    k = k_cache[:, :, :length].to(acc).repeat_interleave(Hq // Hkv, dim=1)
    v = v_cache[:, :, :length].to(acc).repeat_interleave(Hq // Hkv, dim=1)
    scores = torch.einsum("bhd,bhtd->bht", q.to(acc), k) * scale
    masked = torch.arange(length, device=q.device)[None, :] < pad[:, None]
    scores = scores.masked_fill(masked[:, None, :], float("-inf"))
    out = torch.einsum("bht,bhtd->bhd", torch.softmax(scores, dim=-1), v)
    return out.to(q.dtype).reshape(B, Hq * D)


def decode_attention_qkv_acc(
    acc, bias_rows, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, interleaved: bool, scale: float,
    splits: int, workspace,
) -> torch.Tensor:  # fmt: skip
    """decode_attention with q and the current token's K/V from the QKV projection's fixed-point accumulator
    (int4_norm_gemv_acc): qkv = round(round(acc) + bias_rows) in the caches' dtype (as the projection's epilogue
    rounds it; bias_rows may be None), then rope_qkv_cache (K/V into the caches at `slot`) and the attention."""
    qkv = from_fixed(acc, k_cache.dtype)
    if bias_rows is not None:
        qkv = qkv + bias_rows
    _, num_kv_heads, _, head_dim = k_cache.shape
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return decode_attention(q, k_cache, v_cache, slot, pad, scale, splits, workspace)


def decode_attention_qkv(
    qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, interleaved: bool, scale: float, splits: int,
    workspace,
) -> torch.Tensor:  # fmt: skip
    """rope_qkv_cache (K/V of the QKV projection's output qkv [B, (Hq + 2 Hkv) * D] into the caches at `slot`), then
    decode_attention, as one op: on CUDA one kernel, which makes q and the current token's K/V from qkv itself."""
    _, num_kv_heads, _, head_dim = k_cache.shape
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return decode_attention(q, k_cache, v_cache, slot, pad, scale, splits, workspace)


def decode_attention_workspace(
    batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int, splits: int, device
) -> torch.Tensor:
    """The zeroed scratch decode_attention needs: per-(row, query head) counters (the CUDA kernel uses one per group
    of heads it gives a block), then the split partials."""
    counters = (batch * num_q_heads + 63) // 64 * 64
    return torch.zeros(counters + batch * num_q_heads * splits * (head_dim + 2), dtype=torch.int32, device=device)


define(
    "decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slot, Tensor pad, float scale, int splits,"
    " Tensor(a!) workspace) -> Tensor",
    decode_attention,
    lambda q, kc, vc, slot, pad, scale, splits, ws: q.new_empty((q.shape[0], q.shape[1] * q.shape[2])),
)
define(
    "decode_attention_qkv_acc(Tensor acc, Tensor? bias_rows, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(a!) k_cache, Tensor(b!) v_cache, int num_q_heads, bool interleaved, float scale, int splits,"
    " Tensor(c!) workspace) -> Tensor",
    decode_attention_qkv_acc,
    lambda acc, bias, cos, sin, slot, pad, kc, vc, hq, inter, scale, splits, ws: kc.new_empty(
        (kc.shape[0], hq * kc.shape[3])
    ),
)
define(
    "decode_attention_qkv(Tensor qkv, Tensor cos, Tensor sin, Tensor slot, Tensor pad, Tensor(a!) k_cache,"
    " Tensor(b!) v_cache, int num_q_heads, bool interleaved, float scale, int splits, Tensor(c!) workspace) -> Tensor",
    decode_attention_qkv,
    lambda qkv, cos, sin, slot, pad, kc, vc, hq, inter, scale, splits, ws: kc.new_empty(
        (kc.shape[0], hq * kc.shape[3])
    ),
)
