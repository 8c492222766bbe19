"""The GGUF prefill ops (more than 8 rows: kernels/gguf/gguf_dequant.cuh) against their references: gguf_dequantize
and gguf_dequantize_cat, round_q8_1 (with silu_mul), rms_norm_q8_1, GGUFLinear's GEMM path and a GGUFProjection's one
GEMM; on the CPU the references and the schemas. Bit for bit where the op and its reference round the same values
the same way; the decode GEMV's bounds are in test_gguf_kernels.py."""

from __future__ import annotations

import pytest
import torch
from conftest import DTYPES, max_err, poison_cuda_cache
from test_gguf_kernels import weights

from patcher.gguf import GGUFLinear
from patcher.gguf import reference as ref
from patcher.ops import REFERENCE
from patcher.ops.gguf import GEMV_KINDS

# ---- the kernels (GPU) -----------------------------------------------------------------------------------------

# The prefill path's shapes (N, K): one block row, odd N, K-quant rows of 3 super-blocks (Q6_K's 630 bytes are
# misaligned for 16-byte loads), and Llama-3.1-8B's down_proj width.
DEQUANT_SHAPES = [(1, 256), (33, 768), (257, 2048), (96, 14336)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_gguf_dequantize(kernels, kind, dtype):
    """The weights dequantized to each dtype equal the reference (format.dequantize, bit-identical to gguf.quants,
    rounded once) bit for bit, also from blocks that start 2 bytes into a buffer."""
    for n, k in DEQUANT_SHAPES:
        blocks = weights(kind, n, k, False)[0].cuda()
        expected = REFERENCE.gguf_dequantize(blocks, kind, dtype)
        poison_cuda_cache()
        got = kernels.gguf_dequantize(blocks, kind, dtype)
        assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, expected), f"{kind} {n}x{k}"
    buffer = torch.empty(blocks.numel() + 2, dtype=torch.uint8, device="cuda")
    moved = buffer[2:].view(blocks.shape).copy_(blocks)
    assert torch.equal(kernels.gguf_dequantize(moved, kind, dtype), expected)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gguf_dequantize_cat(kernels, dtype):
    """Weights of different types and row counts, one K, dequantized side by side into one tensor equal each one's
    gguf_dequantize concatenated along the rows, bit for bit (a Q4_K_M file's q, k and v; odd row counts); weights
    that differ in K or lack a kind are refused."""
    k = 2048
    parts = [("Q4_K", 65), ("Q4_K", 33), ("Q6_K", 33), ("Q4_0", 1), ("Q8_0", 7)]
    blocks = [weights(kind, n, k, False)[0].cuda() for kind, n in parts]
    kinds = ",".join(kind for kind, _ in parts)
    expected = torch.cat([kernels.gguf_dequantize(b, kind, dtype) for b, (kind, _) in zip(blocks, parts)])
    poison_cuda_cache()
    got = kernels.gguf_dequantize_cat(blocks, kinds, dtype)
    assert got.dtype == dtype and got.is_contiguous() and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="share K"):
        kernels.gguf_dequantize_cat([blocks[0], weights("Q4_K", 8, 256, False)[0].cuda()], "Q4_K,Q4_K", dtype)
    with pytest.raises(RuntimeError, match="a kind"):
        kernels.gguf_dequantize_cat(blocks[:2], "Q4_K", dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_q8_1(kernels, dtype):
    """Activations rounded through Q8_1 equal the reference (reference.quantize_q8_1's q * d, rounded to the dtype)
    bit for bit: rows of one block and of 448, leading dimensions, strided rows (16-byte aligned or not), a block of
    zeros, and values on rounding edges (halves of d, which roundf takes away from zero); with silu_mul, the rows of
    a multiple of 64 as [gate | up] give the activation kernel's values rounded, bit for bit."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(7, 14336 + 40, generator=gen).to(dtype).cuda()
    edges = torch.arange(-64, 64, dtype=torch.float32).repeat(2) / 2 * (127 / 63.5)  # k + 0.5 steps of d = 1
    edges[:32] = 0
    inputs = {
        "one block": torch.randn(3, 32, generator=gen),
        "leading dims": torch.randn(2, 9, 4096, generator=gen),
        "strided rows": wide[:, 8 : 8 + 14336],  # 16-byte aligned: the vector loads
        "misaligned rows": wide[:, 3 : 3 + 14336],  # one value at a time
        "zeros and edges": edges.reshape(2, 128),
    }
    for what, x in inputs.items():
        x = x.to(dtype).cuda()
        expected = REFERENCE.round_q8_1(x)
        poison_cuda_cache()
        got = kernels.round_q8_1(x)
        assert got.shape == x.shape and got.is_contiguous() and torch.equal(got, expected), what
        if x.shape[-1] % 64:
            continue
        # x as a gated MLP's [gate | up]: silu_and_mul's values, rounded: the activation kernel, then the rounding
        expected = kernels.round_q8_1(kernels.silu_and_mul(x))
        assert torch.equal(expected, REFERENCE.round_q8_1(x, True)), f"{what}, silu_mul: the reference"
        poison_cuda_cache()
        got = kernels.round_q8_1(x, True)
        assert got.shape == expected.shape and got.is_contiguous() and torch.equal(got, expected), f"{what}, silu_mul"


@pytest.mark.gpu
@pytest.mark.parametrize("delta", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_q8_1(kernels, dtype, delta):
    """The norm rounding its output through Q8_1 gives rms_norm (or add_rms_norm) then round_q8_1, bit for bit, and
    the same residual sum: in the norm kernel itself for 16-bit rows of a multiple of 256 values, 16-byte aligned
    (held in registers up to 8192 values, re-read beyond), and through the two ops otherwise (fp32, 4096 + 32
    values, rows 8 bytes off alignment); within one step of each block's scale of the reference."""
    gen = torch.Generator().manual_seed(9)
    for rows, hidden, offset in ((7, 4096, 0), (3, 8448, 0), (2048, 2048, 0), (5, 4128, 0), (4, 4096, 4)):
        buffer = torch.randn(rows * hidden + offset, generator=gen).to(dtype).cuda()
        x = buffer[offset:].view(rows, hidden)
        d = torch.randn(rows, hidden, generator=gen).to(dtype).cuda() if delta else None
        w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).cuda()
        if delta:
            h, want_sum = kernels.add_rms_norm(x, d, w, 1e-5)
        else:
            h, want_sum = kernels.rms_norm(x, w, 1e-5), x.new_empty(0)
        expected = kernels.round_q8_1(h)
        poison_cuda_cache()
        got, total = kernels.rms_norm_q8_1(x, d, w, 1e-5)
        where = f"{rows}x{hidden} offset {offset}"
        assert torch.equal(got, expected) and torch.equal(total, want_sum), where
        # The reference normalizes with torch's reduction order, a last bit away from the kernel's at times, which
        # the rounding turns into at most one step of the block's scale (max|x| / 127), plus the dtype's rounding.
        want = REFERENCE.rms_norm_q8_1(x, d, w, 1e-5)[0].float().view(rows, -1, 32)
        amax = want.abs().amax(-1, keepdim=True)
        bound = amax / 127 + 2 * torch.finfo(dtype).eps * amax
        assert ((got.float().view(rows, -1, 32) - want).abs() <= bound).all(), f"{where}: the reference"


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K", "Q6_K"])
def test_gguf_linear_prefill_on_cuda(kernels, kind, dtype, quantize_activations):
    """More than 8 rows on CUDA: GGUFLinear's output is F.linear of the reference's rounded activations and weights
    (bit for bit on the same device: the same cuBLAS call), and in fp32 within 1e-5 of the size of its terms of
    the reference product (the W4A8 one of reference.linear_w4a8, or W4A16): only the summation order differs."""
    n, k = 72, 1280
    blocks, bias = weights(kind, n, k, True)
    layer = GGUFLinear.from_blocks(blocks.cuda(), kind, bias.cuda(), quantize_activations)
    x = torch.randn(2, 17, k, generator=torch.Generator().manual_seed(6)).to(dtype).cuda()
    with torch.no_grad():
        got = layer(x)
    rounded = REFERENCE.round_q8_1(x) if quantize_activations else x
    weight = REFERENCE.gguf_dequantize(layer.qweight, kind, dtype)
    assert torch.equal(got, torch.nn.functional.linear(rounded, weight, layer.bias.to(dtype)))
    if dtype == torch.float32:
        linear = ref.linear_w4a8 if quantize_activations else ref.linear_w4a16
        expected = linear(x.cpu(), blocks, kind, bias)
        size = (rounded.abs().cpu() @ weight.abs().cpu().T).max().item()
        assert max_err(got.cpu(), expected) <= 1e-5 * size


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_gguf_projection_rounds_its_input_once(device, monkeypatch):
    """A GGUFProjection's modules (q/k/v of three types) share their prefill input: W4A8 rounds it through Q8_1 once
    and one GEMM takes their weights dequantized side by side (gguf_dequantize_cat) with their biases (zeros where a
    module has none), bit for bit, within fp32 rounding of the modules run one by one; a caller's hook on one module
    makes each run its own forward again, so the hook sees its call. A decode step's rows run one gguf_gemv_cat for
    the three."""
    from patcher.layers.weights import GGUFProjection
    from patcher.ops import backend_for

    backend = backend_for(torch.device(device))
    k = 512
    layers = [
        GGUFLinear.from_blocks(weights(kind, n, k, False)[0].to(device), kind)
        for kind, n in (("Q4_K", 64), ("Q6_K", 32))
    ]
    layers.append(
        GGUFLinear.from_blocks(weights("Q4_0", 32, k, True)[0].to(device), "Q4_0", torch.ones(32, device=device))
    )
    projection = GGUFProjection(layers)
    x = torch.randn(20, k, generator=torch.Generator().manual_seed(8)).to(device)
    calls = []
    op = backend.round_q8_1
    monkeypatch.setattr(backend, "round_q8_1", lambda t: calls.append(t) or op(t))
    with torch.no_grad():
        apart = torch.cat([m(x) for m in layers], -1)
        assert len(calls) == 3
        calls.clear()
        got = projection(x)
        assert len(calls) == 1
        weight = torch.cat([backend.gguf_dequantize(m.qweight, m.kind, x.dtype) for m in layers])
        bias = torch.cat([torch.zeros(96, device=device), layers[2].bias])
        rounded = op(x)  # (the unpatched op: not counted)
        assert torch.equal(got, torch.nn.functional.linear(rounded, weight, bias))
        assert max_err(got, apart) <= 1e-5 * (rounded.abs() @ weight.abs().T).max().item()
        calls.clear()
        seen = []
        handle = layers[1].register_forward_hook(lambda m, args, out: seen.append(out))
        assert torch.equal(projection(x), apart) and len(calls) == 3 and len(seen) == 1
        handle.remove()
    # A decode step's rows: one gguf_gemv_cat for the three, each module's gguf_gemv bit for bit.
    cats = []
    cat = backend.gguf_gemv_cat
    monkeypatch.setattr(backend, "gguf_gemv_cat", lambda *args: cats.append(args) or cat(*args))
    with torch.no_grad():
        step = x[:2]
        assert torch.equal(projection(step), torch.cat([m(step) for m in layers], -1)) and len(cats) == 1


