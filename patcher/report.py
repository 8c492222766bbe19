"""What `patch_model` did: modules replaced, modules left as they were and why, fused weights, launch counts."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import asdict, dataclass, field, replace


@dataclass
class ModuleRecord:
    name: str  # path in the model, e.g. "model.layers.3.self_attn"
    kind: str  # the HF class
    replacement: str  # the forward swapped in ("" when left unpatched)
    detail: str  # what the replacement fuses, or why the module was left as it was


@dataclass
class PatchReport:
    model_class: str
    model_type: str
    # backend, devices and dtype describe the current plans: kept up to date when weights are cast or moved after
    # patching and the patched modules rebuild their plans (layers/plans.py)
    backend: str  # "kernels" (CUDA kernels), "reference" (pure torch), or both names joined by "+"
    devices: list[str]
    dtype: str
    layers_restructured: int
    layers_total: int
    replaced: list[ModuleRecord] = field(default_factory=list)
    unpatched: list[ModuleRecord] = field(default_factory=list)
    fused_weights: int = 0  # fused weight buffers; their parameters are views, so memory did not grow
    fused_bytes: int = 0
    launches_per_layer: dict[str, int] = field(default_factory=dict)  # one decode token, outside attention
    messages: list[str] = field(default_factory=list)  # notes, also added after patching: a hook that skips a
    # fusion, weights that changed, a module that runs HF's forward (an adapter replaced its projections)

    @property
    def fully_patched(self) -> bool:
        return not self.unpatched

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, **kwargs) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    def __str__(self) -> str:
        lines = [
            (
                f"patch_model: {self.model_class} ({self.model_type}), {self.layers_restructured}/{self.layers_total} "
                f"decoder layers restructured, backend {self.backend} on {', '.join(self.devices) or '-'}, {self.dtype}"
            )
        ]
        kernels = "kernels" in self.backend.split("+")
        replaced = self.replaced
        if not kernels:  # what really runs: the graph decode path needs the CUDA kernels
            replaced = [
                replace(r, detail="transformers' generate loop here (the graph decode path needs the CUDA kernels)")
                if r.replacement == "fast_generate" else r
                for r in replaced
            ]  # fmt: skip
        if replaced:
            lines.append(f"  replaced ({len(replaced)} modules):")
            lines += [f"    {row}" for row in _grouped(replaced)]
        if self.fused_weights:
            lines.append(
                f"  fused weights: {self.fused_weights} buffers, {self.fused_bytes / 2**20:.1f} MiB; the original "
                "parameters are views of them (no extra memory, state_dict unchanged)"
            )
        if self.launches_per_layer and not kernels:
            lines.append("  ops: the pure-torch references (no CUDA kernels on this backend)")
        elif self.launches_per_layer:
            total = sum(self.launches_per_layer.values())
            parts = ", ".join(f"{k} {v}" for k, v in self.launches_per_layer.items())
            lines.append(
                f"  kernel launches per layer and decode token, besides KV cache and attention: {total} ({parts})"
            )
        lines.append(f"  left unpatched ({len(self.unpatched)}):" if self.unpatched else "  left unpatched: none")
        lines += [f"    {r.name} ({r.kind}): {r.detail}" for r in self.unpatched]
        lines += [f"  note: {m}" for m in self.messages]
        return "\n".join(lines)


def _grouped(records: list[ModuleRecord]) -> list[str]:
    """One row per pattern: layer indices folded into '*', with a count."""
    counts = Counter()
    for r in records:
        key = (re.sub(r"\.\d+(\.|$)", r".*\1", r.name), r.kind, r.replacement, r.detail)
        counts[key] += 1
    return [
        f"{name:<28} {kind} -> {repl} [{detail}]" + (f" x{n}" if n > 1 else "")
        for (name, kind, repl, detail), n in counts.items()
    ]
