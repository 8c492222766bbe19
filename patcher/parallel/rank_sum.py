"""The decode step's sum over ranks on GPUs: the rank_sum kernel over torch's symmetric memory.

A row-wise projection's partial output at decode is a few kilobytes, so its all-reduce costs latency, not
bandwidth: NCCL's ring took 6-11 us a call inside the captured step on two H200s (Llama-3.1-8B shape, two calls a
layer). `RankSum` allocates one buffer that every rank of the group maps (`symmetric_memory.empty` and `rendezvous`,
a collective: every rank builds its RankSum at the same point, as every rank builds the same decode states) and
runs `patcher::rank_sum` over it: one kernel that copies this rank's partial in, meets the other ranks at a flag,
reads and sums every rank's copy over NVLink. The eager forwards and the CPU (gloo) keep `dist.all_reduce`.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

MAX_RANKS = 8  # kernels/parallel/params.h kRankSumMaxWorld


def rank_sum_reason(group, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the step's row-wise sums over `group` stay on dist.all_reduce, or None where RankSum serves them."""
    if device.type != "cuda":
        return "not on a GPU"
    if dist.get_backend(group) != "nccl":
        return f"the process group's backend is {dist.get_backend(group)}, not nccl"
    if dist.get_world_size(group) > MAX_RANKS:
        return f"{dist.get_world_size(group)} ranks (rank_sum takes at most {MAX_RANKS})"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    return None


class RankSum:
    """sum over the group's ranks of a [.., N] partial output of at most `numel` elements, on every rank."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device, ops):
        from torch.distributed import _symmetric_memory as symm_mem

        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.12, deprecated after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        self.buffer = symm_mem.empty(numel, dtype=dtype, device=device)
        handle = symm_mem.rendezvous(self.buffer, name)
        self._handle = handle  # (keeps the peers' mappings alive as long as the buffer)
        self._args = (handle.buffer_ptrs_dev, handle.signal_pad_ptrs_dev, handle.rank, handle.world_size, name)
        self._op = ops.rank_sum

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.buffer, *self._args)

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()
