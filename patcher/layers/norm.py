"""Kernel-backed norms: the functions the patched layers call, and the forward swapped into norm modules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from ..models.spec import ArchSpec
from ..ops import Backend
from .stream import ResidualStream


@dataclass
class NormPlan:
    norm: Callable  # x -> norm(x)
    add_norm: Callable  # (x, delta, delta2) -> (norm(sum), sum)
    # RMSNorm: (x, delta or None) -> (norm(sum) rounded through Q8_1, sum): the input of a GGUF W4A8 prefill
    norm_q8_1: Callable | None = None


def norm_plan(module: nn.Module, spec: ArchSpec, ops: Backend) -> NormPlan:
    weight = module.weight
    eps = float(getattr(module, spec.eps_attr))
    if spec.norm == "rms":
        # RMSNorm architectures have no parallel residual, so there is never a delta2.
        return NormPlan(
            norm=lambda x: ops.rms_norm(x, weight, eps),
            add_norm=lambda x, d, d2=None: ops.add_rms_norm(x, d, weight, eps),
            norm_q8_1=lambda x, d: ops.rms_norm_q8_1(x, d, weight, eps),
        )
    bias = module.bias
    return NormPlan(
        norm=lambda x: ops.layer_norm(x, weight, bias, eps),
        add_norm=lambda x, d, d2=None: ops.add_layer_norm(x, d, d2, weight, bias, eps),
    )


def dual_norm_plan(first: nn.Module, second: nn.Module, spec: ArchSpec, ops: Backend):
    """Both LayerNorms of a GPT-NeoX parallel-residual layer from one pass: they share mean and variance."""
    w1, b1, w2, b2 = first.weight, first.bias, second.weight, second.bias
    eps = float(getattr(first, spec.eps_attr))
    dual_norm = lambda x: ops.dual_layer_norm(x, w1, b1, w2, b2, eps)
    add_dual_norm = lambda x, d, d2: ops.add_dual_layer_norm(x, d, d2, w1, b1, w2, b2, eps)
    return dual_norm, add_dual_norm


def check_norm(module: nn.Module, spec: ArchSpec) -> str | None:
    """Why this norm module can't be patched, or None."""
    if getattr(module, "weight", None) is None:
        return "norm without a weight (elementwise_affine=False) is not supported"
    if module.weight.dim() != 1:
        return f"norm weight must be 1-D, got shape {tuple(module.weight.shape)}"
    if not hasattr(module, spec.eps_attr):
        return f"norm module has no {spec.eps_attr!r} attribute"
    return None


def norm_forward(self, hidden_states):
    """Replaces a norm module's forward. Takes a plain tensor, or the residual stream of the last layer, whose
    pending add it fuses (the final norm)."""
    plan: NormPlan = self._patcher
    if isinstance(hidden_states, ResidualStream):
        residual, delta, delta2 = hidden_states
        if delta is not None:
            return plan.add_norm(residual, delta, delta2)[0]
        hidden_states = residual
    return plan.norm(hidden_states)
