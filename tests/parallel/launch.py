"""Launching a tensor-parallel run from a test: `RANKS` processes under torch.distributed.run, on the CPU (gloo) or
one GPU each (NCCL)."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

RANKS = 2


def torchrun(args: list[str], timeout: int, cuda: bool = False) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run ... ARGS` from the repository root, its output captured. Without `cuda`,
    CUDA is hidden: transformers' tensor parallelism puts each rank on the GPU of its local rank whenever CUDA is
    visible, and a one-GPU machine has no GPU for rank 1. One thread a process, and no launcher variables from an
    outer run."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env["OMP_NUM_THREADS"] = "1"
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}", "--standalone", *args]
    return subprocess.run(command, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
