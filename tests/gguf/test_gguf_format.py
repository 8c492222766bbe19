"""GGUF block formats: the torch dequantization against the gguf package's own, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf_blocks import random_blocks, wild_scales

from patcher.gguf import format as fmt

gguf = pytest.importorskip("gguf")

QUANTIZABLE = ("Q4_0", "Q4_1", "Q8_0")  # the types gguf.quants.quantize implements


def gguf_dequantize(data: torch.Tensor, kind: str) -> np.ndarray:
    return gguf.quants.dequantize(data.numpy(), gguf.GGMLQuantizationType[kind])


def assert_bits_equal(got: torch.Tensor, expected: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == expected.shape
    assert np.isfinite(expected).all()
    mismatch = got.numpy().view(np.uint32) != expected.view(np.uint32)
    assert not mismatch.any(), f"{mismatch.sum()} values differ in their bits"


@pytest.mark.parametrize("kind", list(fmt.TYPES))
@pytest.mark.parametrize("rows", [1, 7])
def test_dequantize_matches_gguf_bit_for_bit(kind, rows):
    gen = torch.Generator().manual_seed(rows)
    cols = fmt.TYPES[kind].block_size * 3
    data = random_blocks(kind, rows, cols, gen, scales=wild_scales)
    got = fmt.dequantize(data, kind)
    assert_bits_equal(got, gguf_dequantize(data, kind))
    assert got.shape == (rows, cols)


def test_dequantize_covers_every_quant_value():
    """Every byte value in every quant position (random data over 4096 blocks), with the type given by number."""
    gen = torch.Generator().manual_seed(0)
    for kind, t in fmt.TYPES.items():
        data = random_blocks(kind, 64, 64 * t.block_size, gen, scales=wild_scales)
        assert_bits_equal(fmt.dequantize(data, t.ggml_type), gguf_dequantize(data, kind))


@pytest.mark.parametrize("kind", QUANTIZABLE)
def test_quantize_dequantize_round_trip(kind):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 96, generator=gen) * torch.logspace(-3, 1, 5).unsqueeze(1)
    data = torch.from_numpy(gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType[kind]))
    assert data.shape == (5, fmt.bytes_per_row(kind, 96))
    got = fmt.dequantize(data, kind)
    assert_bits_equal(got, gguf_dequantize(data, kind))
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    step = {"Q4_0": amax / 8, "Q8_0": amax / 127, "Q4_1": (blocks.amax(1, True) - blocks.amin(1, True)) / 15}[kind]
    err = (got.reshape(-1, 32) - blocks).abs()
    assert (err <= step).all(), f"round-trip error {(err / step).max():.3g} steps"


def test_k_scale_min_unpacks_six_bit_fields():
    sc = torch.arange(8, dtype=torch.uint8) * 9  # 0..63
    mn = 63 - sc
    packed = torch.zeros(1, 12, dtype=torch.uint8)
    packed[0, 0:4] = sc[:4] | ((sc[4:] >> 4) << 6)
    packed[0, 4:8] = mn[:4] | ((mn[4:] >> 4) << 6)
    packed[0, 8:12] = (sc[4:] & 0x0F) | ((mn[4:] & 0x0F) << 4)
    got_sc, got_mn = fmt.k_scale_min(packed)
    assert torch.equal(got_sc[0], sc) and torch.equal(got_mn[0], mn)


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="not supported"):
        fmt.block_type("Q5_0")
    with pytest.raises(ValueError, match="uint8"):
        fmt.dequantize(torch.zeros(2, 18), "Q4_0")
    with pytest.raises(ValueError, match="whole rows"):
        fmt.dequantize(torch.zeros(2, 19, dtype=torch.uint8), "Q4_0")
    with pytest.raises(ValueError, match="multiple"):
        fmt.bytes_per_row("Q4_K", 100)
