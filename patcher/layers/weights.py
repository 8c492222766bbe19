"""Fusing several projections into one GEMM without growing memory or changing `state_dict`.

The weights are concatenated into one buffer and each original parameter becomes a view of its slice
(`param.data = fused[a:b]`), so memory stays the same, the parameters keep their identity and names, and
`state_dict()` returns the same keys and values. The buffer is registered on the owning module (non-persistent,
so it is not in `state_dict`), which makes `model.to()` and `model.half()` move it along with the parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..parallel import rowwise_linear, shard
from .guard import user_hooks


def fuse(owner: nn.Module, name: str, params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenates `params` along dim 0 into `owner.<name>` and makes each parameter a view of its slice. A
    tensor-parallel (DTensor) parameter contributes this rank's shard, and its shard becomes the view."""
    shards = [shard(p) for p in params]
    fused = torch.cat([p.detach() for p in shards], dim=0)
    start = 0
    for p in shards:
        stop = start + p.shape[0]
        p.data = fused[start:stop]
        start = stop
    owner.register_buffer(name, fused, persistent=False)
    return fused


def unfuse(owner: nn.Module, name: str) -> None:
    """Drops the fused buffer `owner.<name>` and gives every parameter and buffer under `owner` that is still a view
    of it its own storage again (a fresh copy, as before `fuse`), whatever module holds it now (an adapter may wrap
    the projection)."""
    fused = owner._buffers.pop(name, None)
    if fused is None:
        return
    storage = fused.untyped_storage().data_ptr()
    for module in owner.modules():
        for t in (*module._parameters.values(), *module._buffers.values()):
            t = shard(t)
            if t is not None and t.untyped_storage().data_ptr() == storage:
                t.data = t.data.clone()


def projection_reason(modules: list[nn.Module], names) -> str | None:
    """Why these projections (read as one: q/k/v, gate/up, or a single one) can't be patched, or None.
    They must all be nn.Linear, all GPTQLinear in a layout the int4 kernels read, or all GGUFLinear."""
    from ..gptq.linear import GPTQLinear  # (patcher.gptq imports the patching module, which imports this one)
    from ..ops.int4 import int4_reason

    kinds = {type(m) for m in modules}
    if kinds == {nn.Linear} or all(map(is_gguf, modules)):
        return None
    if kinds == {GPTQLinear}:
        return int4_reason(modules)
    found = ", ".join(f"{n} is {_describe(m)}" for n, m in zip(names, modules))
    if any(map(is_gguf, modules)):
        return f"{found}: GGUF linears are read as one projection only with each other (all GGUFLinear or none)"
    return f"{found}: expected nn.Linear, or GPTQLinear or GGUFLinear for all of them"


def _describe(module: nn.Module) -> str:
    return f"GGUFLinear ({module.kind})" if is_gguf(module) else type(module).__name__


def is_int4(module: nn.Module) -> bool:
    return type(module).__name__ == "GPTQLinear"


def is_gguf(module: nn.Module) -> bool:
    return type(module).__name__ == "GGUFLinear"


class Q8_1Rounded(NamedTuple):
    """A GGUF W4A8 projection's prefill input, already rounded through Q8_1 by the norm in front of it
    (rms_norm_q8_1): a patched layer hands it to its attention or MLP, whose projection then does not round it again
    (LayerPlan.rounds)."""

    values: torch.Tensor


