"""The plan of every module patch_model patches, built from the module's current weights: at patch time, and again
whenever a module's Guard (guard.py) sees that its weights changed.

A plan is what a fused forward reads: the fused buffers, the parameters, the backend of the device they are on.
`Planner` holds what planning needs besides the module (the architecture's spec, the config, the requested
backend) and keeps the report's placement fields (devices, dtype, backend) and its notes current.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import ops as ops_module
from ..models.spec import ArchSpec
from ..parallel import sharding_reason
from ..report import PatchReport
from .attention import attention_plan, check_attention
from .decoder import LayerPlan
from .guard import Unplannable
from .mlp import check_mlp, mlp_plan
from .norm import check_norm, dual_norm_plan, norm_plan
from .out_pair import fuse_out_pair, out_pair_reason

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def wants_kernels(device: torch.device, backend: str) -> bool:
    return backend == "kernels" or (backend == "auto" and device.type == "cuda")


def check_placement(module: nn.Module, backend: str) -> str | None:
    """Device and dtype problems shared by layers and norms; None when the module can be patched."""
    params = list(module.parameters())
    if not params:
        return "module has no parameters"
    for sub in module.modules():
        hook = getattr(sub, "_hf_hook", None)
        if hook is not None and getattr(hook, "offload", False):
            return "weights are offloaded by accelerate (loaded at each forward); offloaded modules are not supported"
    if any(p.device.type == "meta" for p in params):
        return "weights are on the meta device (offloaded or not materialized)"
    devices = {p.device for p in params}
    if len(devices) > 1:
        return f"parameters are spread over several devices ({', '.join(sorted(map(str, devices)))})"
    dtypes = {p.dtype for p in params}
    if len(dtypes) > 1:
        return f"mixed parameter dtypes ({', '.join(sorted(map(str, dtypes)))})"
    device, dtype = params[0].device, params[0].dtype
    if not dtype.is_floating_point:
        return f"dtype {dtype} is not a floating-point type"
    if wants_kernels(device, backend) and dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not supported by the CUDA kernels (float16, bfloat16, float32)"
    if device.type not in ("cuda", "cpu") and backend != "reference":
        return f"device {device.type} is not supported (CUDA kernels, or the reference backend on any device)"
    return None


def check_layer_norms(layer: nn.Module, spec: ArchSpec, config) -> str | None:
    """Why the layer's norms can't take the fused adds, or None."""
    first, second = getattr(layer, spec.input_norm, None), getattr(layer, spec.post_norm, None)
    if first is None or second is None:
        return f"layer has no {spec.input_norm!r} or {spec.post_norm!r} submodule"
    reason = check_norm(first, spec) or check_norm(second, spec)
    if reason:
        return reason
    if spec.flag(config, spec.parallel_residual):
        if spec.norm != "layer":
            return "a parallel residual is only supported with LayerNorm"
        if getattr(first, spec.eps_attr) != getattr(second, spec.eps_attr):
            return "the two LayerNorms of a parallel-residual layer have different eps"
    return None


def check_layer(layer: nn.Module, spec: ArchSpec, config, backend: str, styles: dict | None = None) -> str | None:
    """Why patch_model leaves this decoder layer as it is, or None. `styles`: parallel.tp_styles of the model."""
    if type(layer).__name__ != spec.layer_class:
        return f"unexpected layer class {type(layer).__name__} (expected {spec.layer_class})"
    reason = check_placement(layer, backend)
    if reason:
        return reason
    if layer.training and any(getattr(config, name, 0) for name in spec.dropout_configs):
        return "training mode with dropout > 0 (the fused forward has no dropout); call model.eval()"
    for name in (spec.attention, spec.mlp):
        if getattr(layer, name, None) is None:
            return f"layer has no {name!r} submodule"
    return (
        check_layer_norms(layer, spec, config)
        or check_attention(getattr(layer, spec.attention), spec, config)
        or check_mlp(getattr(layer, spec.mlp), spec, config)
        or sharding_reason("layer", layer, spec, config, styles or {})
    )


@dataclass
class Planner:
    spec: ArchSpec
    config: object
    backend: str  # what patch_model was asked for: "auto", "kernels" or "reference"
    report: PatchReport
    styles: dict = field(default_factory=dict)  # parallel.tp_styles of the model: id(module) -> its TP style
    placements: dict = field(default_factory=dict)  # module name -> (device, dtype, backend name) of its plan
    unplanned: dict = field(default_factory=dict)  # module name -> why HF's forward serves it now

    @property
    def tensor_parallel(self) -> bool:
        """Whether transformers sharded any module of the model (its plans then read local shards)."""
        return bool(self.styles)

    @property
    def dropout(self) -> bool:
        return any(getattr(self.config, name, 0) for name in self.spec.dropout_configs)

    def note(self, text: str) -> None:
        if text not in self.report.messages:
            self.report.messages.append(text)

    def ops(self, module: nn.Module):
        device = _first_tensor(module).device
        try:
            return ops_module.backend_for(device, self.backend)
        except ops_module.ExtensionError as e:
            raise RuntimeError(
                f"patcher: the weights of a patched module are now on {device}, where the CUDA kernels can't be "
                f"used ({e}); call patcher.unpatch_model(model) to run transformers' own forwards"
            ) from e

    # ---- the plans, per kind (raise Unplannable where the current weights can't be planned) --------------------
    def plan(self, kind: str, module: nn.Module, next_module: nn.Module | None):
        spec, config = self.spec, self.config
        check = {
            "attention": lambda: check_attention(module, spec, config),
            "mlp": lambda: check_mlp(module, spec, config),
            "norm": lambda: check_norm(module, spec),
            "layer": lambda: check_layer_norms(module, spec, config),
        }[kind]
        reason = check_placement(module, self.backend) if _has_parameters(module) else _buffers_reason(module)
        reason = reason or check() or sharding_reason(kind, module, spec, config, self.styles)
        if reason:
            raise Unplannable(reason)
        ops = self.ops(module)
        if kind == "attention":
            return attention_plan(module, spec, config, ops)
        if kind == "mlp":
            return mlp_plan(module, spec, config, ops)
        if kind == "norm":
            return norm_plan(module, spec, ops)
        return self.layer_plan(module, next_module, ops)

    def layer_plan(self, layer: nn.Module, next_module: nn.Module | None, ops) -> LayerPlan:
        spec = self.spec
        attn, mlp = getattr(layer, spec.attention), getattr(layer, spec.mlp)
        in_norm, post_norm = getattr(layer, spec.input_norm), getattr(layer, spec.post_norm)
        next_patched = next_module is not None and getattr(next_module, "_patcher_guard", None) is not None
        plan = LayerPlan(attention=attn, mlp=mlp, next_patched=next_patched, next_module=next_module)
        if spec.flag(self.config, spec.parallel_residual):
            plan.dual_norm, plan.add_dual_norm = dual_norm_plan(in_norm, post_norm, spec, ops)
            dense, out = (getattr(getattr(m, "_patcher", None), "out_int4", None) for m in (attn, mlp))
            if (dense is not None or out is not None) and out_pair_reason(dense, out) is None:
                modules = getattr(attn, spec.out_proj), getattr(mlp, spec.mlp_out)
                plan.out_pair = fuse_out_pair(layer, *modules, dense.group_size, dense.zero_offset)
        else:
            first, second = norm_plan(in_norm, spec, ops), norm_plan(post_norm, spec, ops)
            plan.norm, plan.add_norm, plan.norm_q8_1 = first.norm, first.add_norm, first.norm_q8_1
            plan.post_add_norm, plan.post_norm_q8_1 = second.add_norm, second.norm_q8_1
        return plan

    def owners(self, kind: str, module: nn.Module) -> list[nn.Module]:
        """The modules whose sub-modules, parameters and buffers the plan of `module` reads (its Watch)."""
        if kind == "layer":  # the norms (their weights are in the layer's plan), not the attention and MLP
            return [module, *self.skipped(kind, module)]
        return [module, *module.children()]

    def skipped(self, kind: str, module: nn.Module) -> list[nn.Module]:
        """The children the fused forward does not call: a hook on one sends the module to HF's forward."""
        if kind == "layer":
            called = (getattr(module, self.spec.attention, None), getattr(module, self.spec.mlp, None))
            return [c for c in module.children() if all(c is not m for m in called)]
        return list(module.children())

    # ---- the report's placement fields ---------------------------------------------------------------------
    def placed(self, name: str, module: nn.Module, reason: str | None) -> None:
        """Records where the plan of `module` runs now (or that HF's forward serves it) in the report."""
        self.placements.pop(name, None)
        self.unplanned.pop(name, None)
        if reason is not None:
            self.unplanned[name] = reason
        else:
            t = _first_tensor(module)  # (a GPTQ projection's module has buffers only: no dtype of its own)
            dtype = t.dtype if _has_parameters(module) else None
            self.placements[name] = (t.device, dtype, self.ops(module).name)
        report = self.report
        devices = sorted({d for d, _, _ in self.placements.values()}, key=str)
        report.devices = [str(d) for d in devices]
        dtypes = {str(t).replace("torch.", "") for _, t, _ in self.placements.values() if t is not None}
        report.dtype = ", ".join(sorted(dtypes)) or "-"
        report.backend = "+".join(sorted({b for _, _, b in self.placements.values()})) or "none"


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _first_tensor(module: nn.Module) -> torch.Tensor:
    return next(module.parameters(), None) if _has_parameters(module) else next(module.buffers())


def _buffers_reason(module: nn.Module) -> str | None:
    """Placement problems of a module without parameters (GPTQ projections hold buffers only)."""
    devices = {b.device for b in module.buffers()}
    if not devices:
        return "module has no parameters or buffers"
    if len(devices) > 1:
        return f"buffers are spread over several devices ({', '.join(sorted(map(str, devices)))})"
    if next(iter(devices)).type == "meta":
        return "weights are on the meta device (offloaded or not materialized)"
    return None
