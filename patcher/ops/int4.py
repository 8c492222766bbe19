"""GPTQ int4 linears as the int4 ops take them, and the work-split rule of the decode-step kernels.

`Int4Linear` groups one to three GPTQLinear modules that read the same input (q, k, v; gate, up; one projection; or
GPT-NeoX's QKV beside its MLP's input projection, `side_by_side`) and hands their checkpoint tensors to the
`patcher::int4_*` ops as parallel lists, so fused projections need no concatenated copy and `state_dict` is
untouched.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MAX_SEGMENTS = 3
TILE = 128  # output columns per block of the int4 kernels (whole heads when RoPE follows: tile_width)
STAGE_BYTES = 32 * 1024  # limit of a block's shared x stage (kernels/int4/params.h: kInt4StageBytes; stage_bytes)
GROUP_STAGE_BYTES = 40 * 1024  # limit of the tensor-core kernel's shared scales and zero points of one K slice
# Tile counters at the front of every workspace, the same number for every op (kernels/int4/params.h: kInt4Counters):
# the ops of a decode step share one workspace, and an op with more tiles must not read another's partial sums as
# its counters.
COUNTERS = 4096
# The decode attention's block (kernels/attention/attention.cuh: kAttnWarps warps); the share of an op's blocks the
# split rule keeps at least so that the attention's blocks fit beside them (splits_for: `beside`), unless the op is
# so small (SMALL_OP_BYTES: about a microsecond of streaming at 3 TB/s, less than a block's fixed start and end) that
# fewer blocks hardly slow it.
ATTENTION_THREADS = 256
BESIDE_KEEP = 0.75
SMALL_OP_BYTES = 4 << 20


@dataclass(frozen=True)
class Beside:
    """The decode attention's blocks next to an int4 op of the decode step (splits_for): how many (at a short
    context one a query head and row), how much of an SM each takes in threads' worth of registers (256: its
    128-register forms, half an SM; 512: the form that finishes the QKV sums at ~150 registers, below 32 blocks, a
    whole one), and whether the op runs before the attention (the op's blocks are spread over the SMs first, one to
    each, then a second; the attention's take the SMs they leave room on) or after it (the attention's blocks are in
    place, and the op's fill the rest)."""

    blocks: int
    threads: int = ATTENTION_THREADS
    before: bool = True


@dataclass
class Int4Linear:
    qweight: list[torch.Tensor]
    qzeros: list[torch.Tensor]
    scales: list[torch.Tensor]
    g_idx: list[torch.Tensor]
    bias: list[torch.Tensor | None]
    group_size: int  # k // group_size is the group when not act_order
    act_order: bool
    zero_offset: int  # 1 for GPTQ v1 (stores zero - 1), 0 for v2

    @property
    def in_features(self) -> int:
        return self.qweight[0].shape[0] * 8

    @property
    def widths(self) -> list[int]:
        return [q.shape[1] for q in self.qweight]

    def args(self, bias: bool = True) -> tuple:
        """The op arguments (qweight, qzeros, scales, g_idx, bias, group_size, act_order, zero_offset); with
        bias=False every segment's bias is None (int4_gemv_acc, whose reader adds the bias)."""
        return (
            self.qweight,
            self.qzeros,
            self.scales,
            self.g_idx,
            self.bias if bias else [None] * len(self.bias),
            self.group_size,
            self.act_order,
            self.zero_offset,
        )

    def nbytes(self) -> int:
        tensors = [*self.qweight, *self.qzeros, *self.scales, *(b for b in self.bias if b is not None)]
        return sum(t.numel() * t.element_size() for t in tensors)


def int4_reason(modules) -> str | None:
    """Why these GPTQLinear modules can't run as one int4 linear, or None."""
    first = modules[0]
    for m in modules:
        if m.scales.dtype != torch.float16:
            return f"GPTQ scales in {m.scales.dtype} (the int4 kernels read float16 scales)"
        if m.bias is not None and m.bias.dtype != torch.float16:
            return f"GPTQ bias in {m.bias.dtype} (the int4 kernels read a float16 bias)"
        if (m.in_features, m.group_size, m.version) != (first.in_features, first.group_size, first.version):
            return "fused GPTQ projections differ in in_features, group size or format version"
        if m.qweight.device != first.qweight.device:
            return "fused GPTQ projections are on different devices"
    return None


def from_modules(modules) -> Int4Linear:
    """The Int4Linear of GPTQLinear modules that int4_reason accepted. Checks g_idx once (a host sync)."""
    first = modules[0]
    K = first.in_features
    group_size = K if first.group_size in (-1, 0) or first.group_size >= K else first.group_size
    default = torch.arange(K, device=first.g_idx.device, dtype=torch.int32) // group_size
    # act-order (g_idx a permutation of the groups) or an odd group size takes the kernels' per-k path.
    act_order = group_size % 8 != 0 or any(not torch.equal(m.g_idx, default) for m in modules)
    return Int4Linear(
        qweight=[m.qweight for m in modules],
        qzeros=[m.qzeros for m in modules],
        scales=[m.scales for m in modules],
        g_idx=[m.g_idx for m in modules],
        bias=[m.bias for m in modules],
        group_size=group_size,
        act_order=act_order,
        zero_offset=1 if first.version == 1 else 0,
    )


def side_by_side(first: Int4Linear, second: Int4Linear) -> Int4Linear | None:
    """One Int4Linear of two that read the same input: the segments of `first`, then those of `second` (no copies),
    or None where their formats differ or the segments would exceed MAX_SEGMENTS."""
    same = (first.in_features, first.group_size, first.act_order, first.zero_offset) == (
        second.in_features,
        second.group_size,
        second.act_order,
        second.zero_offset,
    )
    if not same or len(first.widths) + len(second.widths) > MAX_SEGMENTS:
        return None
    return Int4Linear(
        qweight=first.qweight + second.qweight,
        qzeros=first.qzeros + second.qzeros,
        scales=first.scales + second.scales,
        g_idx=first.g_idx + second.g_idx,
        bias=first.bias + second.bias,
        group_size=first.group_size,
        act_order=first.act_order,
        zero_offset=first.zero_offset,
    )


def tile_width(head_dim: int | None = None) -> int:
    """Output columns per block, as kernels/int4/int4.cu's int4_tile_width: 128, or with RoPE (head_dim given) the
    fewest whole heads that make whole warps of 32 columns, or one head where that would exceed 256 columns."""
    if head_dim is None:
        return TILE
    width = head_dim
    while width % 32:
        width += head_dim
    return width if width <= 256 else head_dim


def tiles(linear: Int4Linear, head_dim: int | None = None) -> int:
    width = tile_width(head_dim)
    return sum(math.ceil(n / width) for n in linear.widths)


def block_threads(tile_width: int) -> int:
    """Threads of one int4 decode block, as the CUDA-core kernel (kernels/int4/int4_gemv.cuh) picks them: 4 columns
    per thread across the tile in whole eighths of a warp, runs of qweight rows in fours, within 256 threads.
    The tensor-core kernel's column warps times runs (kernels/int4/int4_mma.cuh) come to the same count for every
    tile it takes. 0 for a tile wider than 256 columns (heads over 256 wide: the kernels reject them)."""
    cols = math.ceil(math.ceil(tile_width / 4) / 8) * 8
    return cols * (256 // cols // 4 * 4)


def splits_for(
    batch: int,
    linear: Int4Linear,
    multiprocessors: int,
    head_dim: int | None = None,
    dtype: torch.dtype = torch.float32,
    beside: Beside | None = None,
) -> int:
    """K slices for the decode-step kernels: no more blocks than the SMs hold at once, so that every block runs
    in the first wave (a block left for a second wave pays its whole chain of load, reduce and epilogue again);
    at least 16 qweight rows per block; within the kernel's shared x stage (stage_bytes: the activations' `dtype`
    decides how many rows of x it holds; the fp32 default is the rule for any dtype, with more slices than fp16/bf16
    need). The launch bounds guarantee 2 blocks of 256 threads per SM (128 registers a thread), so a narrower block
    (Pythia's tiles of two 80-wide heads: 160 threads) fits 512 // threads of them: 3.

    `beside`: the decode attention's blocks, where the op is the linear just before or just after it (Beside). Where
    the op's blocks fill the SMs, attention blocks that find no room wait for op blocks to end: before the attention
    (QKV), its blocks start late, with nothing loaded; after it (the output projection), the op's own blocks start
    only as attention blocks end, with no weights preloaded meanwhile. So the op takes fewer K slices where that
    leaves room for all of them, unless that costs more than a quarter of its blocks (BESIDE_KEEP) in an op of more
    than SMALL_OP_BYTES. docs/decode-int4.md has the measurements behind each of these choices."""
    rows = linear.in_features // 8
    threads = max(1, block_threads(tile_width(head_dim)))
    resident, width = 512 // threads, tiles(linear, head_dim)
    splits = max(1, min(max(1, rows // 16), resident * multiprocessors // width))
    if beside is not None and beside.blocks > 0:
        per_sm = (512 - beside.threads) // threads  # op blocks an SM holds beside one attention block
        attention = min(beside.blocks, multiprocessors)
        if beside.before:  # SMs left with at most per_sm op blocks, one attention block each
            room = multiprocessors * (per_sm + 1) - attention
        else:  # the op's blocks around the attention's, one attention block an SM
            room = resident * (multiprocessors - attention) + per_sm * attention
        fewer = max(1, min(splits, room // width))
        if fewer >= BESIDE_KEEP * splits or linear.nbytes() <= SMALL_OP_BYTES:
            splits = fewer
    while not stages_fit(batch, linear, splits, dtype, head_dim):
        splits += 1
    return min(splits, rows)


def stages_fit(batch: int, linear: Int4Linear, splits: int, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether a block's x stage and group stage at `splits` K slices fit the kernel's shared memory."""
    return (
        stage_bytes(batch, linear, splits, dtype, head_dim) <= STAGE_BYTES
        and group_stage_bytes(linear, splits, head_dim) <= GROUP_STAGE_BYTES
    )


def splits_limit(batch: int, linear: Int4Linear, dtype: torch.dtype, head_dim: int | None = None) -> tuple[int, int]:
    """The fewest and the most K slices the decode-step kernels take for a linear: the fewest whose x and group stages
    fit the kernel's shared memory (splits_for's loop), the most one qweight row a slice."""
    rows = linear.in_features // 8
    fewest = 1
    while fewest < rows and not stages_fit(batch, linear, fewest, dtype, head_dim):
        fewest += 1
    return fewest, rows


def tensor_cores(linear: Int4Linear, dtype: torch.dtype, head_dim: int | None = None) -> bool:
    """Whether the tensor-core kernel takes the linear, as kernels/int4/int4_gemv.cuh picks it (int4_mma.cuh:
    mma_applies): fp16/bf16 activations, no act-order, groups of whole 32s, tiles of whole warps within 256 columns."""
    width = tile_width(head_dim)
    return (
        dtype in (torch.float16, torch.bfloat16)
        and not linear.act_order
        and linear.group_size % 32 == 0
        and width % 32 == 0
        and width <= 256
    )


def stage_bytes(batch: int, linear: Int4Linear, splits: int, dtype: torch.dtype, head_dim: int | None = None) -> int:
    """Bytes of a block's shared x stage at `splits` K slices, as kernels/int4/int4.cu's int4_stage_bytes: the
    tensor-core kernel holds x in the 2-byte dtype, in whole 4-row steps of its slice; the CUDA-core kernel in
    fp32."""
    per_split = math.ceil(linear.in_features // 8 / splits)
    if tensor_cores(linear, dtype, head_dim):
        return batch * ((per_split + 3) // 4 * 4) * 8 * 2
    return batch * per_split * 8 * 4


def group_stage_bytes(linear: Int4Linear, splits: int, head_dim: int | None = None) -> int:
    """Shared memory the tensor-core kernel's scales and zero points of one K slice take, as kernels/int4/int4.cu's
    int4_group_stage_bytes: slices of whole 4-row steps, each starting at a multiple of its span of k, so on a group
    boundary when the span is a multiple of the group size, else spanning at most two groups more."""
    if linear.act_order:
        return 0
    rows = linear.in_features // 8
    span = (math.ceil(rows / splits) + 3) // 4 * 4 * 8
    groups = span // linear.group_size + (0 if span % linear.group_size == 0 else 2)
    return (groups * tile_width(head_dim) * 5 // 2 + 15) // 16 * 16


def workspace_numel(batch: int, linear: Int4Linear, splits: int, head_dim: int | None = None) -> int:
    """int32 elements of the workspace as kernels/bindings_int4.cpp checks it: COUNTERS counters, then fp32 partial
    sums, one row of [batch, sum of widths] per K slice."""
    return COUNTERS + splits * batch * sum(linear.widths)
