"""The GGUF decode GEMV (patcher::gguf_gemv, kernels/gguf/) against its reference, patcher/gguf/reference.py.

W4A16 (quantize_activations=False) follows the suite's 2x rule (conftest.check_op): the kernel forms each weight as
the reference does (dequantized in fp32, rounded to the dtype) and sums in fp32, as cuBLAS does.

W4A8 has its own bound, W4A8 BOUND, because its reference is not a float64 computation. The kernel and the
reference quantize x to the same Q8_1 integers and scales (bit for bit: a single different q would cost a whole
d_a * d_w * q_w, which the bound is tight enough to catch), form the same exact integer dot product per block and the
same fp32 products t = (d_w * d_a) * isum and m_w * s_a, and differ only in the order those fp32 terms are added,
then in the one final rounding to the dtype. So both are measured against S, the exact sum of the same fp32 terms
and the bias (float64 here): the reference's distance |ref - S| is computed, and the kernel's is bounded by its
summation order, in which each term passes through at most D = K / 1024 + 7 fp32 additions (one per chunk of 1024
values in a lane, 5 in the warp's butterfly, the sums of d_w terms and m_w terms (Q4_1, Q4_K, Q5_K) or the pair of
16-value group terms a lane adds first (Q6_K), and the bias), so |kernel_fp32 - S| <= (D + 1) u A, u = 2^-24,
A = sum |terms| + |bias|; rounding to the dtype adds at most one unit in its last place:

    W4A8 BOUND:  |kernel - ref| <= |ref - S| + E + eps (|S| + E + tiny),   E = (D + 1) 2^-24 A

(eps = torch.finfo(dtype).eps, tiny its smallest normal, for subnormal outputs). The reference runs on CPU copies of
the inputs: its meaning is the CPU computation, which the kernel must reproduce on the GPU.

CPU tests (no marker): the op's reference is reference.linear_w4a8 / linear_w4a16 bit for bit, and its schema and
fake kernel pass torch.library.opcheck. The prefill ops (more than 8 rows) are tested in test_gguf_prefill_kernels.py.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from conftest import DTYPES, check_op, max_err, poison_cuda_cache, rope_tables

from patcher import random_models as rm
from patcher.gguf import GGUFLinear
from patcher.gguf import reference as ref
from patcher.gguf.random_weights import quantize_random, random_blocks
from patcher.ops import KERNELS, REFERENCE
from patcher.ops.gguf import GEMV_KINDS

# (N, K): odd output widths (one row, a last block of 8 rows partly filled) against K of one block, of 3 blocks (rows
# of 54/60/102 bytes: misaligned for 16-byte loads), of 40 blocks (a chunk of 32 and a quarter one), of 64 blocks and
# of Llama-3.1-8B's down_proj (448 blocks: 14 chunks of 32). K of 40, 64 and 448 blocks takes W4A8's aligned kernel
# (as every K-quant shape here but Q6_K's); 16388 rows (a multiple of 4, at least 16384) its Q4_0 and Q4_1 form
# that takes four rows a warp at batch 1, the last block of 32 rows a quarter filled.
SHAPES = [(1, 32), (1, 14336), (33, 96), (33, 1280), (33, 2048), (33, 14336), (4097, 32), (4097, 96), (4097, 2048)]
SHAPES += [(4097, 14336), (16388, 1280)]
# The K-quants' K is whole super-blocks of 256: one super-block (a chunk of 1024 values a quarter full), 3 (Q6_K rows
# of 630 bytes, misaligned for 16-byte loads), 5 (a full chunk and a quarter one), 8 (two full chunks) and 14336
# (56 super-blocks: 14 chunks).
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
K_SHAPES = [(1, 256), (1, 14336), (33, 768), (33, 1280), (33, 14336), (4097, 256), (4097, 768), (4097, 2048)]
K_SHAPES += [(4097, 14336)]
CASES = [(kind, n, k) for kind in GEMV_KINDS for n, k in (K_SHAPES if kind in K_QUANTS else SHAPES)]


@functools.cache
def weights(kind: str, n: int, k: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random blocks [n, bytes] of `kind` on the CPU (weights about 1/sqrt(K)) and a bias, made once per shape."""
    gen = torch.Generator().manual_seed(n * 7 + k)
    blocks = random_blocks(kind, n, k, gen)
    return blocks, (torch.randn(n, generator=gen) * 0.5 if bias else None)


