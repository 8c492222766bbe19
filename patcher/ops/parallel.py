"""Tensor parallelism (kernels/parallel/rank_sum.cu): the sum of every rank's partial output of a row-wise
projection, as `torch.distributed.all_reduce` computes it, in one kernel through inboxes that every rank maps (torch's
symmetric memory; patcher/parallel/rank_sum.py holds them)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from .library import define, like


def rank_sum(
    x: torch.Tensor, inbox: torch.Tensor, epochs: torch.Tensor, inboxes: int, rank: int, world: int, group: str
) -> torch.Tensor:
    """x summed over the ranks of the process group named `group` (each rank passes its own partial x). The kernel
    pushes x into the other ranks' inboxes and reads theirs from `inbox` (symmetric memory; `inboxes`: the device
    array of every rank's inbox; `epochs`: this rank's per-block call counts); the reference is the collective."""
    out = x.clone()
    dist.all_reduce(out, group=dist.distributed_c10d._resolve_process_group(group))
    return out


define(
    "rank_sum(Tensor x, Tensor inbox, Tensor(a!) epochs, int inboxes, int rank, int world, str group) -> Tensor",
    rank_sum,
    lambda x, *args: like(x),
)