class GGUFProjection:
    """GGUF linears read as one projection (q/k/v, gate/up, or a single one), whose output is the modules' side by
    side along the last dimension, as the fused dense weight's output would be: a decode step's rows one GEMV op for
    them all, a prefill one GEMM over their weights dequantized side by side, anything else (a hook of the caller's
    on a module, modes that differ) each module's own forward, concatenated. The blocks are never concatenated: the
    modules of one projection may hold different block types (a Q4_K_M file mixes Q4_K and Q6_K). The modules keep
    their own biases, so the plan holds none."""

    def __init__(self, modules: list[nn.Module]):
        self.modules = tuple(modules)

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(m.kind for m in self.modules)

    def __call__(self, x: torch.Tensor | Q8_1Rounded) -> torch.Tensor:
        rounded = isinstance(x, Q8_1Rounded)
        if rounded:
            x = x.values
            if not self.rounds_input(x):
                raise RuntimeError("patcher: a GGUF projection took a Q8_1-rounded input it would not round itself")
        if len(self.modules) == 1 and not rounded:
            return self.modules[0](x)
        path = self._shared_path(x)
        if path == "gemv":
            # A decode step: one op for every module (on CUDA one input kernel, one GEMV launch a block type).
            from .. import ops

            first = self.modules[0]
            return ops.backend_for(x.device).gguf_gemv_cat(
                x,
                [m.qweight for m in self.modules],
                ",".join(m.kind for m in self.modules),
                [m.bias for m in self.modules],
                first.quantize_activations,
            )
        if path == "gemm":
            # Prefill: the modules share x, so W4A8 rounds it through Q8_1 once, not once a module, and their
            # weights are dequantized side by side into one GEMM, whose output needs no concatenation.
            from .. import ops

            backend = ops.backend_for(x.device)
            if self.modules[0].quantize_activations and not rounded:
                x = backend.round_q8_1(x)
            if len(self.modules) == 1:
                return self.modules[0].gemm(x, backend)
            weight = backend.gguf_dequantize_cat([m.qweight for m in self.modules], ",".join(self.kinds), x.dtype)
            return torch.nn.functional.linear(x, weight, self._bias(x.dtype))
        return torch.cat([m(x) for m in self.modules], -1)

    def _bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The modules' biases side by side in dtype (zeros for a module without one), or None where none has one."""
        if all(m.bias is None for m in self.modules):
            return None
        parts = [
            m.bias.to(dtype)
            if m.bias is not None
            else torch.zeros(m.out_features, dtype=dtype, device=m.qweight.device)
            for m in self.modules
        ]
        return torch.cat(parts)

    def rounds_input(self, x: torch.Tensor) -> bool:
        """Whether this projection's op for x begins by rounding x through Q8_1 (W4A8 prefill, one op for every
        module), which the norm in front of it may do instead (Q8_1Rounded)."""
        return self.modules[0].quantize_activations and self._shared_path(x) == "gemm"

    def silu_mul_gemm(self, y: torch.Tensor) -> torch.Tensor | None:
        """This projection of silu_and_mul(y), y a gated MLP's [gate | up], where it would round its input itself
        (rounds_input: a W4A8 prefill GEMM): the activation and its rounding through Q8_1 as one op (round_q8_1 with
        silu_mul: one pass over the activation less than silu_and_mul, then round_q8_1), handed on as Q8_1Rounded;
        None otherwise."""
        if not self.rounds_input(y[..., : y.shape[-1] // 2]):  # (the activation's shape, for the path check)
            return None
        from .. import ops

        return self(Q8_1Rounded(ops.backend_for(y.device).round_q8_1(y, True)))

    def op_args(self, x: torch.Tensor) -> tuple | None:
        """What the ops that feed the projection's GEMV take after their own input (gguf_norm_gemv_cat,
        gguf_silu_mul_gemv_cat): (blocks, kinds, biases, quantize_activations), where one op serves every module for
        x (a decode step's rows, no hook of the caller's); None otherwise."""
        if self._shared_path(x) != "gemv":
            return None
        m = self.modules
        return [w.qweight for w in m], ",".join(self.kinds), [w.bias for w in m], m[0].quantize_activations

    def _shared_path(self, x: torch.Tensor) -> str | None:
        """The op path ("gemv" or "gemm", GGUFLinear._kernel_path) every module takes for x, in one mode and with no
        hook of the caller's to run, so that one op may serve them all; None otherwise."""
        from ..ops.gguf import MAX_CAT

        first = self.modules[0]
        path = first._kernel_path(x)
        if path == "gemv" and len(self.modules) > MAX_CAT:
            return None
        same = all(
            m._kernel_path(x) == path and m.quantize_activations == first.quantize_activations and not user_hooks(m)
            for m in self.modules
        )
        return path if same else None


def project(ops, x: torch.Tensor, weight, bias, int4, group=None, gguf: GGUFProjection | None = None) -> torch.Tensor:
    """x @ W^T + b for a dense projection, the int4 op for a GPTQ one (int4 is an ops.int4.Int4Linear), or the GGUF
    projection for a GGUF one (gguf: GGUFProjection). With a process group, `weight` is this rank's row-wise shard: the
    ranks' partial products are summed, then b added."""
    if gguf is not None:
        return gguf(x)
    if int4 is not None:
        return ops.int4_linear(x, *int4.args())
    if group is not None:
        return rowwise_linear(x, weight, bias, group)
    return torch.nn.functional.linear(x, weight, bias)


def head_rows(head: nn.Module) -> int:
    """The lm_head's output rows (the vocabulary): an nn.Linear's weight rows (a DTensor's are the global ones), or
    a GGUFLinear's out_features (its blocks hold no weight tensor)."""
    weight = getattr(head, "weight", None)
    return head.out_features if weight is None else weight.shape[0]


def head_device(head: nn.Module) -> torch.device:
    """The device the lm_head computes on: its weight's, or a GGUFLinear's blocks'."""
    weight = getattr(head, "weight", None)
    return head.qweight.device if weight is None else weight.device
