"""`patch_model` and `unpatch_model`: swap kernel-backed forwards into the modules of a loaded HF model.

The path from `patch_model` to a kernel:

    patch_model(model)
      -> registry.REGISTRY[model_type]             the architecture's spec and replacement forwards
      -> layers.plans                              a plan per module (weights, kernels), rebuilt if weights change
      -> layers.guard                              per call: the fused forward, or HF's (autograd, hooks, adapters)
      -> layers.decoder / attention / mlp / norm   the fused forwards
      -> ops.KERNELS.<op>                          torch.ops.patcher.<op>
      -> kernels/<op>.cu                           the CUDA kernel

Only instances are changed: a module's `forward` is set on the instance (or, under an accelerate hook, the hook's
`_old_forward`), never on a transformers class. Every module is checked before anything is changed; one that
can't be handled is left exactly as it was and named in the report with the reason.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from . import ops as ops_module
from .layers.attention import undo_attention_plan
from .layers.guard import Guard, guarded, weights_signature
from .layers.mlp import undo_mlp_plan
from .layers.norm import check_norm
from .layers.out_pair import FUSED as OUT_PAIR_FUSED
from .layers.out_pair import out_pair_reason, undo_out_pair
from .layers.plans import Planner, check_layer, check_placement
from .layers.weights import is_gguf, is_int4
from .models.spec import ArchSpec
from .parallel import sharding_reason, tp_detail, tp_styles
from .registry import REGISTRY, Entry
from .report import ModuleRecord, PatchReport


class UnsupportedModelError(ValueError):
    """The model is not one patch_model knows how to restructure; nothing was changed."""


class _Absent:
    """No instance-level attribute was there before patching (one object, kept by copy.deepcopy and pickle)."""

    def __reduce__(self):
        return "_ABSENT"


_ABSENT = _Absent()


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
    planner: Planner | None = None
    modules: list[nn.Module] = field(default_factory=list)  # every patched module (each has a Guard)
    weights: list | None = None  # weights_signature(model) when the decode runner's plans were last checked
    fast_generate: bool = True  # generate() takes the graph-captured decode path where it applies
    original_generate: Callable | None = None  # an instance-level generate that was there before patching
    runner: Any = None  # the DecodeRunner (static KV caches, CUDA graphs), created on first use
    last_generate: dict = field(default_factory=dict)
    warned: set = field(default_factory=set)
    stop_string_criteria: dict = field(default_factory=dict)  # reasons.stop_string_criteria's, oldest first

    def __deepcopy__(self, memo):
        # A copy of the patched model starts without a decode runner (its static caches and CUDA graphs hold this
        # model's memory; the copy's first generate builds its own) and without the generate lock, which a lock
        # can't be copied into (decode/generate.py makes one on first use).
        new = PatchState.__new__(PatchState)
        memo[id(self)] = new
        kept = {k: v for k, v in self.__dict__.items() if k not in ("runner", "generate_lock")}
        new.__dict__.update(copy.deepcopy(kept, memo))
        new.runner = None
        return new

    def warn_once(self, reason: str, message: str, stacklevel: int = 1) -> None:
        """warnings.warn(message) the first time `reason` comes up for this model (`stacklevel` as the caller's)."""
        if reason not in self.warned:
            self.warned.add(reason)
            warnings.warn(message, stacklevel=stacklevel + 1)

    def check_weights(self, model: nn.Module) -> bool:
        """Once per generate call, and when a DecodeRunner is built: True (and the decode runner, its caches and
        graphs dropped) when any parameter or buffer of the model was replaced, moved, cast or updated in place
        since the last check. The patched modules' plans are rebuilt from the current weights first, the layers'
        always (a layer's int4 out pair holds a summed bias), so a new runner reads only current weights."""
        if weights_signature(model) == self.weights:
            return False
        for module in self.modules:
            guard = module._patcher_guard
            if guard.kind == "layer":
                guard.rebuild(module)
            else:
                guard.check(module)
        self.weights = weights_signature(model)  # (after the rebuilds, which register new fused buffers)
        self.runner = None
        return True

    @property
    def forward_swaps(self) -> list[_Swap]:
        """The swaps of the patched modules' forwards (every swap but the model's generate)."""
        return [s for s in self.swaps if s.slot != "generate"]

    @contextlib.contextmanager
    def original_forwards(self):
        """Every patched module's forward as patch_model found it, for the duration (generate's static-cache fallback:
        transformers compiles exactly the unpatched model's code, with its guards, and the compiled graph is reused by
        every such call); the fused forwards are back after it."""
        forwards = self.forward_swaps
        fused = [s.module.__dict__.get(s.slot, _ABSENT) for s in forwards]
        for swap in forwards:
            swap.restore()
        try:
            yield
        finally:
            for swap, fn in zip(forwards, fused):
                if fn is not _ABSENT:
                    swap.module.__dict__[swap.slot] = fn

    def unplanned(self) -> dict[str, str]:
        """Patched modules that HF's forward serves now (their weights can't be planned), with the reason."""
        return dict(self.planner.unplanned) if self.planner is not None else {}


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


def _launches_per_layer(spec: ArchSpec, parallel: bool, layer: nn.Module | None) -> dict[str, int]:
    if parallel:
        counts = {"add+dual-norm": 1}
    else:
        counts = {"add+norm": 2}
    # A GGUF projection runs one op per GGUFLinear, then a cat where it has several.
    projections = ((spec.attention, spec.qkv), (spec.attention, (spec.out_proj,)), (spec.mlp, spec.mlp_in),
                   (spec.mlp, (spec.mlp_out,)))  # fmt: skip
    gguf = [] if layer is None else [n for p, n in projections if is_gguf(getattr(getattr(layer, p), n[0]))]
    if len(gguf) < len(projections):
        counts["gemm"] = len(projections) - len(gguf)
    if gguf:
        counts["gguf_linear"] = sum(map(len, gguf))
    cats = sum(len(names) > 1 for names in gguf)
    if cats:
        counts["cat"] = cats
    counts["rope_qkv"] = 1
    counts["silu_and_mul" if spec.mlp_gated else "bias_gelu"] = 1
    # tensor parallel: one all-reduce per row-wise sharded output projection
    pairs = ((spec.attention, spec.out_proj), (spec.mlp, spec.mlp_out))
    reduces = 0 if layer is None else sum(bool(tp_detail(getattr(layer, parent), out)) for parent, out in pairs)
    if reduces:
        counts["all_reduce"] = reduces
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
    styles = tp_styles(model)
    reasons = [check_layer(layer, spec, config, backend, styles) for layer in layers]
    final_reason = (
        "no final norm"
        if final_norm is None
        else check_norm(final_norm, spec)
        or check_placement(final_norm, backend)
        or sharding_reason("norm", final_norm, spec, config, styles)
    )
    patchable = [m for m, r in zip(layers + [final_norm], reasons + [final_reason]) if r is None]
    first = next((layer for layer, reason in zip(layers, reasons) if reason is None), None)
    devices = sorted({next(m.parameters()).device for m in patchable}, key=str)
    # Building the kernels can fail; it happens here, before any module is touched.
    backends = {device: ops_module.backend_for(device, backend) for device in devices}

    parallel = spec.flag(config, spec.parallel_residual)
    report = PatchReport(
        model_class=type(model).__name__,
        model_type=spec.model_type,
        backend="none",  # backend, devices and dtype: set from the plans (Planner.placed), and kept current
        devices=[],
        dtype="-",
        layers_restructured=sum(r is None for r in reasons),
        layers_total=len(layers),
        launches_per_layer=_launches_per_layer(spec, parallel, first) if patchable else {},
    )
    planner = Planner(spec, config, backend, report, styles)
    state = PatchState(report, spec=spec, planner=planner)
    records = {}

    def swap(module: nn.Module, kind: str, fn: Callable, detail: str, undo=None, next_module=None) -> None:
        name = names.get(id(module), "?")
        slot = _swap_forward(module, guarded(fn))
        original = None if slot.original is _ABSENT else slot.original
        module._patcher_guard = Guard(name, kind, original, planner, next_module)
        state.undo.append(functools.partial(_drop_plan, module, undo))
        state.swaps.append(slot)
        state.modules.append(module)
        records[id(module)] = ModuleRecord(name, type(module).__name__, fn.__name__, detail)
        report.replaced.append(records[id(module)])

    # 2. Apply: every forward swapped and guarded, then the plans built (a layer's after its attention's and MLP's,
    # whose int4 plans its out pair reads, and after the next module's guard, which says it takes a stream).
    for i, (layer, reason) in enumerate(zip(layers, reasons)):
        if reason is not None:
            report.unpatched.append(ModuleRecord(names.get(id(layer), f"layer {i}"), type(layer).__name__, "", reason))
            continue
        ops_name = backends[next(layer.parameters()).device].name
        next_module = layers[i + 1] if i + 1 < len(layers) else final_norm
        attn, mlp = getattr(layer, spec.attention), getattr(layer, spec.mlp)
        qkv_detail = "fused q/k/v GEMM" if len(spec.qkv) > 1 else "QKV GEMM"
        if is_int4(getattr(attn, spec.qkv[0])):
            qkv_detail = "GPTQ int4 q/k/v side by side" if len(spec.qkv) > 1 else "GPTQ int4 QKV"
        elif is_gguf(getattr(attn, spec.qkv[0])):
            qkv_detail = f"GGUF {_kinds(attn, spec.qkv)}"
        undo = functools.partial(undo_attention_plan, attn)
        tp = tp_detail(attn, spec.out_proj)
        swap(attn, "attention", entry.attention, f"{qkv_detail} + rope_qkv ({ops_name}){tp}", undo)
        mlp_detail = "fused gate/up GEMM + silu_and_mul" if spec.mlp_gated else "GEMM + bias_gelu"
        if is_int4(getattr(mlp, spec.mlp_in[0])):
            mlp_detail = "GPTQ int4 " + ("gate/up side by side + silu_and_mul" if spec.mlp_gated else "GEMM + gelu")
        elif is_gguf(getattr(mlp, spec.mlp_in[0])):
            mlp_detail = f"GGUF {_kinds(mlp, spec.mlp_in)} + " + ("silu_and_mul" if spec.mlp_gated else "bias_gelu")
        tp = tp_detail(mlp, spec.mlp_out)
        swap(mlp, "mlp", entry.mlp, f"{mlp_detail} ({ops_name}){tp}", functools.partial(undo_mlp_plan, mlp))
        for norm in (getattr(layer, spec.input_norm), getattr(layer, spec.post_norm)):
            swap(norm, "norm", entry.norm, f"{spec.norm} norm ({ops_name})")
        if parallel:
            fn = entry.parallel_layer
            undo = functools.partial(undo_out_pair, layer)
        else:
            fn, undo = entry.sequential_layer, None
        swap(layer, "layer", fn, ops_name, undo, next_module)
    if final_reason is None:
        ops_name = backends[next(final_norm.parameters()).device].name
        swap(final_norm, "norm", entry.norm, f"takes the last layer's residual add ({ops_name})")
    elif final_norm is not None:
        report.unpatched.append(
            ModuleRecord(names.get(id(final_norm), "final norm"), type(final_norm).__name__, "", final_reason)
        )
    for module in sorted(state.modules, key=lambda m: m._patcher_guard.kind == "layer"):
        module._patcher_guard.rebuild(module)
    for i, layer in enumerate(layers):
        if id(layer) in records:
            next_patched = (reasons + [final_reason])[i + 1] is None
            records[id(layer)].detail = _layer_detail(layer, spec, parallel, next_patched, records[id(layer)].detail)

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
    state.weights = weights_signature(model)
    model._patcher_state = state
    return report


def _kinds(module: nn.Module, names) -> str:
    """The block types of a GGUF projection's modules, as the report names them: "q/k/v (Q4_K, Q4_K, Q6_K), one
    op each, concatenated"."""
    kinds = ", ".join(getattr(module, n).kind for n in names)
    if len(names) == 1:
        return f"{names[0]} ({kinds})"
    return f"{'/'.join(n.removesuffix('_proj') for n in names)} ({kinds}), one op each, concatenated"


def _layer_detail(layer: nn.Module, spec: ArchSpec, parallel: bool, next_patched: bool, ops_name: str) -> str:
    if not parallel:
        detail = f"residual adds fused into the next {spec.norm} norm"
    else:
        detail = "parallel residual: add + both LayerNorms in one kernel"
        dense, out = getattr(layer, spec.attention)._patcher.out_int4, getattr(layer, spec.mlp)._patcher.out_int4
        if layer._patcher.out_pair is not None:
            detail += f"; decode: {spec.out_proj} + {spec.mlp_out} as one int4 GEMV over [attention | MLP]"
        elif dense is not None or out is not None:
            detail += f"; decode: {spec.out_proj} and {spec.mlp_out} apart ({out_pair_reason(dense, out)})"
    if not next_patched:
        detail += "; hands a summed tensor to the unpatched module after it"
    return f"{detail} ({ops_name})"


def _drop_plan(module: nn.Module, undo: Callable | None) -> None:
    if undo is not None:
        undo()
    module.__dict__.pop("_patcher", None)
    module.__dict__.pop("_patcher_guard", None)


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