def w4a8_bound(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias, expected: torch.Tensor) -> torch.Tensor:
    """W4A8 BOUND of the module docstring, elementwise, on the CPU: S and A from the reference's own parts (its
    fp32 products, summed in float64), `expected` the reference's output."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).cpu()
    q_w, scale, offset, group = ref.affine(blocks.cpu(), kind)  # group: 32, or Q6_K's 16
    q_a, d_a, s_a = ref.quantize_q8_1(rows)
    nb, groups = k // 32, k // group
    q_a = q_a.double().reshape(rows.shape[0], groups, group)
    isum = torch.einsum("mgi,ngi->mng", q_a, q_w.double().reshape(-1, groups, group)).float()  # exact integers
    d_groups = d_a.repeat_interleave(32 // group, dim=1)  # each group takes the d_a of its Q8_1 block
    terms = (scale.unsqueeze(0) * d_groups.unsqueeze(1)) * isum  # [rows, N, groups]: fp32 products, as both form
    exact, total = terms.double().sum(-1), terms.double().abs().sum(-1)
    if offset is not None:
        offsets = offset.unsqueeze(0) * s_a.unsqueeze(1)  # m_w * s_a in fp32
        exact, total = exact + offsets.double().sum(-1), total + offsets.double().abs().sum(-1)
    if bias is not None:
        exact, total = exact + bias.cpu().double(), total + bias.cpu().double().abs()
    depth = (nb + 31) // 32 + 7
    slack = (depth + 1) * 2.0**-24 * total
    finfo = torch.finfo(expected.dtype)
    distance = (expected.reshape(exact.shape).double() - exact).abs()
    bound = distance + slack + finfo.eps * (exact.abs() + slack + finfo.tiny)
    return bound.reshape(expected.shape)


def assert_w4a8_close(got: torch.Tensor, x, blocks, kind, bias, what=""):
    """The kernel's W4A8 output against the reference on CPU copies, within W4A8 BOUND."""
    expected = ref.linear_w4a8(x.cpu(), blocks.cpu(), kind, None if bias is None else bias.cpu())
    assert got.shape == expected.shape and got.dtype == expected.dtype and got.is_contiguous(), what
    err = (got.cpu().double() - expected.double()).abs()
    bound = w4a8_bound(x, blocks, kind, bias, expected)
    worst = (err - bound).max().item() if err.numel() else -1.0
    assert bool((err <= bound).all()), (
        f"{what}: error exceeds the W4A8 bound by {worst:.3g} (max error {err.max():.3g})"
    )


