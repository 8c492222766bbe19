"""The registration machinery of the `patcher::` torch ops.

Each op family (norm.py, rope.py, activation.py, gemv.py, attention.py, sampling.py, int4_ops.py, gguf.py) calls
`define` once per op with its schema line, its pure-torch reference and its fake kernel, side by side. The reference
serves as the CPU kernel; the CUDA kernels are registered for the same names by the compiled library
(`kernels/bindings.cpp`, `TORCH_LIBRARY_IMPL(patcher, CUDA, m)`), which is loaded on first use on a CUDA machine.
The fake kernels give shapes to torch.compile and FakeTensor tracing; every op returns fresh contiguous tensors that
alias none of its inputs. The ops that also write into an argument (the decode path's KV caches, workspaces and
loop state) mark it `Tensor(a!)` in their schema; all are safe to capture in CUDA graphs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

_lib = torch.library.Library("patcher", "DEF")

# Every defined op's name -> its pure-torch reference, in definition order (ops/__init__.py builds the backends).
REFERENCES: dict[str, Callable] = {}


def _fresh(t: torch.Tensor, inputs: tuple) -> torch.Tensor:
    """A contiguous output that shares no memory with any input (a custom op's output must not alias)."""
    storage = t.untyped_storage().data_ptr()
    shares = any(isinstance(i, torch.Tensor) and i.untyped_storage().data_ptr() == storage for i in inputs)
    if t.is_contiguous() and not shares:
        return t
    return t.clone(memory_format=torch.contiguous_format)


@functools.cache  # once per process
def _register_inductor_fallbacks() -> None:
    """Registers Inductor's fallback (the op called as it is) for every patcher:: op, once, when torch.compile
    first traces one of them (from the fake kernels, which tracing runs before Inductor lowers the graph).

    Inductor creates the same fallback by itself the first time it meets an op without a lowering ("implicit
    fallback"), with the same layout constraint, but torch up to 2.11 first formats the whole IR behind the op's
    inputs into a log message, even with logging off. That text grows exponentially with the depth of the graph, so
    a 32-layer decode step would compile for minutes.
    """
    try:  # Inductor internals; where they differ, Inductor's implicit fallback still works
        from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
        from torch._library.utils import get_layout_constraint_tag
    except ImportError:
        return
    for name in REFERENCES:
        op = getattr(torch.ops.patcher, name).default
        if op not in lowerings:
            constraint = tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
            make_fallback(op, layout_constraint=constraint, warn=False)


def define(schema: str, reference: Callable, fake: Callable) -> None:
    """Defines `patcher::<name>` from its schema line, with `reference` as its CPU kernel and `fake` for tracing."""
    name = schema.split("(", 1)[0]
    if name in REFERENCES:
        raise ValueError(f"patcher::{name} is defined twice")
    _lib.define(schema)
    REFERENCES[name] = reference

    def cpu_kernel(*args):
        out = reference(*args)
        if out is None:  # an op that only writes into its (a!) arguments
            return None
        if isinstance(out, tuple):
            return tuple(_fresh(o, args) for o in out)
        return _fresh(out, args)

    def fake_kernel(*args, **kwargs):
        _register_inductor_fallbacks()
        return fake(*args, **kwargs)

    _lib.impl(name, cpu_kernel, "CPU")
    torch.library.register_fake(f"patcher::{name}", fake_kernel, lib=_lib)


def like(x: torch.Tensor) -> torch.Tensor:
    """An empty tensor of x's shape, dtype and device (the fake kernels' usual output)."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)
