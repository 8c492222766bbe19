"""Dense decode matrix-vector products (kernels/gemv/): F.linear for the 1 to 8 rows of a decode step with the MLP
activation fused, optionally behind the fused residual add + norm (norm.PROLOGUE), and the dense attention prologue
(norm, QKV projection, RoPE, K/V into the cache) in one op."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .activation import activate
from .library import define
from .norm import PROLOGUE, norm_prologue, prologue_fakes
from .rope import rope_qkv_cache


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str) -> torch.Tensor:
    """F.linear for the few rows of a decode step, with the MLP activation fused:
    "none", "gelu", "gelu_tanh", or "silu_mul" (weight = [gate; up], output silu(gate) * up)."""
    return activate(F.linear(x, weight, bias), activation)


def norm_gemv(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    weight, bias, activation: str,
):  # fmt: skip
    """gemv behind the decode step's fused residual add + norm (norm_weight None: none, then h = x).

    Returns (out, sum, h2): out = gemv(h); h = norm(sum) with sum = x + delta (+ delta2), or norm(x) without delta;
    h2 the second LayerNorm of sum (GPT-NeoX's MLP input). sum/h2 are empty when not asked for.
    """
    h, s, h2 = norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    return gemv(h, weight, bias, activation), s, h2


def norm_gemv_rope_cache(
    x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms: bool,
    weight, bias, cos, sin, slot, pad, k_cache, v_cache, num_q_heads: int, num_kv_heads: int, head_dim: int,
    interleaved: bool,
):  # fmt: skip
    """The dense decode-step attention prologue in one op: [add +] norm -> QKV projection F.linear(h, W, b) ->
    rope_qkv_cache. Returns (q, sum, h2) as norm_gemv does, q [B, Hq, D], K/V written into the caches at `slot`."""
    h, s, h2 = norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps, rms)
    qkv = F.linear(h, weight, bias)
    q = rope_qkv_cache(qkv, cos, sin, slot, pad, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, interleaved)
    return q, s, h2


def _gemv_fake(x, weight, bias, activation):
    n = weight.shape[0] // 2 if activation == "silu_mul" else weight.shape[0]
    return x.new_empty((*x.shape[:-1], n))


define("gemv(Tensor x, Tensor weight, Tensor? bias, str activation) -> Tensor", gemv, _gemv_fake)
define(
    f"norm_gemv({PROLOGUE}, Tensor weight, Tensor? bias, str activation) -> (Tensor, Tensor, Tensor)",
    norm_gemv,
    lambda x, d, d2, w, b, w2, b2, eps, rms, weight, bias, act: (
        _gemv_fake(x, weight, bias, act),
        *prologue_fakes(x, d, w2),
    ),
)
define(
    f"norm_gemv_rope_cache({PROLOGUE}, Tensor weight, Tensor? bias, Tensor cos, Tensor sin, Tensor slot, Tensor pad,"
    " Tensor(a!) k_cache, Tensor(b!) v_cache, int num_q_heads, int num_kv_heads, int head_dim, bool interleaved)"
    " -> (Tensor, Tensor, Tensor)",
    norm_gemv_rope_cache,
    lambda x, d, d2, w, b, w2, b2, eps, rms, weight, bias, cos, sin, slot, pad, kc, vc, hq, hkv, hd, inter: (
        x.new_empty((x.shape[0], hq, hd)),
        *prologue_fakes(x, d, w2),
    ),
)
