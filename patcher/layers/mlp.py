"""The patched MLPs.

Gated (LLaMA/Qwen2, SwiGLU):  down( silu_and_mul( x @ [W_gate; W_up]^T ) )   gate and up fused into one GEMM
Plain (GPT-NeoX, GELU):       fc_out( bias_gelu( x @ W_in^T, b_in ) )          the bias is added inside the GELU
                                                                              kernel instead of the GEMM
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..models.spec import ArchSpec
from ..ops import Backend
from . import weights

FUSED_GATE_UP = "_patcher_gate_up_weight"
FUSED_GATE_UP_BIAS = "_patcher_gate_up_bias"

GATED_ACTIVATIONS = ("silu", "swish")
GELU_ACTIVATIONS = {"gelu": False, "gelu_pytorch_tanh": True}  # name -> tanh approximation


@dataclass
class MlpPlan:
    ops: Backend
    in_weight: torch.Tensor  # gated: [gate; up] fused
    in_bias: torch.Tensor | None
    out_weight: torch.Tensor
    out_bias: torch.Tensor | None
    tanh: bool = False  # GELU variant (plain MLP only)


def check_mlp(module: nn.Module, spec: ArchSpec, config) -> str | None:
    for name in (*spec.mlp_in, spec.mlp_out):
        if type(getattr(module, name, None)) is not nn.Linear:
            return f"{name} is {type(getattr(module, name, None)).__name__}, not nn.Linear"
    act = getattr(config, spec.act_config, None)
    if spec.mlp_gated:
        if act not in GATED_ACTIVATIONS:
            return f"activation {act!r} is not supported in a gated MLP (supported: {GATED_ACTIVATIONS})"
        gate, up = (getattr(module, name) for name in spec.mlp_in)
        if (gate.bias is None) != (up.bias is None):
            return "gate and up projections disagree on having a bias"
    elif act not in GELU_ACTIVATIONS:
        return f"activation {act!r} is not supported (supported: {tuple(GELU_ACTIVATIONS)})"
    return None


def mlp_plan(module: nn.Module, spec: ArchSpec, config, ops: Backend) -> MlpPlan:
    out = getattr(module, spec.mlp_out)
    if spec.mlp_gated:
        gate, up = (getattr(module, name) for name in spec.mlp_in)
        in_weight = weights.fuse(module, FUSED_GATE_UP, [gate.weight, up.weight])
        in_bias = None if gate.bias is None else weights.fuse(module, FUSED_GATE_UP_BIAS, [gate.bias, up.bias])
        return MlpPlan(ops, in_weight, in_bias, out.weight, out.bias)
    fc_in = getattr(module, spec.mlp_in[0])
    tanh = GELU_ACTIVATIONS[getattr(config, spec.act_config)]
    return MlpPlan(ops, fc_in.weight, fc_in.bias, out.weight, out.bias, tanh)


def undo_mlp_plan(module: nn.Module, spec: ArchSpec) -> None:
    if spec.mlp_gated:
        gate, up = (getattr(module, name) for name in spec.mlp_in)
        weights.unfuse(module, FUSED_GATE_UP, [gate.weight, up.weight])
        if gate.bias is not None:
            weights.unfuse(module, FUSED_GATE_UP_BIAS, [gate.bias, up.bias])


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    h = plan.ops.silu_and_mul(F.linear(x, plan.in_weight, plan.in_bias))
    return F.linear(h, plan.out_weight, plan.out_bias)


def gelu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    h = plan.ops.bias_gelu(F.linear(x, plan.in_weight), plan.in_bias, plan.tanh)
    return F.linear(h, plan.out_weight, plan.out_bias)
