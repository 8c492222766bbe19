"""GGUF block formats and their dequantization in torch, bit-identical to `gguf.quants.dequantize`.

A quantized GGUF matrix [rows, cols] is stored as uint8 [rows, cols / block * type_size]: each row is a run of
blocks along the input dimension (cols). Scales are little-endian fp16. Per block (element i of the block):

    Q4_0   32 values, 18 bytes:  d fp16 | qs[16]
           q[i] = qs[i] & 15 (i < 16), qs[i - 16] >> 4 (i >= 16);            w = d * (q - 8)
    Q4_1   32 values, 20 bytes:  d fp16 | m fp16 | qs[16]  (nibbles as Q4_0)  w = d * q + m
    Q8_0   32 values, 34 bytes:  d fp16 | qs int8[32]                         w = d * q
    Q4_K  256 values, 144 bytes: d fp16 | dmin fp16 | scales[12] | qs[128]
           8 sub-blocks of 32, each with a 6-bit scale sc[j] and min mn[j] packed in `scales` (k_scale_min);
           qs in 4 chunks of 32 bytes: chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high ones;
           w = (d * sc[j]) * q - (dmin * mn[j])
    Q5_K  256 values, 176 bytes: d fp16 | dmin fp16 | scales[12] | qh[32] | qs[128]
           low 4 bits as Q4_K; the 5th bit of sub-block j, element e, is bit j of qh[e];  w as Q4_K
    Q6_K  256 values, 210 bytes: ql[128] | qh[64] | scales int8[16] | d fp16
           half h (128 values) reads ql[64h : 64h + 64] and qh[32h : 32h + 32]; its 32-value group g (0..3) takes
           the low nibbles (g < 2) or high nibbles (g >= 2) of ql[64h + 32(g % 2) + e] and bits 2g .. 2g + 1 of
           qh[32h + e];  w = (d * scales[k]) * (q - 32), k = the 16-value group (0..15)

The products are formed in fp32 in the order gguf.quants forms them (each product rounded once, no fused
multiply-add), so the results match it bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QK_K = 256


@dataclass(frozen=True)
class BlockType:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType value
    block_size: int  # values per block
    type_size: int  # bytes per block


TYPES = {
    t.name: t
    for t in (
        BlockType("Q4_0", 2, 32, 18),
        BlockType("Q4_1", 3, 32, 20),
        BlockType("Q8_0", 8, 32, 34),
        BlockType("Q4_K", 12, QK_K, 144),
        BlockType("Q5_K", 13, QK_K, 176),
        BlockType("Q6_K", 14, QK_K, 210),
    )
}
BY_GGML_TYPE = {t.ggml_type: t for t in TYPES.values()}


def block_type(kind: str | int) -> BlockType:
    """The BlockType of a name ("Q4_0") or a ggml type number / gguf.GGMLQuantizationType."""
    found = BY_GGML_TYPE.get(int(kind)) if not isinstance(kind, str) else TYPES.get(kind)
    if found is None:
        raise ValueError(f"GGUF tensor type {kind!r} is not supported (supported: {', '.join(TYPES)})")
    return found


def bytes_per_row(kind: str | int, cols: int) -> int:
    t = block_type(kind)
    if cols % t.block_size:
        raise ValueError(f"{t.name} rows of {cols} values are not a multiple of its block of {t.block_size}")
    return cols // t.block_size * t.type_size


def _fp16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at byte `start` of every block, as fp32 [n, 1]."""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] -> [..., 2, n]: the low nibbles, then the high nibbles."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=-2)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K packed scales uint8 [n, 12] -> sc, mn uint8 [n, 8] (6 bits each).

    Bytes 0-3 hold sc[0..3] in bits 0-5, bytes 4-7 mn[0..3]; bytes 8-11 hold the low 4 bits of sc[4..7] (low nibble)
    and mn[4..7] (high nibble), whose top 2 bits are bits 6-7 of bytes 0-3 (sc) and 4-7 (mn).
    """
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def unpack(blocks: torch.Tensor, kind: str | int) -> dict[str, torch.Tensor]:
    """The integer values and fp32 scales of blocks uint8 [n, type_size], per type:

    Q4_0: q [n, 32] (0..15), d [n, 1];  Q4_1: q, d, m [n, 1];  Q8_0: q [n, 32] (int8), d;
    Q4_K/Q5_K: q [n, 8, 32] (0..15 / 0..31), d * sc [n, 8, 1], dmin * mn [n, 8, 1];
    Q6_K: q [n, 16, 16] (-32..31), d * scale [n, 16, 1].
    Integers are int16 (exact in any float type).
    """
    t = block_type(kind)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != t.type_size:
        raise ValueError(f"{t.name} blocks must be uint8 [n, {t.type_size}], got {blocks.dtype} {tuple(blocks.shape)}")
    n = blocks.shape[0]
    if t.name == "Q4_0":
        q = _nibbles(blocks[:, 2:]).reshape(n, 32).to(torch.int16) - 8
        return {"q": q, "d": _fp16(blocks, 0)}
    if t.name == "Q4_1":
        q = _nibbles(blocks[:, 4:]).reshape(n, 32).to(torch.int16)
        return {"q": q, "d": _fp16(blocks, 0), "m": _fp16(blocks, 2)}
    if t.name == "Q8_0":
        return {"q": blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16), "d": _fp16(blocks, 0)}
    if t.name in ("Q4_K", "Q5_K"):
        sc, mn = k_scale_min(blocks[:, 4:16])
        d = _fp16(blocks, 0) * sc.float()
        dm = _fp16(blocks, 2) * mn.float()
        qs = blocks[:, 16:144] if t.name == "Q4_K" else blocks[:, 48:176]
        q = _nibbles(qs.reshape(n, 4, 32)).reshape(n, 8, 32).to(torch.int16)
        if t.name == "Q5_K":
            shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device).view(1, 8, 1)
            high = (blocks[:, 16:48].unsqueeze(1) >> shifts) & 1
            q = q | (high.to(torch.int16) << 4)
        return {"q": q, "d": d.unsqueeze(-1), "dm": dm.unsqueeze(-1)}
    # Q6_K
    ql = _nibbles(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)  # group 4 * half + 2 * nibble + byte half
    # (arange, not a tensor from a list: a host-to-device copy can't run inside the decode step's graph capture)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device).view(1, 1, 4, 1)
    qh = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03  # [half, group in half, e]
    q = (ql | (qh.reshape(n, 8, 32) << 4)).to(torch.int16) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = _fp16(blocks, 208) * scales
    return {"q": q.reshape(n, 16, 16), "d": d.unsqueeze(-1)}


def dequantize_blocks(blocks: torch.Tensor, kind: str | int) -> torch.Tensor:
    """uint8 [n, type_size] -> fp32 [n, block_size]."""
    t = block_type(kind)
    p = unpack(blocks, t.name)
    n = blocks.shape[0]
    if t.name == "Q4_1":
        return p["d"] * p["q"].float() + p["m"]
    if t.name in ("Q4_K", "Q5_K"):
        return (p["d"] * p["q"].float() - p["dm"]).reshape(n, QK_K)
    return (p["d"] * p["q"].float()).reshape(n, t.block_size)


def dequantize(data: torch.Tensor, kind: str | int) -> torch.Tensor:
    """GGUF rows uint8 [rows, bytes_per_row] (any leading shape) -> fp32 [rows, cols], as gguf.quants.dequantize."""
    t = block_type(kind)
    if data.dtype != torch.uint8:
        raise ValueError(f"GGUF blocks must be uint8, got {data.dtype}")
    if data.dim() == 0 or data.shape[-1] % t.type_size:
        raise ValueError(f"{t.name}: {tuple(data.shape)} bytes are not whole rows of {t.type_size}-byte blocks")
    lead, width = data.shape[:-1], data.shape[-1]
    cols = width // t.type_size * t.block_size
    out = dequantize_blocks(data.reshape(-1, t.type_size), t.name)
    return out.reshape(*lead, cols)
