"""The fused ops, behind two interchangeable backends chosen once, at patch time.

Each op family module (norm, rope, activation, gemv, attention, sampling, int4_ops, gguf, parallel) defines its
`patcher::` ops with `library.define`: schema, pure-torch reference and fake kernel together. From what they defined:
- `KERNELS`: the `patcher::` torch ops. CUDA tensors run the CUDA kernels of `kernels/` (built on first use,
  build.py); CPU tensors run the pure-torch reference through the same dispatcher entry, which is how CPU tests
  exercise the schemas, the fake kernels and torch.compile tracing.
- `REFERENCE`: the pure-torch references, called directly, on any device.

Both expose the same functions with the same signatures, so the patched modules never branch on the backend.
"""

from __future__ import annotations

import torch

# Importing a family module defines its ops (library.define); `reference` looks them up by name.
from . import activation, attention, gemv, gguf, int4_ops, norm, parallel, reference, rope, sampling  # noqa: F401
from .attention import decode_attention_workspace
from .build import ExtensionError
from .library import REFERENCES
from .sampling import next_token_workspace, sample_survivors_workspace

OP_NAMES = tuple(REFERENCES)  # every patcher:: op, in definition order


class Backend:
    """A named table of op functions (attributes named as in OP_NAMES)."""

    def __init__(self, name: str, functions: dict):
        self.name = name
        for op, fn in functions.items():
            setattr(self, op, fn)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


KERNELS = Backend("kernels", {op: getattr(torch.ops.patcher, op).default for op in OP_NAMES})
REFERENCE = Backend("reference", dict(REFERENCES))

BACKEND_CHOICES = ("auto", "kernels", "reference")


def backend_for(device: torch.device, requested: str = "auto") -> Backend:
    """The backend for modules on `device`. "auto": CUDA kernels on a CUDA device, the reference elsewhere.

    Raises ExtensionError if CUDA kernels are wanted and cannot be built, rather than quietly running slower code.
    """
    if requested not in BACKEND_CHOICES:
        raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {requested!r}")
    if requested == "reference" or (requested == "auto" and device.type != "cuda"):
        return REFERENCE
    if device.type == "cuda":
        from . import build

        build.load(device)
    elif device.type != "cpu":
        raise ExtensionError(f"the patcher:: kernels support CUDA and CPU tensors, not {device.type}")
    return KERNELS


__all__ = [
    "KERNELS",
    "OP_NAMES",
    "REFERENCE",
    "Backend",
    "ExtensionError",
    "backend_for",
    "decode_attention_workspace",
    "next_token_workspace",
    "reference",
    "sample_survivors_workspace",
]
