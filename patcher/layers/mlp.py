"""The patched MLPs.

Gated (LLaMA/Qwen2, SwiGLU):  down( silu_and_mul( x @ [W_gate; W_up]^T ) )   gate and up fused into one GEMM
Plain (GPT-NeoX, GELU):       fc_out( bias_gelu( x @ W_in^T, b_in ) )          the bias is added inside the GELU
                                                                              kernel instead of the GEMM
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..models.spec import ArchSpec
from ..ops import Backend, int4
from ..ops.int4 import Int4Linear
from ..parallel import reduce_group, shard
from . import weights

FUSED_GATE_UP = "_patcher_gate_up_weight"
FUSED_GATE_UP_BIAS = "_patcher_gate_up_bias"

GATED_ACTIVATIONS = ("silu", "swish")
GELU_ACTIVATIONS = {"gelu": False, "gelu_pytorch_tanh": True}  # name -> tanh approximation


@dataclass
class MlpPlan:
    ops: Backend
    in_weight: torch.Tensor | None  # gated: [gate; up] fused; None when GPTQ int4 (in_int4)
    in_bias: torch.Tensor | None
    out_weight: torch.Tensor | None
    out_bias: torch.Tensor | None
    tanh: bool = False  # GELU variant (plain MLP only)
    in_int4: Int4Linear | None = None  # gated: gate and up side by side
    out_int4: Int4Linear | None = None
    group: object = None  # tensor parallel: the process group summing the output projection's partial products


def check_mlp(module: nn.Module, spec: ArchSpec, config) -> str | None:
    reason = weights.projection_reason([getattr(module, n, None) for n in spec.mlp_in], spec.mlp_in)
    reason = reason or weights.projection_reason([getattr(module, spec.mlp_out, None)], (spec.mlp_out,))
    if reason:
        return reason
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
    inputs = [getattr(module, name) for name in spec.mlp_in]
    if weights.is_int4(inputs[0]) or weights.is_int4(out):
        tanh = False if spec.mlp_gated else GELU_ACTIVATIONS[getattr(config, spec.act_config)]
        plan = MlpPlan(ops, None, None, out.weight if not weights.is_int4(out) else None, None, tanh)
        if weights.is_int4(inputs[0]):
            plan.in_int4 = int4.from_modules(inputs)
        elif spec.mlp_gated:
            plan.in_weight = weights.fuse(module, FUSED_GATE_UP, [p.weight for p in inputs])
        else:
            plan.in_weight, plan.in_bias = inputs[0].weight, inputs[0].bias
        if weights.is_int4(out):
            plan.out_int4 = int4.from_modules([out])
        else:
            plan.out_bias = out.bias
        return plan
    # (tensor parallel: this rank's shards; the output projection's partial products are summed over `group`)
    out_weight, out_bias, group = shard(out.weight), shard(out.bias), reduce_group(out)
    if spec.mlp_gated:
        gate, up = (getattr(module, name) for name in spec.mlp_in)
        in_weight = weights.fuse(module, FUSED_GATE_UP, [gate.weight, up.weight])
        in_bias = None if gate.bias is None else weights.fuse(module, FUSED_GATE_UP_BIAS, [gate.bias, up.bias])
        return MlpPlan(ops, in_weight, in_bias, out_weight, out_bias, group=group)
    fc_in = getattr(module, spec.mlp_in[0])
    tanh = GELU_ACTIVATIONS[getattr(config, spec.act_config)]
    return MlpPlan(ops, shard(fc_in.weight), shard(fc_in.bias), out_weight, out_bias, tanh, group=group)


def undo_mlp_plan(module: nn.Module) -> None:
    weights.unfuse(module, FUSED_GATE_UP)
    weights.unfuse(module, FUSED_GATE_UP_BIAS)


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    h = plan.ops.silu_and_mul(weights.project(plan.ops, x, plan.in_weight, plan.in_bias, plan.in_int4))
    return weights.project(plan.ops, h, plan.out_weight, plan.out_bias, plan.out_int4, plan.group)


def gelu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    # (int4: the GPTQ bias is added in the int4 op, as GPTQLinear adds it; in_bias is None)
    h = plan.ops.bias_gelu(weights.project(plan.ops, x, plan.in_weight, None, plan.in_int4), plan.in_bias, plan.tanh)
    return weights.project(plan.ops, h, plan.out_weight, plan.out_bias, plan.out_int4, plan.group)
