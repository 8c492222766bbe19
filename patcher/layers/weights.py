"""Fusing several projections into one GEMM without growing memory or changing `state_dict`.

The weights are concatenated into one buffer and each original parameter becomes a view of its slice
(`param.data = fused[a:b]`), so memory stays the same, the parameters keep their identity and names, and
`state_dict()` returns the same keys and values. The buffer is registered on the owning module (non-persistent,
so it is not in `state_dict`), which makes `model.to()` and `model.half()` move it along with the parameters.
"""

from __future__ import annotations

import torch
from torch import nn

from ..parallel import rowwise_linear, shard


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
    They must all be nn.Linear, or all GPTQLinear in a layout the int4 kernels read."""
    from ..gptq.linear import GPTQLinear  # (patcher.gptq imports the patching module, which imports this one)
    from ..ops.int4 import int4_reason

    kinds = {type(m) for m in modules}
    if kinds == {nn.Linear}:
        return None
    if kinds == {GPTQLinear}:
        return int4_reason(modules)
    gguf = [f"{n} {m.kind}" for n, m in zip(names, modules) if type(m).__name__ == "GGUFLinear"]
    if gguf:
        return f"GGUF linears ({', '.join(gguf)}) are not fused: HF's forward runs them (GGUFLinear's reference matmul)"
    found = ", ".join(f"{n} is {type(m).__name__}" for n, m in zip(names, modules))
    return f"{found}: expected nn.Linear, or GPTQLinear for all of them"


def is_int4(module: nn.Module) -> bool:
    return type(module).__name__ == "GPTQLinear"


def project(ops, x: torch.Tensor, weight, bias, int4, group=None) -> torch.Tensor:
    """x @ W^T + b for a dense projection, or the int4 op for a GPTQ one (int4 is an ops.int4.Int4Linear). With a
    process group, `weight` is this rank's row-wise shard: the ranks' partial products are summed, then b added."""
    if int4 is not None:
        return ops.int4_linear(x, *int4.args())
    if group is not None:
        return rowwise_linear(x, weight, bias, group)
    return torch.nn.functional.linear(x, weight, bias)