# ---- the kernel (GPU) ------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,n,k", CASES)
def test_gguf_gemv(kernels, kind, n, k, dtype, rows, quantize_activations):
    bias = (n + rows) % 2 == 0  # every shape with and without a bias (rows 1 and 3 with, 8 without)
    blocks, b = weights(kind, n, k, bias)
    blocks, b = blocks.cuda(), None if b is None else b.cuda()
    x = torch.randn(rows, k, device="cuda").to(dtype)
    if quantize_activations:
        poison_cuda_cache()
        got = kernels.gguf_gemv(x, blocks, kind, b, True)
        assert_w4a8_close(got, x, blocks, kind, b, f"{kind} {dtype} {rows}x{k} -> {n}")
    else:
        check_op("gguf_gemv", (x, blocks, kind, b, False))


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("kind", K_QUANTS)
def test_gguf_gemv_k_quants_every_batch(kernels, kind, quantize_activations, rows):
    """The K-quants at every batch the kernel takes (each of its 1, 2, 4 and 8-row builds partly filled), K of 5
    super-blocks (a full chunk and a quarter one), in bf16, with and without a bias."""
    n, k = 37, 1280
    blocks, b = weights(kind, n, k, True)
    blocks = blocks.cuda()
    x = torch.randn(rows, k, device="cuda").bfloat16()
    for bias in (None, b.cuda()):
        if quantize_activations:
            poison_cuda_cache()
            got = kernels.gguf_gemv(x, blocks, kind, bias, True)
            assert_w4a8_close(got, x, blocks, kind, bias, f"{kind} {rows} rows, bias {bias is not None}")
        else:
            check_op("gguf_gemv", (x, blocks, kind, bias, False))


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_gguf_gemv_strided_and_shaped_inputs(kernels, kind, quantize_activations):
    """x rows with a stride (a slice of wider rows, at an offset that breaks 16-byte alignment), x with leading
    dimensions, and blocks that start mid-allocation at a 2-byte boundary (rows of 54/60/102 bytes; K-quant rows of
    3 super-blocks, whose Q4_K and Q5_K rows of 432 and 528 bytes are moved 2 bytes into a buffer)."""
    k, n = (768 if kind in K_QUANTS else 96), 40
    full, bias = weights(kind, n + 1, k, True)
    blocks, bias = full.cuda()[1:], bias[1:].cuda().half()  # a view one row in; an fp16 bias
    if blocks.data_ptr() % 16 == 0:  # rows of whole 16-byte vectors
        buffer = torch.empty(blocks.numel() + 2, dtype=torch.uint8, device="cuda")
        blocks = buffer[2:].view(blocks.shape).copy_(blocks)
    assert blocks.is_contiguous() and blocks.data_ptr() % 16
    wide = torch.randn(5, k + 40, device="cuda", dtype=torch.float16)
    inputs = {"strided rows": wide[:, 3 : 3 + k], "leading dims": torch.randn(2, 3, k, device="cuda").half()}
    for what, x in inputs.items():
        got = kernels.gguf_gemv(x, blocks, kind, bias, quantize_activations)
        assert got.shape == (*x.shape[:-1], n)
        if quantize_activations:
            assert_w4a8_close(got, x, blocks, kind, bias, what)
        else:
            check_op("gguf_gemv", (x, blocks, kind, bias, False))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_gemv_aligned_kernel_matches_the_general_one(kernels, kind):
    """W4A8 takes the aligned kernel where the blocks start 16-byte aligned (K a multiple of 256; of 1024 for Q6_K)
    and the general one where they do not (the same blocks 2 bytes into a buffer): both give the same output bit for
    bit (the same fp32 terms summed in the same order), within the W4A8 bound of the reference. K of 1280 (a chunk of
    1024 values and a quarter one; Q6_K: 2048, two chunks, its super-blocks 0 and 2 bytes into a word) and of 14336
    (14 chunks), 1 and 5 rows of x; 37 output rows, 38 of K 14336 (Q4_0, Q4_1 and the K-quants take two rows a warp at
    batch 1), and 16388 of K 1280 (four rows a warp for Q4_0, Q4_1, Q4_K and Q5_K; two for Q6_K)."""
    short = 2048 if kind == "Q6_K" else 1280
    for k, n in ((short, 37), (14336, 37), (14336, 38), (short, 16388)):
        blocks, bias = weights(kind, n, k, True)
        aligned, bias = blocks.cuda(), bias.cuda()
        buffer = torch.empty(aligned.numel() + 2, dtype=torch.uint8, device="cuda")
        shifted = buffer[2:].view(aligned.shape).copy_(aligned)
        assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 == 2
        for rows in (1, 5):
            x = torch.randn(rows, k, device="cuda").half()
            got = kernels.gguf_gemv(x, aligned, kind, bias, True)
            assert torch.equal(got, kernels.gguf_gemv(x, shifted, kind, bias, True)), f"{kind} n={n} k={k} rows={rows}"
            assert_w4a8_close(got, x, aligned, kind, bias, f"{kind} n={n} k={k} rows={rows}")


@pytest.mark.gpu
def test_gguf_gemv_quantizes_like_the_reference(kernels):
    """Values on Q8_1 rounding edges: x * (1 / d) = j + 0.5 exactly (max |x| = 127 c, so d = c; c = 1/64), which
    roundf takes away from zero and torch.round would take to even; zeros, an all-zero block (d = 0) and a block
    with one non-zero value. A single q off by one would exceed the bound by about d_a * d_w."""
    k, n = 128, 64
    blocks, _ = weights("Q8_0", n, k, False)
    blocks = blocks.cuda()
    c = 1 / 64
    x = torch.zeros(2, k)
    x[0, 0] = -127 * c
    x[0, 1:32] = (torch.arange(31) - 16 + 0.5) * c
    x[0, 64] = 3.0  # one value in an otherwise zero block; x[0, 32:64] is an all-zero block
    x[1, 32:64] = torch.linspace(-1, 1, 32)
    for dtype in (torch.float32, torch.float16):
        xd = x.to(dtype).cuda()
        assert_w4a8_close(kernels.gguf_gemv(xd, blocks, "Q8_0", None, True), xd, blocks, "Q8_0", None, str(dtype))


