"""The GPTQ checkpoint format (AutoGPTQ / GPTQModel), 4-bit: packing, unpacking and the reference dequantization.

Per quantized linear with in_features K and out_features N, G groups:

    qweight  int32 [K / 8, N]   8 consecutive input rows per word, row 8i + j in bits 4j .. 4j+3
    qzeros   int32 [G, N / 8]   8 consecutive output columns per word, column 8i + j in bits 4j .. 4j+3
    scales   fp16  [G, N]
    g_idx    int32 [K]          the group of each input row (k // group_size, or a permutation with act-order)
    bias     fp16  [N]          optional

    W[k, n] = scales[g, n] * (q[k, n] - zero[g, n]),  g = g_idx[k];  y = x @ W + bias

The zero points are stored two ways: v1 ("gptq", what AutoGPTQ writes and GPTQModel saves by default) stores
zero - 1 and adds the 1 back after unpacking (so a stored 15 reads as 16: the v1 format cannot hold a zero of 0);
v2 ("gptq_v2", GPTQModel's internal layout) stores the zero itself. Both are read here.
"""

from __future__ import annotations

import torch

BITS = 4
PACK = 32 // BITS  # values per int32 word
MAXQ = (1 << BITS) - 1
FORMAT_VERSIONS = {"gptq": 1, "gptq_v2": 2}
_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)


def unpack_rows(qweight: torch.Tensor) -> torch.Tensor:
    """qweight int32 [K/8, N] -> int8 [K, N] (values 0..15)."""
    shifts = _SHIFTS.to(qweight.device).view(1, PACK, 1)
    values = (qweight.unsqueeze(1) >> shifts) & MAXQ  # arithmetic shift; the mask drops the sign bits
    return values.reshape(qweight.shape[0] * PACK, qweight.shape[1]).to(torch.int8)


def unpack_cols(qzeros: torch.Tensor) -> torch.Tensor:
    """qzeros int32 [G, N/8] -> int8 [G, N] (values 0..15)."""
    shifts = _SHIFTS.to(qzeros.device).view(1, 1, PACK)
    values = (qzeros.unsqueeze(2) >> shifts) & MAXQ
    return values.reshape(qzeros.shape[0], qzeros.shape[1] * PACK).to(torch.int8)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    return torch.where(words >= (1 << 31), words - (1 << 32), words).to(torch.int32)


def pack_rows(values: torch.Tensor) -> torch.Tensor:
    """int [K, N] (0..15, K a multiple of 8) -> qweight int32 [K/8, N]."""
    K, N = values.shape
    if K % PACK:
        raise ValueError(f"in_features {K} must be a multiple of {PACK} to pack 4-bit values")
    v = values.to(torch.int64).reshape(K // PACK, PACK, N)
    words = (v << (_SHIFTS.to(torch.int64).to(values.device).view(1, PACK, 1))).sum(dim=1)
    return _to_int32(words)


def pack_cols(values: torch.Tensor) -> torch.Tensor:
    """int [G, N] (0..15, N a multiple of 8) -> qzeros int32 [G, N/8]."""
    G, N = values.shape
    if N % PACK:
        raise ValueError(f"out_features {N} must be a multiple of {PACK} to pack 4-bit zeros")
    v = values.to(torch.int64).reshape(G, N // PACK, PACK)
    words = (v << (_SHIFTS.to(torch.int64).to(values.device).view(1, 1, PACK))).sum(dim=2)
    return _to_int32(words)


def zero_points(qzeros: torch.Tensor, version: int) -> torch.Tensor:
    """The zero points [G, N] as the format means them (int16: v1's +1 can reach 16)."""
    zeros = unpack_cols(qzeros).to(torch.int16)
    return zeros + 1 if version == 1 else zeros


def dequantize(qweight, qzeros, scales, g_idx, version: int = 1) -> torch.Tensor:
    """W [K, N] in the dtype of `scales`: scales[g_idx] * (q - zero[g_idx]), one rounding (the multiply), as the
    AutoGPTQ/GPTQModel torch kernels compute it."""
    q = unpack_rows(qweight).to(torch.int16)
    g = g_idx.long()
    return scales[g] * (q - zero_points(qzeros, version)[g]).to(scales.dtype)


def groups_for(in_features: int, group_size: int) -> int:
    return 1 if group_size in (-1, 0) or group_size >= in_features else -(-in_features // group_size)


def default_g_idx(in_features: int, group_size: int, device=None) -> torch.Tensor:
    if group_size in (-1, 0):
        return torch.zeros(in_features, dtype=torch.int32, device=device)
    return torch.arange(in_features, device=device, dtype=torch.int32) // group_size
