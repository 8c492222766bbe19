"""The patched MLPs.

Gated (LLaMA/Qwen2, SwiGLU):  down( silu_and_mul( x @ [W_gate; W_up]^T ) )   gate and up fused into one GEMM
Plain (GPT-NeoX, GELU):       fc_out( bias_gelu( x @ W_in^T, b_in ) )          the bias is added inside the GELU
                                                                              kernel instead of the GEMM
GGUF projections run each GGUFLinear's own op (gate and up concatenated, weights.GGUFProjection), bias included.
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
    in_weight: torch.Tensor | None  # gated: [gate; up] fused; None when GPTQ int4 (in_int4) or GGUF (in_gguf)
    in_bias: torch.Tensor | None
    out_weight: torch.Tensor | None
    out_bias: torch.Tensor | None
    tanh: bool = False  # GELU variant (plain MLP only)
    in_int4: Int4Linear | None = None  # gated: gate and up side by side
    out_int4: Int4Linear | None = None
    in_gguf: weights.GGUFProjection | None = None  # gated: gate and up, each its own op, concatenated
    out_gguf: weights.GGUFProjection | None = None
    group: object = None  # tensor parallel: the process group summing the output projection's partial products

    @property
    def gguf_input(self) -> weights.GGUFProjection | None:
        """The GGUF projection that takes the MLP's input (LayerPlan.rounds)."""
        return self.in_gguf


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
    inputs, out = [getattr(module, name) for name in spec.mlp_in], getattr(module, spec.mlp_out)
    tanh = False if spec.mlp_gated else GELU_ACTIVATIONS[getattr(config, spec.act_config)]
    # (tensor parallel: this rank's shards; the output projection's partial products are summed over `group`)
    plan = MlpPlan(ops, None, None, None, None, tanh, group=reduce_group(out))
    if weights.is_int4(inputs[0]):
        plan.in_int4 = int4.from_modules(inputs)
    elif weights.is_gguf(inputs[0]):
        plan.in_gguf = weights.GGUFProjection(inputs)
    elif spec.mlp_gated:
        plan.in_weight = weights.fuse(module, FUSED_GATE_UP, [p.weight for p in inputs])
        if inputs[0].bias is not None:
            plan.in_bias = weights.fuse(module, FUSED_GATE_UP_BIAS, [p.bias for p in inputs])
    else:
        plan.in_weight, plan.in_bias = shard(inputs[0].weight), shard(inputs[0].bias)
    if weights.is_int4(out):
        plan.out_int4 = int4.from_modules([out])
    elif weights.is_gguf(out):
        plan.out_gguf = weights.GGUFProjection([out])
    else:
        plan.out_weight, plan.out_bias = shard(out.weight), shard(out.bias)
    return plan


def undo_mlp_plan(module: nn.Module) -> None:
    weights.unfuse(module, FUSED_GATE_UP)
    weights.unfuse(module, FUSED_GATE_UP_BIAS)


def gated_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    y = weights.project(plan.ops, x, plan.in_weight, plan.in_bias, plan.in_int4, gguf=plan.in_gguf)
    if plan.out_gguf is not None and (out := plan.out_gguf.silu_mul_gemm(y)) is not None:
        return out  # a GGUF W4A8 down projection's prefill: the activation rounded through Q8_1 as it is made
    h = plan.ops.silu_and_mul(y)
    return weights.project(plan.ops, h, plan.out_weight, plan.out_bias, plan.out_int4, plan.group, plan.out_gguf)


def gelu_mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    plan: MlpPlan = self._patcher
    # (int4 and GGUF: the bias is added in the projection, as GPTQLinear and GGUFLinear add it; in_bias is None)
    h = weights.project(plan.ops, x, plan.in_weight, None, plan.in_int4, gguf=plan.in_gguf)
    h = plan.ops.bias_gelu(h, plan.in_bias, plan.tanh)
    return weights.project(plan.ops, h, plan.out_weight, plan.out_bias, plan.out_int4, plan.group, plan.out_gguf)