CAT_CASES = [  # a projection's modules: (kind, n) each, and K
    ([("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 16)], 512),  # a Q4_K_M q/k/v: two launches, one input
    ([("Q4_0", 40), ("Q4_0", 24)], 96),  # gate/up of one type, rows not a multiple of the block's 8
    ([("Q8_0", 8), ("Q4_1", 33), ("Q5_K", 9)], 256),
    # aligned W4A8 at batch 1: Q4_0 four rows a warp (16388 rows; its modules alone, of fewer than 16384, one)
    ([("Q4_0", 8192), ("Q4_1", 16384), ("Q4_0", 8196)], 256),
    ([("Q4_1", 16384), ("Q4_1", 2)], 256),  # one row a warp (2 rows: not a multiple of 4); the first module alone four
    ([("Q4_0", 36), ("Q4_0", 18), ("Q4_1", 20)], 14336),  # long rows at batch 1: two a warp, over two modules
    ([("Q4_0", 36), ("Q4_0", 17)], 14336),  # one a warp (17 rows: odd)
    ([("Q4_K", 36), ("Q6_K", 18), ("Q4_K", 20)], 14336),  # K-quants over long rows: two a warp, two launches
    ([("Q6_K", 16), ("Q6_K", 17)], 14336),  # one a warp (odd)
    ([("Q4_K", 8192), ("Q5_K", 8192), ("Q4_K", 8194)], 256),  # K-quant launches of 16384+ rows: two a warp
    # a K-quant type and aligned Q6_K (a launch a type), odd rows, long rows, 16384+ rows; three types
    ([("Q4_K", 64), ("Q4_K", 16), ("Q6_K", 17)], 2048),
    ([("Q6_K", 36), ("Q5_K", 18), ("Q6_K", 20)], 14336),  # long rows: two a warp
    ([("Q5_K", 8192), ("Q6_K", 8194)], 1024),  # 16384+ rows: two a warp
    ([("Q4_K", 8), ("Q6_K", 8), ("Q5_K", 8)], 1024),
]


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", range(len(CAT_CASES)))
def test_gguf_gemv_cat(kernels, case, dtype, rows, quantize_activations):
    """One op for a projection's modules gives each module's gguf_gemv bit for bit, side by side (same kernels, the
    input written once), with a bias on every other module and x a strided slice."""
    parts, k = CAT_CASES[case]
    mods = [weights(kind, n, k, i % 2 == 0) for i, (kind, n) in enumerate(parts)]
    blocks = [w.cuda() for w, _ in mods]
    biases = [None if b is None else b.cuda() for _, b in mods]
    kinds = [kind for kind, _ in parts]
    x = torch.randn(rows, k + 8, device="cuda").to(dtype)[:, 8:]
    got = kernels.gguf_gemv_cat(x, blocks, ",".join(kinds), biases, quantize_activations)
    expected = torch.cat(
        [kernels.gguf_gemv(x, w, kind, b, quantize_activations) for w, kind, b in zip(blocks, kinds, biases)], -1
    )
    assert got.shape == (rows, sum(n for _, n in parts)) and torch.equal(got, expected)


def projection(parts: list, k: int) -> tuple[list, list, str]:
    """A case's modules on the GPU: their blocks, biases (one on every other module) and kinds, comma-separated."""
    mods = [weights(kind, n, k, i % 2 == 0) for i, (kind, n) in enumerate(parts)]
    biases = [None if b is None else b.cuda() for _, b in mods]
    return [w.cuda() for w, _ in mods], biases, ",".join(kind for kind, _ in parts)


NORM_CASES = [*CAT_CASES, ([("Q4_0", 40), ("Q4_0", 24)], 512)]  # K of 96: the norm, then gguf_gemv_cat


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("delta", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(NORM_CASES)))
def test_gguf_norm_gemv_cat_is_the_norm_then_the_projection(kernels, case, dtype, rows, delta, quantize_activations):
    """The norm writing the GEMV's input itself (16-bit values, K a multiple of 256) gives what the norm op, then
    gguf_gemv_cat, give, bit for bit (the norm kernel's arithmetic, then the input kernel's quantization), and the
    same residual sum; where it can't (fp32, K of 96, x 8 bytes off 16-byte alignment) the op runs those two. Marked
    as feeding an attention (only the last GEMV launch triggers after its wait) it gives the same, bit for bit."""
    parts, k = NORM_CASES[case]
    blocks, biases, kinds = projection(parts, k)
    gen = torch.Generator().manual_seed(rows * 31 + k)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).cuda()
    for offset in (0, 4):  # x's rows 16-byte aligned, or 8 bytes off (16-bit dtypes)
        x = torch.randn(rows, k + 8, generator=gen).to(dtype).cuda()[:, offset : offset + k]
        d = torch.randn(rows, k, generator=gen).to(dtype).cuda() if delta else None
        out, total = kernels.gguf_norm_gemv_cat(x, d, norm_weight, 1e-5, blocks, kinds, biases, quantize_activations)
        if d is None:
            h, want_total = kernels.rms_norm(x, norm_weight, 1e-5), x.new_empty(0)
        else:
            h, want_total = kernels.add_rms_norm(x, d, norm_weight, 1e-5)
        want = kernels.gguf_gemv_cat(h, blocks, kinds, biases, quantize_activations)
        assert torch.equal(out, want) and torch.equal(total, want_total), f"x offset {offset}"
        feeding = kernels.gguf_norm_gemv_cat(x, d, norm_weight, 1e-5, blocks, kinds, biases, quantize_activations, True)
        assert torch.equal(feeding[0], out) and torch.equal(feeding[1], total), f"feeds_attention, x offset {offset}"


ATTENTION_CASES = {  # q heads, kv heads, head_dim, interleaved; the output projection's modules
    "llama-3.1-8b": (32, 8, 128, False, [("Q4_0", 96)]),
    "qwen2-1.5b": (12, 2, 128, False, [("Q4_K", 40), ("Q6_K", 24)]),  # two launches (an unusual split of o_proj)
    "smollm2": (9, 3, 64, False, [("Q8_0", 33)]),
    "neox-128": (8, 8, 128, True, [("Q4_1", 16)]),
}


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ATTENTION_CASES))
@pytest.mark.parametrize("length", [1, 129, 1000])
@pytest.mark.parametrize("batch,splits", [(1, 1), (1, 16), (3, 7)])
def test_gguf_attention_gemv_cat_is_the_attention_then_the_projection(
    kernels, batch, splits, length, arch, dtype, quantize_activations
):
    """The attention writing the GGUF output projection's input itself (Q8_1 blocks a warp, or fp32) gives what
    decode_attention_qkv, then gguf_gemv_cat, give, bit for bit (the same attention kernel up to its store, then the
    input kernel's quantization of the values rounded to the dtype), and the same caches."""
    from patcher.ops import decode_attention_workspace

    hq, hkv, d, interleaved, parts = ATTENTION_CASES[arch]
    capacity, width = length + 9, (hq + 2 * hkv) * d
    blocks, biases, kinds = projection(parts, hq * d)
    gen = torch.Generator().manual_seed(length * 13 + batch)
    qkv = torch.randn(batch, width, generator=gen).to(dtype).cuda()
    cos, sin = rope_tables((capacity, d // 2), dtype)
    slot = torch.tensor([length - 1], device="cuda")
    pad = torch.tensor([min(r * 3, length - 1) for r in range(batch)], device="cuda")
    caches = [torch.randn(batch, hkv, capacity, d, generator=gen).to(dtype).cuda() for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    workspaces = [decode_attention_workspace(batch, hq, hkv, d, splits, "cuda") for _ in range(2)]
    tail = (hq, interleaved, d**-0.5, splits)
    got = kernels.gguf_attention_gemv_cat(qkv, cos, sin, slot, pad, *caches, *tail, workspaces[0], blocks, kinds,
                                          biases, quantize_activations)  # fmt: skip
    attended = kernels.decode_attention_qkv(qkv, cos, sin, slot, pad, *expected_caches, *tail, workspaces[1])
    want = kernels.gguf_gemv_cat(attended, blocks, kinds, biases, quantize_activations)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    assert got.shape == want.shape and torch.equal(got, want)
    assert int(workspaces[0][: batch * hq].abs().sum()) == 0, "split counters must be left at zero"


def test_gguf_attention_gemv_cat_op_schema():
    """The reference is decode_attention_qkv, then gguf_gemv_cat; schema and fake kernel pass opcheck."""
    hq, hkv, d = 4, 2, 32
    blocks, bias = weights("Q4_0", 24, hq * d, True)
    qkv = torch.randn(2, (hq + 2 * hkv) * d)
    angles = torch.randn(16, d // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    caches = [torch.randn(2, hkv, 16, d) for _ in range(2)]
    before = [c.clone() for c in caches]
    slot, pad = torch.tensor([5]), torch.tensor([0, 2])
    tail = (hq, False, d**-0.5, 1, None, [blocks], "Q4_0", [bias], True)
    torch.library.opcheck(torch.ops.patcher.gguf_attention_gemv_cat.default,
                          (qkv, cos, sin, slot, pad, *[c.clone() for c in caches], *tail))  # fmt: skip
    got = KERNELS.gguf_attention_gemv_cat(qkv, cos, sin, slot, pad, *caches, *tail)
    attended = REFERENCE.decode_attention_qkv(qkv, cos, sin, slot, pad, *before, *tail[:5])
    assert torch.equal(caches[0], before[0]) and torch.equal(caches[1], before[1])
    assert torch.equal(got, ref.linear_w4a8(attended, blocks, "Q4_0", bias))


def test_gguf_norm_gemv_cat_op_schema():
    """The reference is rms_norm (after the residual add), then gguf_gemv_cat; schema and fake kernel pass opcheck."""
    blocks, bias = weights("Q4_0", 24, 256, True)
    x, d = torch.randn(2, 256), torch.randn(2, 256)
    w = 1 + 0.1 * torch.randn(256)
    for delta in (d, None):
        args = (x, delta, w, 1e-5, [blocks], "Q4_0", [bias], True)
        torch.library.opcheck(torch.ops.patcher.gguf_norm_gemv_cat.default, args)
        torch.library.opcheck(torch.ops.patcher.gguf_norm_gemv_cat.default, (*args, True))  # feeds_attention
        out, total = KERNELS.gguf_norm_gemv_cat(*args)
        h = REFERENCE.rms_norm(x, w, 1e-5) if delta is None else REFERENCE.add_rms_norm(x, d, w, 1e-5)[0]
        assert torch.equal(out, ref.linear_w4a8(h, blocks, "Q4_0", bias))
        assert torch.equal(total, x.new_empty(0) if delta is None else x + d)


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(NORM_CASES)))
def test_gguf_silu_mul_gemv_cat_is_the_activation_then_the_projection(kernels, case, dtype, rows, quantize_activations):
    """The input kernel computing silu(gate) * up gives what silu_and_mul, then gguf_gemv_cat, give, bit for bit;
    gate_up [rows, 2K] with 16-byte aligned rows, or a slice whose rows are not (one value off)."""
    parts, k = NORM_CASES[case]
    blocks, biases, kinds = projection(parts, k)
    gen = torch.Generator().manual_seed(rows * 37 + k)
    for offset in (0, 1):
        gate_up = (2 * torch.randn(rows, 2 * k + 8, generator=gen)).to(dtype).cuda()[:, offset : offset + 2 * k]
        got = kernels.gguf_silu_mul_gemv_cat(gate_up, blocks, kinds, biases, quantize_activations)
        want = kernels.gguf_gemv_cat(kernels.silu_and_mul(gate_up), blocks, kinds, biases, quantize_activations)
        assert torch.equal(got, want), f"gate_up offset {offset}"


def test_gguf_silu_mul_gemv_cat_op_schema():
    """The reference is silu_and_mul, then gguf_gemv_cat; schema and fake kernel pass opcheck."""
    blocks, bias = weights("Q4_K", 24, 256, True)
    gate_up = torch.randn(2, 512)
    args = (gate_up, [blocks], "Q4_K", [bias], True)
    torch.library.opcheck(torch.ops.patcher.gguf_silu_mul_gemv_cat.default, args)
    h = REFERENCE.silu_and_mul(gate_up)
    assert torch.equal(KERNELS.gguf_silu_mul_gemv_cat(*args), ref.linear_w4a8(h, blocks, "Q4_K", bias))


@pytest.mark.gpu
def test_gguf_gemv_cat_bad_inputs(kernels):
    w = weights("Q4_0", 8, 64, False)[0].cuda()
    x = torch.randn(1, 64, device="cuda").half()
    assert kernels.gguf_gemv_cat(x[:0], [w, w], "Q4_0,Q4_0", [None, None], True).shape == (0, 16)  # no rows
    with pytest.raises(RuntimeError, match="a kind .comma-separated. and a bias"):
        kernels.gguf_gemv_cat(x, [w, w], "Q4_0", [None, None], True)
    with pytest.raises(RuntimeError, match="1 to 3 weights"):
        kernels.gguf_gemv_cat(x, [w] * 4, "Q4_0,Q4_0,Q4_0,Q4_0", [None] * 4, True)
    with pytest.raises(RuntimeError, match="takes Q4_0"):
        kernels.gguf_gemv_cat(x, [w, w], "Q4_0,Q2_K", [None, None], True)


@pytest.mark.gpu
def test_gguf_gemv_bad_inputs(kernels):
    blocks, bias = (t.cuda() for t in weights("Q4_0", 33, 96, True))
    x = torch.randn(2, 96, device="cuda").half()
    torch.library.opcheck(torch.ops.patcher.gguf_gemv.default, (x, blocks, "Q4_0", bias, True))
    with pytest.raises(RuntimeError, match="Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K"):
        kernels.gguf_gemv(x, blocks, "Q2_K", None, True)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernels.gguf_gemv(torch.randn(9, 96, device="cuda").half(), blocks, "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gguf_gemv(torch.randn(2, 100, device="cuda").half(), blocks, "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="in_features"):
        kernels.gguf_gemv(torch.randn(2, 64, device="cuda").half(), blocks, "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="unsupported dtype"):
        kernels.gguf_gemv(x.double(), blocks, "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.gguf_gemv(x, blocks.view(torch.int8), "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.gguf_gemv(x, torch.cat([blocks, blocks], dim=1)[:, :54], "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="whole"):
        kernels.gguf_gemv(x, blocks[:, :50].contiguous(), "Q4_0", None, True)
    with pytest.raises(RuntimeError, match="bias"):
        kernels.gguf_gemv(x, blocks, "Q4_0", bias[:5], True)
    with pytest.raises(RuntimeError, match="blocks must be on"):
        kernels.gguf_gemv(x, blocks.cpu(), "Q4_0", None, True)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", K_QUANTS)
def test_gguf_gemv_k_quant_bad_inputs(kernels, kind):
    """K-quant rows are whole super-blocks: in_features a multiple of 256 (a multiple of 32 is not enough), rows of
    whole 144/176/210-byte blocks."""
    blocks, _ = weights(kind, 9, 512, False)
    blocks = blocks.cuda()
    x = torch.randn(2, 512, device="cuda").half()
    torch.library.opcheck(torch.ops.patcher.gguf_gemv.default, (x, blocks, kind, None, True))
    for bad in (288, 100):
        with pytest.raises(RuntimeError, match="multiple of 256"):
            kernels.gguf_gemv(torch.randn(2, bad, device="cuda").half(), blocks, kind, None, True)
    with pytest.raises(RuntimeError, match="in_features"):
        kernels.gguf_gemv(torch.randn(2, 256, device="cuda").half(), blocks, kind, None, False)
    with pytest.raises(RuntimeError, match="whole"):
        kernels.gguf_gemv(x, blocks[:, :-32].contiguous(), kind, None, True)
    with pytest.raises(RuntimeError, match="uint8"):
        kernels.gguf_gemv(x, blocks.view(torch.int16), kind, None, True)


MODEL_KINDS = {
    "32-value blocks": {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_1", "gate_proj": "Q4_0"}
    | {"up_proj": "Q8_0", "down_proj": "Q4_0"},
    # down_proj takes the MLP's 384 inputs, not whole super-blocks: Q8_0 there
    "K-quants": {"q_proj": "Q4_K", "k_proj": "Q6_K", "v_proj": "Q5_K", "o_proj": "Q6_K", "gate_proj": "Q4_K"}
    | {"up_proj": "Q6_K", "down_proj": "Q8_0"},
}


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("types", MODEL_KINDS)
def test_gguf_model_on_cuda_matches_the_cpu(kernels, types, quantize_activations):
    """tiny-llama (hidden 256, MLP 384) with random GGUF blocks (Q4_0/Q4_1/Q8_0, or the K-quants where the input
    width is whole super-blocks), fp32: 6 tokens (6 rows, the kernel's path) on CUDA against the same model on the
    CPU (the reference). Every GGUF linear's output, given the input
    it got on CUDA, is within the op's tolerance (W4A8 BOUND; W4A16 the 2x rule). W4A16 logits agree to 1e-3 of
    their size: other modules (attention, norms) round differently on the two devices. In W4A8 that rounding noise
    also moves an activation lying on a Q8_1 rounding edge (a q, or a block's fp16 scale) by a whole step, and later
    layers carry the step to the logits: on the CPU alone, a 1e-6 relative change of the embeddings moves the
    K-quant model's logits by 0.036 (6e-3 of their size), 0.27 of what quantizing the activations changes there (0.13).
    So W4A8 logits agree to half of that change: the devices differ by rounding steps, the modes by quantization."""
    cpu = quantize_random(rm.build("tiny-llama"), MODEL_KINDS[types], quantize_activations=quantize_activations)
    gpu = copy.deepcopy(cpu).cuda()
    tokens = torch.randint(0, cpu.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    seen = []
    hooks = [
        m.register_forward_hook(lambda m, args, out: seen.append((m, args[0], out)))
        for m in gpu.modules()
        if isinstance(m, GGUFLinear)
    ]
    with torch.no_grad():
        got = gpu(tokens.cuda()).logits.cpu()
        expected = cpu(tokens).logits
    for hook in hooks:
        hook.remove()
    assert len(seen) == 7 * cpu.config.num_hidden_layers
    for m, x, out in seen:
        if quantize_activations:
            assert_w4a8_close(out, x, m.qweight, m.kind, m.bias, f"{m.kind} {tuple(m.qweight.shape)}")
        else:
            check_op("gguf_gemv", (x, m.qweight, m.kind, m.bias, False))
    if quantize_activations:
        for m in cpu.modules():
            if isinstance(m, GGUFLinear):
                m.quantize_activations = False
        with torch.no_grad():
            w4a16 = cpu(tokens).logits
        assert max_err(got, expected) <= 0.5 * max_err(w4a16, expected)
    else:
        assert max_err(got, expected) <= 1e-3 * expected.abs().max().item()


# ---- the reference and the schema (CPU) ----------------------------------------------------------------------


@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_gguf_gemv_reference_and_schema(kind, quantize_activations):
    """On the CPU the op is the reference matmul bit for bit (for every type, the K-quants too), with fresh
    outputs; opcheck tests its schema and fake kernel."""
    k, n = 512, 24
    blocks, bias = weights(kind, n, k, True)
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(2))
    linear = ref.linear_w4a8 if quantize_activations else ref.linear_w4a16
    for b in (None, bias):
        expected = linear(x, blocks, kind, b)
        got = KERNELS.gguf_gemv(x, blocks, kind, b, quantize_activations)
        assert torch.equal(got, expected) and got.is_contiguous()
        assert torch.equal(REFERENCE.gguf_gemv(x, blocks, kind, b, quantize_activations), expected)
    torch.library.opcheck(torch.ops.patcher.gguf_gemv.default, (x, blocks, kind, bias, quantize_activations))
    torch.library.opcheck(torch.ops.patcher.gguf_gemv.default, (x[:1].half(), blocks, kind, None, True))


@pytest.mark.parametrize("quantize_activations", [True, False])
def test_gguf_gemv_cat_reference_and_schema(quantize_activations):
    """On the CPU gguf_gemv_cat is each module's gguf_gemv, concatenated; it refuses kinds and biases that do not
    pair with the weights; opcheck tests its schema and fake kernel."""
    k = 256
    mods = [weights(kind, n, k, bias) for kind, n, bias in (("Q4_K", 16, True), ("Q6_K", 8, False))]
    blocks, biases = [w for w, _ in mods], [b for _, b in mods]
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(4))
    got = KERNELS.gguf_gemv_cat(x, blocks, "Q4_K,Q6_K", biases, quantize_activations)
    expected = torch.cat(
        [
            KERNELS.gguf_gemv(x, w, kind, b, quantize_activations)
            for w, kind, b in zip(blocks, ("Q4_K", "Q6_K"), biases)
        ],
        -1,
    )
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="a kind and a bias"):
        REFERENCE.gguf_gemv_cat(x, blocks, "Q4_K", biases, quantize_activations)
    torch.library.opcheck(
        torch.ops.patcher.gguf_gemv_cat.default, (x, blocks, "Q4_K,Q6_K", biases, quantize_activations)
    )
