"""The pure-torch GGUF matmuls: Q8_1 activation quantization, W4A8 against float64 math, W4A16."""

from __future__ import annotations

import pytest
import torch
from gguf_blocks import random_blocks

from patcher.gguf import format as fmt
from patcher.gguf import reference as ref

EPS32 = torch.finfo(torch.float32).eps


def weights(kind: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """GGUF blocks: quantized from random normal weights where gguf quantizes the type, random blocks otherwise."""
    gen = torch.Generator().manual_seed(seed)
    if kind in ("Q4_0", "Q4_1", "Q8_0"):
        gguf = pytest.importorskip("gguf")
        w = torch.randn(rows, cols, generator=gen) * 0.05
        return torch.from_numpy(gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType[kind]))
    return random_blocks(kind, rows, cols, gen)


def q8_1_by_loop(block: list[float]) -> tuple[list[int], float]:
    """llama.cpp's quantize_row_q8_1_ref, element by element, in fp32."""
    x = torch.tensor(block, dtype=torch.float32)
    d = x.abs().max() / 127
    inv = 1 / d if d != 0 else torch.tensor(0.0)
    qs = []
    for v in (x * inv).tolist():  # roundf: halves away from zero
        qs.append(int(abs(v) + 0.5) * (1 if v >= 0 else -1))
    return qs, d.to(torch.float16).item()


def test_quantize_q8_1_matches_llama_cpp_rounding():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 96, generator=gen) * 3
    x[0, :32] = torch.arange(-16, 16) + 0.5  # with 127 set below, d = 1: every value a half, rounded away from 0
    x[0, 31] = 127.0
    x[1, 32:64] = 0.0  # an all-zero block: d = 0, q = 0, s = 0
    q, d, s = ref.quantize_q8_1(x)
    assert q.dtype == torch.int8 and q.shape == (3, 3, 32) and d.shape == s.shape == (3, 3)
    for row in range(3):
        for b in range(3):
            expected_q, expected_d = q8_1_by_loop(x[row, 32 * b : 32 * b + 32].tolist())
            assert q[row, b].tolist() == expected_q
            assert d[row, b].item() == expected_d
    assert q[0, 0, :31].tolist() == [v + (1 if v >= 0 else 0) for v in range(-16, 15)]
    assert torch.equal(s, q.sum(-1).float() * d)
    assert d[1, 1] == 0 and s[1, 1] == 0 and not q[1, 1].any()


def test_pack_q8_1_round_trip():
    x = torch.randn(2, 5, 64)
    q, d, s = ref.quantize_q8_1(x)
    packed = ref.pack_q8_1(q, d, s)
    assert packed.dtype == torch.uint8 and packed.shape == (2, 5, 2 * ref.Q8_1_BYTES)
    q2, d2, s2 = ref.unpack_q8_1(packed)
    assert torch.equal(q2, q) and torch.equal(d2, d)
    assert torch.equal(s2, s.to(torch.float16).float())  # the block stores s as fp16


@pytest.mark.parametrize("kind", list(fmt.TYPES))
def test_w4a8_is_float64_math_on_the_quantized_operands(kind):
    """W4A8 = the product of the dequantized weights and the Q8_1 activations (d * q), up to fp32 rounding."""
    cols = 2 * fmt.TYPES[kind].block_size
    data = weights(kind, 24, cols)
    x = torch.randn(2, 3, cols, generator=torch.Generator().manual_seed(1))
    x[0, 0, :32] *= 100  # blocks of very different scales
    got = ref.linear_w4a8(x, data, kind)
    assert got.shape == (2, 3, 24) and got.dtype == torch.float32
    q, d, _ = ref.quantize_q8_1(x)
    activations = (q.double() * d.double().unsqueeze(-1)).reshape(x.shape)
    w = fmt.dequantize(data, kind).double()
    expected = activations @ w.T
    magnitude = activations.abs() @ w.abs().T
    groups = cols // 16
    bound = 4 * (groups + 4) * EPS32 * magnitude
    assert ((got.double() - expected).abs() <= bound).all()


@pytest.mark.parametrize("kind", list(fmt.TYPES))
def test_w4a8_error_against_the_unquantized_activations(kind):
    """|W4A8 - x @ W^T| <= sum_k |W[n, k]| * 0.57 d_a(k): half a step of Q8_1 rounding plus the fp16 rounding of d
    (2^-11 of 127 steps), plus fp32 rounding."""
    cols = 2 * fmt.TYPES[kind].block_size
    data = weights(kind, 16, cols, seed=2)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(3))
    got = ref.linear_w4a8(x, data, kind).double()
    w = fmt.dequantize(data, kind).double()
    _, d, _ = ref.quantize_q8_1(x)
    step = d.double().repeat_interleave(32, dim=1)  # [M, K]
    bound = 0.57 * step @ w.abs().T + 64 * EPS32 * (x.double().abs() @ w.abs().T)
    err = (got - x.double() @ w.T).abs()
    assert (err <= bound).all()
    assert err.max() > 0  # the activations were quantized


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_w4a8_takes_a_bias_and_the_activation_dtype(kind):
    cols = fmt.TYPES[kind].block_size
    data = weights(kind, 8, cols)
    bias = torch.randn(8)
    x = torch.randn(4, cols)
    plain = ref.linear_w4a8(x, data, kind)
    assert torch.equal(ref.linear_w4a8(x, data, kind, bias), plain + bias)
    half = ref.linear_w4a8(x.half(), data, kind)
    assert half.dtype == torch.float16
    assert torch.equal(half, ref.linear_w4a8(x.half().float(), data, kind).half())


def test_w4a8_chunks_rows_alike(monkeypatch):
    data = weights("Q4_0", 32, 64)
    x = torch.randn(9, 64)
    whole = ref.linear_w4a8(x, data, "Q4_0")
    monkeypatch.setattr(ref, "_CHUNK_ELEMENTS", 2 * 32 * 2)  # two rows a chunk
    assert torch.equal(ref.linear_w4a8(x, data, "Q4_0"), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_w4a16_is_dequantize_then_linear(dtype):
    data = weights("Q4_K", 12, 512)
    x = torch.randn(3, 512).to(dtype)
    bias = torch.randn(12)
    expected = torch.nn.functional.linear(x, fmt.dequantize(data, "Q4_K").to(dtype), bias.to(dtype))
    assert torch.equal(ref.linear_w4a16(x, data, "Q4_K", bias), expected)


def test_shape_mismatch_is_refused():
    data = weights("Q4_0", 4, 64)
    with pytest.raises(ValueError, match="does not take 32 inputs"):
        ref.linear_w4a8(torch.randn(2, 32), data, "Q4_0")
    with pytest.raises(ValueError, match="multiple of 32"):
        ref.quantize_q8_1(torch.randn(2, 48))