# ---- the references and the schemas (CPU) ----------------------------------------------------------------


@pytest.mark.parametrize("kind", GEMV_KINDS)
def test_prefill_ops_reference_and_schema(kind):
    """The prefill ops' references: gguf_dequantize is format.dequantize rounded to the dtype (gguf_dequantize_cat
    several of them along the rows), round_q8_1 the q * d of quantize_q8_1 (|x - q * d| <= d / 2 plus |q| <= 127
    times d's fp16 rounding, d / 2048); opcheck tests the schemas and fake kernels."""
    blocks = weights(kind, 24, 512, False)[0]
    for dtype in DTYPES:
        got = REFERENCE.gguf_dequantize(blocks, kind, dtype)
        assert got.dtype == dtype and torch.equal(got, GGUFLinear.from_blocks(blocks, kind).dequantize().to(dtype))
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(7))
    rounded = REFERENCE.round_q8_1(x)
    q, d, _ = ref.quantize_q8_1(x)
    assert torch.equal(rounded.reshape(3, 16, 32), q.float() * d.unsqueeze(-1))
    assert bool(((rounded - x).abs().reshape(3, 16, 32) <= d.unsqueeze(-1) * (0.5 + 127 / 2048)).all())
    torch.library.opcheck(torch.ops.patcher.gguf_dequantize.default, (blocks, kind, torch.float16))
    pair = [blocks, weights("Q8_0", 8, 512, False)[0]]
    both = REFERENCE.gguf_dequantize_cat(pair, f"{kind},Q8_0", torch.float16)
    assert torch.equal(both, torch.cat([REFERENCE.gguf_dequantize(pair[0], kind, torch.float16),
                                        REFERENCE.gguf_dequantize(pair[1], "Q8_0", torch.float16)]))  # fmt: skip
    torch.library.opcheck(torch.ops.patcher.gguf_dequantize_cat.default, (pair, f"{kind},Q8_0", torch.float16))
    torch.library.opcheck(torch.ops.patcher.round_q8_1.default, (x.bfloat16(),))
    w, d = torch.rand(512) + 0.5, torch.randn(3, 512)
    norm, _ = REFERENCE.rms_norm_q8_1(x, None, w, 1e-5)
    assert torch.equal(norm, REFERENCE.round_q8_1(REFERENCE.rms_norm(x, w, 1e-5)))
    added, total = REFERENCE.rms_norm_q8_1(x, d, w, 1e-5)
    h, s = REFERENCE.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(added, REFERENCE.round_q8_1(h)) and torch.equal(total, s)
    for delta in (None, d.bfloat16()):
        torch.library.opcheck(torch.ops.patcher.rms_norm_q8_1.default, (x.bfloat16(), delta, w.bfloat16(), 1e-5))
    gate_up = torch.randn(3, 1024, generator=torch.Generator().manual_seed(8))
    activated = REFERENCE.round_q8_1(gate_up, True)
    assert torch.equal(activated, REFERENCE.round_q8_1(REFERENCE.silu_and_mul(gate_up)))
    torch.library.opcheck(torch.ops.patcher.round_q8_1.default, (gate_up.bfloat16(), True))


