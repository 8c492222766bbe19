"""Random GGUF blocks for the tests: random bytes, with every fp16 scale field set from a chosen pool."""

from __future__ import annotations

import torch

from patcher.gguf import format as fmt

SCALE_BYTES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def wild_scales(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 [n]: normal values over six decades, negatives, +0, -0, subnormals and the largest finite value."""
    normal = torch.randn(n, generator=gen) * 10 ** (torch.rand(n, generator=gen) * 6 - 4)
    special = torch.tensor([0.0, -0.0, 6e-8, -6e-8, 3e-6, -4.5e-5, 6.1e-5, 65504.0, -65504.0, 1.0])
    pick = torch.randint(0, 3, (n,), generator=gen) == 0
    values = torch.where(pick, special[torch.randint(0, len(special), (n,), generator=gen)], normal)
    return values.to(torch.float16)


def sane_scales(n: int, gen: torch.Generator) -> torch.Tensor:
    """fp16 [n] around 0.01 (weights of a trained layer's size), both signs."""
    return (torch.randn(n, generator=gen) * 0.01).to(torch.float16)


def random_blocks(kind: str, rows: int, cols: int, gen: torch.Generator, scales=sane_scales) -> torch.Tensor:
    """uint8 [rows, bytes_per_row]: random quants, each scale field drawn by `scales`."""
    t = fmt.TYPES[kind]
    data = torch.randint(0, 256, (rows, fmt.bytes_per_row(kind, cols)), dtype=torch.uint8, generator=gen)
    blocks = data.view(-1, t.type_size)
    for at in SCALE_BYTES[kind]:
        blocks[:, at : at + 2] = scales(blocks.shape[0], gen).view(torch.uint8).view(-1, 2)
    return data
