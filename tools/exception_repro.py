"""Raises the same patcher:: op error several times, then a different one (investigating a crash seen on the H100)."""

import torch

from patcher.ops import extension

extension.load()
x = torch.randn(4, 64, device="cuda", dtype=torch.float16)
w = torch.randn(64, device="cuda", dtype=torch.float16)
for i in range(3):
    try:
        torch.ops.patcher.rms_norm(x, w.float(), 1e-6)
    except RuntimeError as e:
        print("caught dtype error", i, str(e).splitlines()[0][:80], flush=True)
try:
    torch.ops.patcher.rms_norm(x, w[:32], 1e-6)
except RuntimeError as e:
    print("caught shape error", str(e).splitlines()[0][:80], flush=True)
