"""The decode step's sum over ranks on GPUs: the rank_sum kernel through torch's symmetric memory.

A row-wise projection's partial output at decode is a few kilobytes, so its all-reduce costs latency, not bandwidth:
NCCL's ring (LL protocol) took 6-11 us a call inside the captured step on two H200s (Llama-3.1-8B shape, two calls a
layer). `RankSum` allocates an inbox that every rank of the group maps (`symmetric_memory.empty` and `rendezvous`, a
collective: every rank builds its RankSum at the same point, as every rank builds the same decode states) and runs
`patcher::rank_sum` through it: one kernel that pushes this rank's partial into the others' inboxes, each 4 bytes with
a flag beside them, and sums what arrives in its own (kernels/parallel/params.h). The eager forwards and the CPU
(gloo) keep `dist.all_reduce`.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

MAX_RANKS = 8  # kernels/parallel/params.h: kRankSumMaxWorld
BLOCKS = 16  # kRankSumBlocks: the kernel's grid, one call count each


def rank_sum_reason(group, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the step's row-wise sums over `group` stay on dist.all_reduce, or None where RankSum serves them."""
    if device.type != "cuda":
        return "not on a GPU"
    if dist.get_backend(group) != "nccl":
        return f"the process group's backend is {dist.get_backend(group)}, not nccl"
    world = dist.get_world_size(group)
    if world > MAX_RANKS:
        return f"{world} ranks (rank_sum takes at most {MAX_RANKS})"
    # torchrun's count of the ranks on this machine: a group larger than that spans machines, whose memory no GPU here
    # can map (the rendezvous would fail or wait); NCCL carries the sums between them.
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and world > int(local):
        return f"{world} ranks over several machines ({local} on this one)"
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"dtype {dtype}"
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
    except ImportError:
        return "this torch has no symmetric memory"
    return None


class RankSum:
    """sum over the group's ranks of a partial output of at most `numel` elements of `dtype`, on every rank."""

    def __init__(self, group, numel: int, dtype: torch.dtype, device: torch.device, ops):
        from torch.distributed import _symmetric_memory as symm_mem

        name = group.group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # needed before torch 2.12, deprecated after
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(name)
        world = dist.get_world_size(group)
        capacity = -(-numel * dtype.itemsize // 4)  # 4-byte words of a partial, each sent as 8 bytes with its flag
        self.inbox = symm_mem.empty(2 * world * capacity, dtype=torch.int64, device=device)
        # Zeros (no call's flag) before any rank can push: the rendezvous below waits for every rank, and each
        # arrives with its zeros written.
        self.inbox.zero_()
        torch.cuda.synchronize(device)
        handle = symm_mem.rendezvous(self.inbox, name)
        self._handle = handle  # (keeps the peers' mappings alive as long as the inbox)
        self.epochs = torch.zeros(BLOCKS, dtype=torch.int32, device=device)
        self._args = (handle.buffer_ptrs_dev, handle.rank, handle.world_size, name)
        self._op = ops.rank_sum

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x, self.inbox, self.epochs, *self._args)

    @property
    def nbytes(self) -> int:
        return self.inbox.numel() * self.inbox.element_size() + self.epochs.numel() * self.epochs.element_size()
