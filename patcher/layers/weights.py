"""Fusing several projections into one GEMM without growing memory or changing `state_dict`.

The weights are concatenated into one buffer and each original parameter becomes a view of its slice
(`param.data = fused[a:b]`), so memory stays the same, the parameters keep their identity and names, and
`state_dict()` returns the same keys and values. The buffer is registered on the owning module (non-persistent,
so it is not in `state_dict`), which makes `model.to()` and `model.half()` move it along with the parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def fuse(owner: nn.Module, name: str, params: list[torch.Tensor]) -> torch.Tensor:
    """Concatenates `params` along dim 0 into `owner.<name>` and makes each parameter a view of its slice."""
    fused = torch.cat([p.detach() for p in params], dim=0)
    start = 0
    for p in params:
        stop = start + p.shape[0]
        p.data = fused[start:stop]
        start = stop
    owner.register_buffer(name, fused, persistent=False)
    return fused


def unfuse(owner: nn.Module, name: str, params: list[torch.Tensor]) -> None:
    """Gives each parameter its own storage again (a fresh copy, as before `fuse`) and drops the buffer."""
    for p in params:
        p.data = p.data.clone()
    del owner._buffers[name]
