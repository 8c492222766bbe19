"""Random GPTQ int4 linears on the GPU for the int4 kernel tests: a checkpoint's tensors as an Int4Linear."""

from __future__ import annotations

import torch

from patcher.gptq import format as fmt
from patcher.ops import int4 as int4_ops


def gptq_segment(k: int, n: int, group_size: int, act_order: bool, bias: bool, seed: int):
    """Random checkpoint tensors of one GPTQ linear (K x N) on the GPU, with weights of about 1/sqrt(K)."""
    g = torch.Generator().manual_seed(seed)
    groups = fmt.groups_for(k, group_size)
    qweight = fmt.pack_rows(torch.randint(0, 16, (k, n), generator=g))
    qzeros = fmt.pack_cols(torch.randint(0, 15, (groups, n), generator=g))
    scales = (torch.rand(groups, n, generator=g) * 0.5 + 0.5) / (4 * k**0.5)
    g_idx = fmt.default_g_idx(k, group_size)
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=g)]
    b = torch.randn(n, generator=g) * 0.1 if bias else None
    cuda = [t.cuda() for t in (qweight, qzeros, scales.half(), g_idx)]
    return (*cuda, None if b is None else b.half().cuda())


def gptq_linear(k, widths, group_size=128, act_order=False, bias=False, version=1) -> int4_ops.Int4Linear:
    segments = [gptq_segment(k, n, group_size, act_order, bias, seed=i + n) for i, n in enumerate(widths)]
    qweight, qzeros, scales, g_idx, biases = (list(t) for t in zip(*segments))
    group = k if group_size == -1 else group_size
    return int4_ops.Int4Linear(qweight, qzeros, scales, g_idx, biases, group, act_order, 1 if version == 1 else 0)
