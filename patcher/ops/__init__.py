"""The fused ops, behind two interchangeable backends chosen once, at patch time.

- `KERNELS`: the `patcher::` torch ops. CUDA tensors run the CUDA kernels of `kernels/` (built on first use);
  CPU tensors run the pure-torch reference through the same dispatcher entry, which is how CPU tests exercise the
  schemas, the fake kernels and torch.compile tracing.
- `REFERENCE`: the pure-torch references of `reference.py`, called directly, on any device.

Both expose the same functions with the same signatures, so the patched modules never branch on the backend.
"""

from __future__ import annotations

import torch

from . import library as _library  # noqa: F401  (defines the patcher:: schemas)
from . import reference
from .extension import ExtensionError

OP_NAMES = (
    "rms_norm",
    "add_rms_norm",
    "layer_norm",
    "dual_layer_norm",
    "add_layer_norm",
    "add_dual_layer_norm",
    "rope_qkv",
    "silu_and_mul",
    "bias_gelu",
    "gemv",
    "norm_gemv",
    "rope_qkv_cache",
    "norm_gemv_rope_cache",
    "decode_attention",
    "decode_attention_qkv_acc",
    "next_token",
    "int4_linear",
    "int4_gemv",
    "int4_gemv_cat",
    "int4_gemv_acc",
    "int4_norm_gemv_acc",
    "int4_norm_prologue",
    "int4_qkv_rope_cache",
    "int4_qkv_mlp_in",
)


class Backend:
    """A named table of op functions (attributes named as in OP_NAMES)."""

    def __init__(self, name: str, functions: dict):
        self.name = name
        for op, fn in functions.items():
            setattr(self, op, fn)

    def __repr__(self) -> str:
        return f"Backend({self.name!r})"


KERNELS = Backend("kernels", {op: getattr(torch.ops.patcher, op).default for op in OP_NAMES})
REFERENCE = Backend("reference", {op: getattr(reference, op) for op in OP_NAMES})

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
        from . import extension

        extension.load(device)
    elif device.type != "cpu":
        raise ExtensionError(f"the patcher:: kernels support CUDA and CPU tensors, not {device.type}")
    return KERNELS


decode_attention_workspace = reference.decode_attention_workspace
next_token_workspace = reference.next_token_workspace

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
]