@pytest.mark.parametrize("rows", [1, 8, 9])
@pytest.mark.parametrize("quantize_activations", [True, False])
def test_gguf_linear_takes_the_op_for_decode_rows(monkeypatch, rows, quantize_activations):
    """GGUFLinear calls its backend's gguf_gemv for 1 to 8 rows of a kernel type (on the CPU: the reference, so its
    outputs are the reference's) and the GEMM path for more rows: F.linear of the rounded activations (W4A8) and the
    dequantized weight, bit for bit, within 1e-5 of its terms' size of the block-wise reference; the K-quants too.
    Under autograd neither op runs: the reference does."""
    calls = []
    op = REFERENCE.gguf_gemv
    monkeypatch.setattr(REFERENCE, "gguf_gemv", lambda *args: calls.append(args) or op(*args))
    linear = ref.linear_w4a8 if quantize_activations else ref.linear_w4a16
    for kind, n, k, bias in (("Q4_1", 40, 64, True), ("Q6_K", 8, 512, False)):
        blocks, b = weights(kind, n, k, bias)
        layer = GGUFLinear.from_blocks(blocks, kind, b, quantize_activations)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(3))
        expected = linear(x, blocks, kind, b)
        with torch.no_grad():
            got = layer(x)
        if rows <= 8:
            assert torch.equal(got, expected) and len(calls) == 1
        else:
            rounded = REFERENCE.round_q8_1(x) if quantize_activations else x
            weight = REFERENCE.gguf_dequantize(blocks, kind, x.dtype)
            assert torch.equal(got, torch.nn.functional.linear(rounded, weight, b)) and not calls
            assert max_err(got, expected) <= 1e-5 * (rounded.abs() @ weight.abs().T).max().item()
        calls.clear()
        assert torch.equal(layer(x.clone().requires_grad_()), expected) and not calls
