"""Elementwise MLP activations (kernels/activation/activation.cu): SwiGLU with `silu(gate)` rounded first, as HF
computes `act_fn(gate) * up`, and GPT-NeoX's GELU with the bias of dense_h_to_4h added in the dtype first."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .library import define, like


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up, [..., I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, tanh: bool) -> torch.Tensor:
    """gelu(x + bias): the activation of GPT-NeoX's MLP with the bias of dense_h_to_4h folded in."""
    if bias is not None:
        x = x + bias
    return F.gelu(x, approximate="tanh" if tanh else "none")


def activate(y: torch.Tensor, activation: str) -> torch.Tensor:
    """The decode GEMVs' fused activation by name: "none", "gelu", "gelu_tanh" or "silu_mul" ([gate | up])."""
    if activation == "silu_mul":
        return silu_and_mul(y)
    if activation == "none":
        return y
    return F.gelu(y, approximate="tanh" if activation == "gelu_tanh" else "none")


define(
    "silu_and_mul(Tensor x) -> Tensor",
    silu_and_mul,
    lambda x: x.new_empty((*x.shape[:-1], x.shape[-1] // 2)),
)
define("bias_gelu(Tensor x, Tensor? bias, bool tanh) -> Tensor", bias_gelu, lambda x, b, tanh: like(x))
