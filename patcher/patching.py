"""`patch_model` and `unpatch_model`: swap kernel-backed forwards into the modules of a loaded HF model.

The path from `patch_model` to a kernel:

    patch_model(model)
      -> registry.REGISTRY[model_type]             the architecture's spec and replacement forwards
      -> layers.decoder / attention / mlp / norm   a plan per module (weights, kernels), forward swapped in
      -> ops.KERNELS.<op>                          torch.ops.patcher.<op>
      -> kernels/<op>.cu                           the CUDA kernel

Only instances are changed: a module's `forward` is set on the instance (or, under an accelerate hook, the hook's
`_old_forward`), never on a transformers class. Every module is checked before anything is changed; one that
can't be handled is left exactly as it was and named in the report with the reason.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import ops as ops_module
from .layers.attention import attention_plan, check_attention, undo_attention_plan
from .layers.decoder import LayerPlan
from .layers.mlp import check_mlp, mlp_plan, undo_mlp_plan
from .layers.norm import check_norm, dual_norm_plan, norm_plan
from .layers.out_pair import FUSED as OUT_PAIR_FUSED
from .layers.out_pair import fuse_out_pair, out_pair_reason, undo_out_pair
from .layers.weights import is_int4
from .models.spec import ArchSpec
from .registry import REGISTRY, Entry
from .report import ModuleRecord, PatchReport

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class UnsupportedModelError(ValueError):
    """The model is not one patch_model knows how to restructure; nothing was changed."""


_ABSENT = object()


@dataclass
class _Swap:
    module: nn.Module
    slot: str  # "forward", or "_old_forward" when an accelerate hook wraps the module
    original: Any

    def restore(self) -> None:
        if self.original is _ABSENT:
            self.module.__dict__.pop(self.slot, None)
        else:
            self.module.__dict__[self.slot] = self.original


@dataclass
class PatchState:
    report: PatchReport
    swaps: list[_Swap] = field(default_factory=list)
    undo: list[Callable[[], None]] = field(default_factory=list)
    spec: ArchSpec | None = None
    fast_generate: bool = True  # generate() takes the graph-captured decode path where it applies
    original_generate: Callable | None = None  # an instance-level generate that was there before patching
    runner: Any = None  # the DecodeRunner (static KV caches, CUDA graphs), created on first use
    last_generate: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)


def _swap_forward(module: nn.Module, fn: Callable) -> _Swap:
    # accelerate's hooks replace `forward` with a wrapper calling `_old_forward`; swap under the hook, keep it.
    slot = (
        "_old_forward"
        if getattr(module, "_hf_hook", None) is not None and hasattr(module, "_old_forward")
        else "forward"
    )
    swap = _Swap(module, slot, module.__dict__.get(slot, _ABSENT))
    module.__dict__[slot] = types.MethodType(fn, module)
    return swap


def _find(model: nn.Module) -> tuple[Entry, nn.Module]:
    if not isinstance(model, nn.Module):
        raise TypeError(f"patch_model expects a transformers model (torch.nn.Module), got {type(model).__name__}")
    if type(model).__name__ == "OptimizedModule":
        raise UnsupportedModelError("patch the model before torch.compile, not the compiled wrapper")
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    entry = REGISTRY.get(model_type)
    if entry is None:
        raise UnsupportedModelError(
            f"{type(model).__name__} (model_type {model_type!r}) is not supported; supported model types: "
            f"{', '.join(sorted(REGISTRY))}. Nothing was changed."
        )
    spec = entry.spec
    base = getattr(model, spec.base_model, None)
    if base is None and isinstance(getattr(model, spec.layers, None), nn.ModuleList):
        base = model  # the bare base model (LlamaModel, GPTNeoXModel)
    if base is None or not isinstance(getattr(base, spec.layers, None), nn.ModuleList):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no decoder stack at .{spec.base_model}.{spec.layers}; nothing was changed"
        )
    return entry, base


def _wants_kernels(device: torch.device, backend: str) -> bool:
    return backend == "kernels" or (backend == "auto" and device.type == "cuda")


def _check_placement(module: nn.Module, backend: str) -> str | None:
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
    if _wants_kernels(device, backend) and dtype not in KERNEL_DTYPES:
        return f"dtype {dtype} is not supported by the CUDA kernels (float16, bfloat16, float32)"
    if device.type not in ("cuda", "cpu") and backend != "reference":
        return f"device {device.type} is not supported (CUDA kernels, or the reference backend on any device)"
    return None


def _check_layer(layer: nn.Module, spec: ArchSpec, config, backend: str) -> str | None:
    if type(layer).__name__ != spec.layer_class:
        return f"unexpected layer class {type(layer).__name__} (expected {spec.layer_class})"
    reason = _check_placement(layer, backend)
    if reason:
        return reason
    if layer.training and any(getattr(config, name, 0) for name in spec.dropout_configs):
        return "training mode with dropout > 0 (the fused forward has no dropout); call model.eval()"
    for name in (spec.attention, spec.mlp, spec.input_norm, spec.post_norm):
        if getattr(layer, name, None) is None:
            return f"layer has no {name!r} submodule"
    reason = (
        check_attention(getattr(layer, spec.attention), spec, config)
        or check_mlp(getattr(layer, spec.mlp), spec, config)
        or check_norm(getattr(layer, spec.input_norm), spec)
        or check_norm(getattr(layer, spec.post_norm), spec)
    )
    if reason:
        return reason
    if spec.flag(config, spec.parallel_residual):
        if spec.norm != "layer":
            return "a parallel residual is only supported with LayerNorm"
        first, second = getattr(layer, spec.input_norm), getattr(layer, spec.post_norm)
        if getattr(first, spec.eps_attr) != getattr(second, spec.eps_attr):
            return "the two LayerNorms of a parallel-residual layer have different eps"
    return None


def _launches_per_layer(spec: ArchSpec, parallel: bool) -> dict[str, int]:
    if parallel:
        counts = {"add+dual-norm": 1}
    else:
        counts = {"add+norm": 2}
    counts.update({"gemm": 4, "rope_qkv": 1})
    counts["silu_and_mul" if spec.mlp_gated else "bias_gelu"] = 1
    return counts


def patch_model(model: nn.Module, *, backend: str = "auto") -> PatchReport:
    """Restructures every supported decoder layer of `model` to run fused kernels; returns a PatchReport.

    backend: "auto" (CUDA kernels for modules on a GPU, pure-torch reference ops elsewhere), "kernels", or
    "reference". Raises UnsupportedModelError (nothing changed) for a model it does not know, and
    ops.ExtensionError if the CUDA kernels are needed but can't be built.
    """
    state: PatchState | None = getattr(model, "_patcher_state", None)
    if state is not None:
        warnings.warn("patch_model: this model is already patched; nothing was changed", stacklevel=2)
        return state.report
    if backend not in ops_module.BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {ops_module.BACKEND_CHOICES}, got {backend!r}")
    entry, base = _find(model)
    spec, config = entry.spec, model.config
    names = {id(m): n for n, m in model.named_modules()}
    layers = list(getattr(base, spec.layers))
    final_norm = getattr(base, spec.final_norm, None)

    # 1. Decide for every module, changing nothing yet.
    reasons = [_check_layer(layer, spec, config, backend) for layer in layers]
    final_reason = (
        "no final norm" if final_norm is None else check_norm(final_norm, spec) or _check_placement(final_norm, backend)
    )
    patchable = [m for m, r in zip(layers + [final_norm], reasons + [final_reason]) if r is None]
    devices = sorted({next(m.parameters()).device for m in patchable}, key=str)
    # Building the kernels can fail; it happens here, before any module is touched.
    backends = {device: ops_module.backend_for(device, backend) for device in devices}

    dtypes = {next(m.parameters()).dtype for m in patchable}
    parallel = spec.flag(config, spec.parallel_residual)
    report = PatchReport(
        model_class=type(model).__name__,
        model_type=spec.model_type,
        backend="+".join(sorted({b.name for b in backends.values()})) or "none",
        devices=[str(d) for d in devices],
        dtype=", ".join(sorted(str(d).replace("torch.", "") for d in dtypes)) or "-",
        layers_restructured=sum(r is None for r in reasons),
        layers_total=len(layers),
        launches_per_layer=_launches_per_layer(spec, parallel) if patchable else {},
    )
    state = PatchState(report, spec=spec)

    def swap(module: nn.Module, fn: Callable, plan, detail: str, undo: Callable | None = None) -> None:
        module._patcher = plan
        state.undo.append(functools.partial(_drop_plan, module, undo))
        state.swaps.append(_swap_forward(module, fn))
        report.replaced.append(ModuleRecord(names.get(id(module), "?"), type(module).__name__, fn.__name__, detail))

    # 2. Apply.
    for i, (layer, reason) in enumerate(zip(layers, reasons)):
        if reason is not None:
            report.unpatched.append(ModuleRecord(names.get(id(layer), f"layer {i}"), type(layer).__name__, "", reason))
            continue
        ops = backends[next(layer.parameters()).device]
        next_reason = reasons[i + 1] if i + 1 < len(layers) else final_reason
        attn, mlp = getattr(layer, spec.attention), getattr(layer, spec.mlp)
        in_norm, post_norm = getattr(layer, spec.input_norm), getattr(layer, spec.post_norm)

        qkv_detail = "fused q/k/v GEMM" if len(spec.qkv) > 1 else "QKV GEMM"
        if is_int4(getattr(attn, spec.qkv[0])):
            qkv_detail = "GPTQ int4 q/k/v side by side" if len(spec.qkv) > 1 else "GPTQ int4 QKV"
        swap(
            attn,
            entry.attention,
            attention_plan(attn, spec, config, ops),
            f"{qkv_detail} + rope_qkv ({ops.name})",
            functools.partial(undo_attention_plan, attn, spec),
        )
        mlp_detail = "fused gate/up GEMM + silu_and_mul" if spec.mlp_gated else "GEMM + bias_gelu"
        if is_int4(getattr(mlp, spec.mlp_in[0])):
            mlp_detail = "GPTQ int4 " + ("gate/up side by side + silu_and_mul" if spec.mlp_gated else "GEMM + gelu")
        swap(
            mlp,
            entry.mlp,
            mlp_plan(mlp, spec, config, ops),
            f"{mlp_detail} ({ops.name})",
            functools.partial(undo_mlp_plan, mlp, spec),
        )
        for norm in (in_norm, post_norm):
            swap(norm, entry.norm, norm_plan(norm, spec, ops), f"{spec.norm} norm ({ops.name})")

        plan = LayerPlan(attention=attn, mlp=mlp, next_patched=next_reason is None)
        undo_layer = None
        if parallel:
            plan.dual_norm, plan.add_dual_norm = dual_norm_plan(in_norm, post_norm, spec, ops)
            fn, detail = entry.parallel_layer, "parallel residual: add + both LayerNorms in one kernel"
            dense, out = attn._patcher.out_int4, mlp._patcher.out_int4
            if dense is not None or out is not None:  # GPTQ int4: the decode step's two output GEMVs as one
                pair_reason = out_pair_reason(dense, out)
                if pair_reason is None:
                    modules = getattr(attn, spec.out_proj), getattr(mlp, spec.mlp_out)
                    plan.out_pair = fuse_out_pair(layer, *modules, dense.group_size, dense.zero_offset)
                    undo_layer = functools.partial(undo_out_pair, layer, *modules)
                    detail += f"; decode: {spec.out_proj} + {spec.mlp_out} as one int4 GEMV over [attention | MLP]"
                else:
                    detail += f"; decode: {spec.out_proj} and {spec.mlp_out} apart ({pair_reason})"
        else:
            first = norm_plan(in_norm, spec, ops)
            plan.norm, plan.add_norm = first.norm, first.add_norm
            plan.post_add_norm = norm_plan(post_norm, spec, ops).add_norm
            fn, detail = entry.sequential_layer, f"residual adds fused into the next {spec.norm} norm"
        if not plan.next_patched:
            detail += "; hands a summed tensor to the unpatched module after it"
        swap(layer, fn, plan, f"{detail} ({ops.name})", undo_layer)

    if final_reason is None:
        ops = backends[next(final_norm.parameters()).device]
        swap(
            final_norm,
            entry.norm,
            norm_plan(final_norm, spec, ops),
            f"takes the last layer's residual add ({ops.name})",
        )
    elif final_norm is not None:
        report.unpatched.append(
            ModuleRecord(names.get(id(final_norm), "final norm"), type(final_norm).__name__, "", final_reason)
        )

    if patchable and callable(getattr(model, "generate", None)):
        from .decode import fast_generate

        state.original_generate = model.__dict__.get("generate")
        swap = _Swap(model, "generate", model.__dict__.get("generate", _ABSENT))
        model.__dict__["generate"] = types.MethodType(fast_generate, model)
        state.swaps.append(swap)
        report.replaced.append(
            ModuleRecord(
                "(model).generate",
                type(model).__name__,
                "fast_generate",
                "static KV cache + one CUDA graph per decode step, where it applies",
            )
        )

    fused_names = (
        "_patcher_qkv_weight",
        "_patcher_qkv_bias",
        "_patcher_gate_up_weight",
        "_patcher_gate_up_bias",
        *OUT_PAIR_FUSED.values(),
    )
    for module in model.modules():
        for name in fused_names:
            buffer = module._buffers.get(name)
            if buffer is not None:
                report.fused_weights += 1
                report.fused_bytes += buffer.numel() * buffer.element_size()
    if not patchable:
        report.messages.append("no module could be patched; the model is unchanged")
    model._patcher_state = state
    return report


def _drop_plan(module: nn.Module, undo: Callable | None) -> None:
    if undo is not None:
        undo()
    module.__dict__.pop("_patcher", None)


def unpatch_model(model: nn.Module) -> bool:
    """Puts back the original forwards and gives fused weights their own storage again.

    Afterwards the model computes bit-identical outputs to before patching. Returns False (with a warning) if the
    model was not patched.
    """
    state: PatchState | None = getattr(model, "_patcher_state", None)
    if state is None:
        warnings.warn("unpatch_model: this model is not patched; nothing was changed", stacklevel=2)
        return False
    for swap in reversed(state.swaps):
        swap.restore()
    for undo in reversed(state.undo):
        undo()
    del model._patcher_state
    return True


def is_patched(model: nn.Module) -> bool:
    return getattr(model, "_patcher_state", None) is not None


def set_fast_generate(model: nn.Module, enabled: bool) -> None:
    """Turns the graph-captured decode path of a patched model's `generate` on or off (on after patch_model)."""
    state: PatchState | None = getattr(model, "_patcher_state", None)
    if state is None:
        raise ValueError("set_fast_generate: the model is not patched (call patch_model first)")
    state.fast_generate = bool(enabled)
