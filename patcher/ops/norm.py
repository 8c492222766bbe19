"""Norm ops: RMSNorm and LayerNorm, optionally with the residual add fused in front (one CUDA kernel template,
kernels/norm/norm.cu, serves all six), and the fused add + norm prologue the decode GEMVs share (PROLOGUE).

The references compute exactly what the HF modules compute, with the same cast points:
- Residual adds happen in the working dtype (`residual + hidden_states` in HF), so a sum is rounded to the dtype
  before it is normalized. GPT-NeoX's parallel residual is `mlp_output + attn_output + hidden_states`, i.e.
  `(mlp + attn) + x`, two roundings in that order.
- LLaMA/Qwen2 RMSNorm normalizes in fp32, casts back to the dtype, then multiplies by the weight in the dtype.
- GPT-NeoX LayerNorm is `nn.LayerNorm` in the working dtype (torch computes it in fp32 internally).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define, like


def residual_sum(x: torch.Tensor, delta: torch.Tensor, delta2: torch.Tensor | None) -> torch.Tensor:
    # HF: `residual + hidden_states` (one sub-layer) or `mlp_output + attn_output + hidden_states` (parallel).
    if delta2 is None:
        return x + delta
    return (delta2 + delta) + x


def rms(s: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = s.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(s.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return rms(x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """Returns (rms_norm(x + delta), x + delta)."""
    s = residual_sum(x, delta, None)
    return rms(s, weight, eps), s


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def dual_layer_norm(x, weight, bias, weight2, bias2, eps: float):
    """Two LayerNorms of the same input (GPT-NeoX parallel residual: input and post-attention norms)."""
    return layer_norm(x, weight, bias, eps), layer_norm(x, weight2, bias2, eps)


def add_layer_norm(x, delta, delta2, weight, bias, eps: float):
    """Returns (layer_norm(s), s) with s the residual sum of x, delta and the optional delta2."""
    s = residual_sum(x, delta, delta2)
    return layer_norm(s, weight, bias, eps), s


def add_dual_layer_norm(x, delta, delta2, weight, bias, weight2, bias2, eps: float):
    """Returns (layer_norm(s), layer_norm2(s), s): the whole GPT-NeoX parallel-residual junction."""
    s = residual_sum(x, delta, delta2)
    return layer_norm(s, weight, bias, eps), layer_norm(s, weight2, bias2, eps), s


define("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor", rms_norm, lambda x, w, eps: like(x))
define(
    "add_rms_norm(Tensor x, Tensor delta, Tensor weight, float eps) -> (Tensor, Tensor)",
    add_rms_norm,
    lambda x, d, w, eps: (like(x), like(x)),
)


def rms_norm_q8_1(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(round_q8_1(rms_norm(s)), s) with s = x + delta, or (round_q8_1(rms_norm(x)), an empty tensor) where delta is
    None: the norm in front of a GGUF W4A8 projection's prefill, its output rounded through Q8_1 as the projection
    would round it (on CUDA by the norm kernel itself, one pass over the output less)."""
    from .gguf import round_q8_1

    if delta is None:
        return round_q8_1(rms_norm(x, weight, eps)), x.new_empty(0)
    h, s = add_rms_norm(x, delta, weight, eps)
    return round_q8_1(h), s


define(
    "rms_norm_q8_1(Tensor x, Tensor? delta, Tensor weight, float eps) -> (Tensor, Tensor)",
    rms_norm_q8_1,
    lambda x, d, w, eps: (like(x), x.new_empty(0) if d is None else like(x)),
)
define(
    "layer_norm(Tensor x, Tensor weight, Tensor? bias, float eps) -> Tensor",
    layer_norm,
    lambda x, w, b, eps: like(x),
)
define(
    "dual_layer_norm(Tensor x, Tensor weight, Tensor? bias, Tensor weight2, Tensor? bias2, float eps)"
    " -> (Tensor, Tensor)",
    dual_layer_norm,
    lambda x, w, b, w2, b2, eps: (like(x), like(x)),
)
define(
    "add_layer_norm(Tensor x, Tensor delta, Tensor? delta2, Tensor weight, Tensor? bias, float eps)"
    " -> (Tensor, Tensor)",
    add_layer_norm,
    lambda x, d, d2, w, b, eps: (like(x), like(x)),
)
define(
    "add_dual_layer_norm(Tensor x, Tensor delta, Tensor? delta2, Tensor weight, Tensor? bias, Tensor weight2,"
    " Tensor? bias2, float eps) -> (Tensor, Tensor, Tensor)",
    add_dual_layer_norm,
    lambda x, d, d2, w, b, w2, b2, eps: (like(x), like(x), like(x)),
)


# The fused residual add + norm in front of the decode GEMVs (dense and int4): the schema's arguments, the
# reference and the fake kernel's extra outputs (sum, h2).
PROLOGUE = (
    "Tensor x, Tensor? delta, Tensor? delta2, Tensor? norm_weight, Tensor? norm_bias, Tensor? norm_weight2,"
    " Tensor? norm_bias2, float eps, bool rms"
)


def norm_prologue(x, delta, delta2, norm_weight, norm_bias, norm_weight2, norm_bias2, eps: float, rms_: bool):
    """(h, sum, h2): the input of the projection and the extra outputs of the fused norm (empty when absent)."""
    empty = x.new_empty(0)
    if norm_weight is None:
        return x, empty, empty
    s = x if delta is None else residual_sum(x, delta, delta2)
    h = rms(s, norm_weight, eps) if rms_ else layer_norm(s, norm_weight, norm_bias, eps)
    h2 = empty if norm_weight2 is None else layer_norm(s, norm_weight2, norm_bias2, eps)
    return h, (empty if delta is None else s), h2


def prologue_fakes(x, delta, norm_weight2):
    """The fake (sum, h2) of the prologue: like x where asked for, else empty."""
    return (like(x) if delta is not None else x.new_empty(0)), (like(x) if norm_weight2 is not None else x.new_empty(0))
