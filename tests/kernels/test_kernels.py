"""CUDA kernels against their pure-torch references (GPU only).

Every kernel output must be within 2x of PyTorch's own error against a float64 reference (conftest.py), over
fp16/bf16/fp32, odd shapes, and strided or misaligned inputs (which take the kernels' scalar path).
Residual sums and RoPE mirror torch's rounding step by step, so those must match PyTorch bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DTYPES,
    NORM_OPS,
    PROLOGUES,
    QKV_HEADS,
    assert_within_torch_error,
    check_op,
    max_err,
    norm_args,
    prologue_args,
    rope_tables,
)

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels")]

# tokens x hidden: covers tokens {1, 7, 83, 4096} and hidden {80, 640 (80k), 769, 2560, 5125, 8200}; the kernel keeps
# a row in registers up to 1024 vectors (8192 values in 16 bits, 4096 in fp32, 1024 at one value a vector: 769) and
# re-reads wider ones (8200; 5125, one value a vector)
NORM_SHAPES = [(1, 80), (7, 769), (83, 2560), (4096, 5125), (1, 5125), (83, 640), (4096, 2560), (7, 80), (3, 8200)]
LAYOUTS = ["contiguous", "row-strided", "misaligned"]


def make(shape, dtype, layout="contiguous", scale=1.0):
    """A CUDA tensor of `shape` with the given memory layout (the kernels must read all of them)."""
    rows, cols = int(torch.tensor(shape[:-1]).prod()), shape[-1]
    if layout == "contiguous":
        return (torch.randn(shape, device="cuda") * scale).to(dtype)
    if layout == "row-strided":  # each row is the start of a longer row
        return (torch.randn(*shape[:-1], cols + 24, device="cuda") * scale).to(dtype)[..., :cols]
    if layout == "misaligned":  # contiguous, but starting one element past a 16-byte boundary
        flat = (torch.randn(rows * cols + 1, device="cuda") * scale).to(dtype)
        return flat[1:].view(shape)
    raise ValueError(layout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "op", ["rms_norm", "add_rms_norm", "layer_norm", "dual_layer_norm", "add_layer_norm", "add_dual_layer_norm"]
)
def test_norms(op, layout, shape, dtype):
    hidden = shape[-1]
    x, d, d2 = (make(shape, dtype, layout) for _ in range(3))
    w, b, w2, b2 = (make((hidden,), dtype, scale=0.5) + 1 for _ in range(4))
    args = norm_args(op, x, d, d2, w, b, w2, b2)
    sum_index = {"add_rms_norm": 1, "add_layer_norm": 1, "add_dual_layer_norm": 2}.get(op)
    check_op(op, args, exact_outputs=() if sum_index is None else (sum_index,))


@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_variants_on_3d_input_and_single_delta(dtype):
    x, d = make((2, 9, 2560), dtype), make((2, 9, 2560), dtype)
    w, b = make((2560,), dtype) + 1, None
    check_op("add_layer_norm", (x, d, None, w, b, 1e-5), exact_outputs=(1,))
    check_op("add_rms_norm", (x, d, w, 1e-5), exact_outputs=(1,))


ROPE_ARCHS = {  # heads, kv heads, head_dim, rotary dim, interleaved
    "pythia-2.8b": (32, 32, 80, 20, True),
    "llama-3.1-8b": (32, 8, 128, 128, False),
    "qwen2-1.5b": (12, 2, 128, 128, False),
    "smollm2": (9, 3, 64, 64, False),
    "head-36": (4, 2, 36, 12, False),  # head_dim not a multiple of a 16-byte vector: the scalar kernel
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch_tokens", [(1, 1), (2, 7), (1, 83), (1, 4096), (3, 1)])
@pytest.mark.parametrize("arch", list(ROPE_ARCHS))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rope_qkv(layout, arch, batch_tokens, dtype):
    hq, hkv, d, rot, interleaved = ROPE_ARCHS[arch]
    B, T = batch_tokens
    qkv = make((B, T, (hq + 2 * hkv) * d), dtype, layout)
    cos, sin = rope_tables((max(1, B), T, rot // 2), dtype)
    check_op("rope_qkv", (qkv, cos, sin, hq, hkv, d, interleaved), exact_outputs=(0, 1, 2))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 83, 4096])
@pytest.mark.parametrize("inter", [769, 2560, 5125, 14336])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_silu_and_mul(layout, inter, tokens, dtype):
    if tokens * inter > 4096 * 5125 and dtype == torch.float32 and layout != "contiguous":
        pytest.skip("large fp32 strided case adds nothing")
    check_op("silu_and_mul", (make((tokens, 2 * inter), dtype, layout, scale=3),))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 83, 4096])
@pytest.mark.parametrize("cols", [769, 2560, 10240])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("tanh", [False, True])
def test_bias_gelu(tanh, layout, cols, tokens, dtype):
    x = make((tokens, cols), dtype, layout, scale=3)
    check_op("bias_gelu", (x, make((cols,), dtype), tanh))
    if tokens == 7:
        check_op("bias_gelu", (x, None, tanh))


def test_opcheck_on_cuda():
    f16 = torch.float16
    x, d, w, b = make((5, 256), f16), make((5, 256), f16), make((256,), f16), make((256,), f16)
    qkv = make((2, 3, 12 * 64), f16)
    cs = make((1, 3, 32), f16)
    samples = {op: norm_args(op, x, d, None, w, b, w, None) for op in NORM_OPS}  # the optional second delta and bias
    samples |= {
        "rope_qkv": (qkv, cs, cs, 6, 3, 64, False),
        "silu_and_mul": (make((5, 512), f16),),
        "bias_gelu": (x, b, True),
        "gemv": (make((2, 256), f16), make((96, 256), f16), None, "silu_mul"),
        "norm_gemv": (x, d, None, w, None, None, None, 1e-6, True, make((96, 256), f16), None, "silu_mul"),
        "norm_gemv_rope_cache": (
            make((2, 256), f16),
            *(make((2, 256), f16), None, w, b, w, b, 1e-5, False),
            make((8 * 64, 256), f16),
            None,
            make((16, 32), f16),
            make((16, 32), f16),
            torch.tensor([3], device="cuda"),
            torch.zeros(2, dtype=torch.long, device="cuda"),
            make((2, 2, 16, 64), f16),
            make((2, 2, 16, 64), f16),
            4,
            2,
            64,
            False,
        ),
    }
    for op, args in samples.items():
        torch.library.opcheck(getattr(torch.ops.patcher, op).default, args)


BAD_INPUTS = {  # name -> (op, args builder, message the error must contain)
    "weight dtype": ("rms_norm", lambda x, w: (x, w.float(), 1e-6), "dtype"),
    "weight shape": ("rms_norm", lambda x, w: (x, make((32,), torch.float16), 1e-6), "shape"),
    "delta on cpu": ("add_rms_norm", lambda x, w: (x, x.cpu(), w, 1e-6), "CUDA tensor"),
    "strided last dim": ("rms_norm", lambda x, w: (make((64, 4), torch.float16).t(), w, 1e-6), "contiguous"),
    "float64": ("rms_norm", lambda x, w: (x.double(), w.double(), 1e-6), "unsupported dtype"),
    "qkv width": (
        "rope_qkv",
        lambda x, w: (
            make((1, 2, 100), torch.float16),
            make((1, 2, 8), torch.float16),
            make((1, 2, 8), torch.float16),
            2,
            2,
            16,
            False,
        ),
        "width",
    ),
    "odd silu width": ("silu_and_mul", lambda x, w: (make((3, 63), torch.float16),), "even"),
    "gemv rows": (
        "gemv",
        lambda x, w: (make((9, 64), torch.float16), make((32, 64), torch.float16), None, "none"),
        "at most 8",
    ),
    "gemv activation": ("gemv", lambda x, w: (x, make((32, 64), torch.float16), None, "relu"), "activation"),
    "norm_gemv_rope_cache width": (
        "norm_gemv_rope_cache",
        lambda x, w: (
            make((1, 64), torch.float16),
            *(None,) * 6,
            1e-6,
            True,
            make((100, 64), torch.float16),
            None,
            make((8, 16), torch.float16),
            make((8, 16), torch.float16),
            torch.tensor([1], device="cuda"),
            torch.zeros(1, dtype=torch.long, device="cuda"),
            make((1, 2, 8, 16), torch.float16),
            make((1, 2, 8, 16), torch.float16),
            2,
            2,
            16,
            False,
        ),
        "width",
    ),
    "norm_gemv delta without norm": (
        "norm_gemv",
        lambda x, w: (x, x, *(None,) * 5, 1e-6, True, make((32, 64), torch.float16), None, "none"),
        "need norm_weight",
    ),
    "norm_gemv rms with bias": (
        "norm_gemv",
        lambda x, w: (x, None, None, w, w, None, None, 1e-6, True, make((32, 64), torch.float16), None, "none"),
        "RMSNorm takes no bias",
    ),
    "norm_gemv delta shape": (
        "norm_gemv",
        lambda x, w: (x, x[:2], None, w, None, None, None, 1e-6, True, make((32, 64), torch.float16), None, "none"),
        "must match x",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_get_clear_errors(kernels, case):
    op, build, message = BAD_INPUTS[case]
    x, w = make((4, 64), torch.float16), make((64,), torch.float16)
    with pytest.raises(RuntimeError, match=message):
        getattr(kernels, op)(*build(x, w))


# ---- decode path kernels -----------------------------------------------------------------------------------------

# SwiGLU at batch 1 in fp16 takes 6 chunks a lane where that is a lane's whole slice of K (gemv.cuh,
# launch_swiglu): (151936 // 16, 1536) over whole rows, (1000, 5632) over 4 slices of 5.5 chunks.
GEMV_SHAPES = [(2560, 2560), (7680, 2560), (4096, 14336), (769, 1000), (3, 5125), (151936 // 16, 1536), (1000, 5632)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("shape", GEMV_SHAPES)
@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh", "silu_mul"])
def test_gemv(activation, shape, batch, dtype):
    n, k = shape
    rows = 2 * n if activation == "silu_mul" else n
    x = make((batch, k), dtype)
    w = make((rows, k), dtype, scale=1 / k**0.5)
    bias = make((rows,), dtype) if n % 2 else None
    check_op("gemv", (x, w, bias, activation))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["row-strided", "misaligned"])
def test_gemv_strided_and_misaligned(layout, dtype):
    x = make((3, 1024), dtype, layout)
    w = make((300, 1024), dtype, layout, scale=1 / 32)
    check_op("gemv", (x, w, make((300,), dtype), "none"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ROPE_ARCHS))
@pytest.mark.parametrize("batch", [1, 4])
def test_rope_qkv_cache(batch, arch, dtype):
    from patcher.ops import KERNELS, reference

    hq, hkv, d, rot, interleaved = ROPE_ARCHS[arch]
    capacity = 64
    qkv = make((batch, (hq + 2 * hkv) * d), dtype)
    cos, sin = rope_tables((capacity, rot // 2), dtype)
    slot = torch.tensor([37], device="cuda")
    pad = torch.arange(batch, device="cuda") * 5
    caches = [make((batch, hkv, capacity, d), dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    q = KERNELS.rope_qkv_cache(qkv, cos, sin, slot, pad, *caches, hq, hkv, d, interleaved)
    q_ref = reference.rope_qkv_cache(qkv, cos, sin, slot, pad, *expected_caches, hq, hkv, d, interleaved)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("activation", ["none", "gelu", "silu_mul"])
@pytest.mark.parametrize("shape", [(2560, 2560), (7680, 2560), (300, 4096), (97, 769), (4500, 1280), (200, 5632)])
def test_norm_gemv(shape, activation, prologue, batch, dtype):
    """gemv behind the fused add + norm: the product by the 2x rule, the residual sum bit for bit (it mirrors
    torch's rounding), the second LayerNorm (GPT-NeoX's MLP input) by LayerNorm's own tolerance."""
    n, k = shape
    rows = 2 * n if activation == "silu_mul" else n
    x, pro = prologue_args(prologue, batch, k, dtype)
    w = make((rows, k), dtype, scale=k**-0.5)
    bias = make((rows,), dtype) if n % 2 else None
    (_, total, h2), (_, total_ref, _) = check_op("norm_gemv", (x, *pro, w, bias, activation))
    assert torch.equal(total, total_ref)
    assert (h2.numel() > 0) == (prologue == "add2_dual_layer") and (total.numel() > 0) == prologue.startswith("add")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ROPE_ARCHS))
@pytest.mark.parametrize("batch", [1, 2, 3, 8])
@pytest.mark.parametrize("prologue", ["none", "add_rms", "layer", "add2_dual_layer"])
def test_norm_gemv_rope_cache(prologue, batch, arch, dtype):
    """The decode step's attention prologue in one kernel ([add +] norm, QKV GEMV, RoPE, cache writes), against
    the reference's norm, F.linear and rope_qkv_cache: q and the written cache slot by the 2x rule, the residual
    sum bit for bit, the rest of each cache untouched."""
    from patcher.ops import KERNELS, reference

    hq, hkv, d, rot, interleaved = ROPE_ARCHS[arch]
    capacity, k = 64, 576 if arch == "smollm2" else 1536
    n = (hq + 2 * hkv) * d
    x, pro = prologue_args(prologue, batch, k, dtype)
    w = make((n, k), dtype, scale=k**-0.5)
    bias = make((n,), dtype) if arch == "qwen2-1.5b" else None
    cos, sin = rope_tables((capacity, rot // 2), dtype)
    slot, pad = torch.tensor([37], device="cuda"), torch.arange(batch, device="cuda") * 5
    caches = [make((batch, hkv, capacity, d), dtype) for _ in range(2)]
    low, ref = [c.clone() for c in caches], [c.double() for c in caches]
    before = [c.clone() for c in caches]
    heads = (hq, hkv, d, interleaved)
    q, total, h2 = KERNELS.norm_gemv_rope_cache(x, *pro, w, bias, cos, sin, slot, pad, *caches, *heads)
    q_low, total_low, h2_low = reference.norm_gemv_rope_cache(x, *pro, w, bias, cos, sin, slot, pad, *low, *heads)
    as64 = [t.double() if isinstance(t, torch.Tensor) else t for t in (x, *pro, w, bias, cos, sin)]
    q64 = reference.norm_gemv_rope_cache(*as64, slot, pad, *ref, *heads)[0]
    assert_within_torch_error(q, q_low, q64, f"norm_gemv_rope_cache q {arch}")
    for got, lo, r, old in zip(caches, low, ref, before):
        assert_within_torch_error(got[:, :, 37], lo[:, :, 37], r[:, :, 37], f"norm_gemv_rope_cache cache {arch}")
        keep = torch.arange(capacity, device="cuda") != 37
        assert torch.equal(got[:, :, keep], old[:, :, keep])
    assert torch.equal(total, total_low) and h2.shape == h2_low.shape
    if h2.numel():  # the second LayerNorm, written by one block
        assert max_err(h2, h2_low) <= 1e-2 * max(1.0, h2_low.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads", [(32, 32), (12, 2), (9, 3), (32, 8), (28, 4)])
@pytest.mark.parametrize("length", [1, 7, 129, 1000, 4096])
@pytest.mark.parametrize("batch,splits", [(1, 1), (1, 16), (3, 7), (8, 16)])
def test_decode_attention(batch, splits, length, heads, head_dim, dtype):
    from patcher.ops import decode_attention_workspace

    hq, hkv = heads
    capacity = length + 9
    q = make((batch, hq, head_dim), dtype)
    k_cache, v_cache = make((batch, hkv, capacity, head_dim), dtype), make((batch, hkv, capacity, head_dim), dtype)
    slot = torch.tensor([length - 1], device="cuda")
    pad = torch.tensor([min(r * 3, length - 1) for r in range(batch)], device="cuda")
    workspace = decode_attention_workspace(batch, hq, hkv, head_dim, splits, "cuda")
    scale = head_dim**-0.5
    check_op("decode_attention", (q, k_cache, v_cache, slot, pad, scale, splits, workspace))
    assert int(workspace[: batch * hq].abs().sum()) == 0, "split counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(QKV_HEADS))
@pytest.mark.parametrize("length", [1, 7, 129, 1000])
@pytest.mark.parametrize("batch,splits", [(1, 1), (1, 16), (3, 7)])
def test_decode_attention_qkv(batch, splits, length, arch, dtype):
    """decode_attention_qkv against the two kernels it stands for, rope_qkv_cache then decode_attention: the caches
    bit for bit (the current token's K/V written at slot, nothing else touched); the output is the same attention
    over the same values, equal but for the compiler's FMA contraction in a different instantiation (within 2 ulps
    of the dtype at 1)."""
    from patcher.ops import KERNELS, decode_attention_workspace

    hq, hkv, d, rot, interleaved = QKV_HEADS[arch]
    capacity, width = length + 9, (hq + 2 * hkv) * d
    qkv = make((batch, width), dtype)
    cos, sin = rope_tables((capacity, rot // 2), dtype)
    slot = torch.tensor([length - 1], device="cuda")
    pad = torch.tensor([min(r * 3, length - 1) for r in range(batch)], device="cuda")
    caches = [make((batch, hkv, capacity, d), dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    workspaces = [decode_attention_workspace(batch, hq, hkv, d, splits, "cuda") for _ in range(2)]
    scale = d**-0.5
    out = KERNELS.decode_attention_qkv(qkv, cos, sin, slot, pad, *caches, hq, interleaved, scale, splits,
                                       workspaces[0])  # fmt: skip
    q = KERNELS.rope_qkv_cache(qkv, cos, sin, slot, pad, *expected_caches, hq, hkv, d, interleaved)
    expected = KERNELS.decode_attention(q, *expected_caches, slot, pad, scale, splits, workspaces[1])
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    assert max_err(out, expected) <= 2 * torch.finfo(dtype).eps * max(1.0, expected.abs().max().item())
    assert int(workspaces[0][: batch * hq].abs().sum()) == 0, "split counters must be left at zero"


def test_decode_attention_qkv_bad_inputs():
    from patcher.ops import KERNELS, decode_attention_workspace

    kc, vc = (torch.zeros(1, 2, 16, 64, device="cuda").half() for _ in range(2))
    qkv = torch.zeros(1, 8 * 64, device="cuda").half()
    cos, sin = rope_tables((16, 32), torch.float16)
    slot, pad = torch.tensor([3], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    workspace = decode_attention_workspace(1, 4, 2, 64, 2, "cuda")
    args = (cos, sin, slot, pad, kc, vc, 4, False, 0.125, 2, workspace)
    torch.library.opcheck(torch.ops.patcher.decode_attention_qkv.default, (qkv, *args))
    with pytest.raises(RuntimeError, match="qkv must be a contiguous"):
        KERNELS.decode_attention_qkv(qkv[:, :64], *args)
    with pytest.raises(RuntimeError, match="qkv must be a contiguous"):
        KERNELS.decode_attention_qkv(qkv.float(), *args)
    with pytest.raises(RuntimeError, match="qkv must be a contiguous"):
        KERNELS.decode_attention_qkv(torch.zeros(1, 16 * 64, device="cuda").half()[:, ::2], *args)
    with pytest.raises(RuntimeError, match="supports head_dim"):
        small = [torch.zeros(1, 2, 16, 32, device="cuda").half() for _ in range(2)]
        KERNELS.decode_attention_qkv(qkv[:, :256], cos, sin, slot, pad, *small, 4, False, 0.1, 2, workspace)


# ---- next_token: the decode step's argmax and loop bookkeeping ----------------------------------------------------


def next_token_state(batch, vocab, hidden, embed_dtype, finished, eos, columns=40, slot=9):
    """The decode state next_token writes (tokens, slot, finished, x) and reads (eos, pad_token, embed), and its
    workspace."""
    from patcher.ops import next_token_workspace

    tokens = torch.randint(0, vocab, (batch, columns), device="cuda")
    return {
        "tokens": tokens,
        "slot": torch.tensor([slot], device="cuda"),
        "finished": torch.tensor(finished, device="cuda"),
        "eos": torch.tensor(eos + [-1] * (8 - len(eos)), device="cuda"),
        "pad_token": torch.tensor(3, device="cuda"),
        "embed": make((vocab + 5, hidden), embed_dtype) if hidden else None,
        "x": make((batch, hidden or 1), embed_dtype),
        "workspace": next_token_workspace(batch, "cuda"),
    }


def run_next_token(fn, scores, state):
    s = {k: v.clone() if v is not None else None for k, v in state.items()}
    fn(scores, s["tokens"], s["slot"], s["finished"], s["eos"], s["pad_token"], s["embed"], s["x"], s["workspace"])
    return s


def assert_same_state(kernel_state, ref_state):
    for name in ("tokens", "slot", "finished", "x"):
        assert torch.equal(kernel_state[name], ref_state[name]), name


# Scores with many ties (values on a coarse grid), NaNs, an all -inf row, and rows whose maximum sits at the ends,
# in the given memory layout.
def tricky_scores(batch, vocab, dtype, layout):
    s = make((batch, vocab), dtype, layout)
    s.copy_((s.float() * 4).round() / 4)
    s[0, -1] = 100.0  # the last element
    if batch > 1:
        s[1, 0] = 100.0  # the first
    if batch > 2:
        s[2, vocab // 3] = float("nan")
        s[2, vocab // 2] = float("nan")  # two NaNs: the first one's index
    if batch > 3:
        s[3] = float("-inf")  # all equal: index 0
    return s


def on_cpu(state):
    return {k: v.cpu() if v is not None else None for k, v in state.items()}


def on_cuda(state):
    return {k: v.cuda() for k, v in state.items() if v is not None}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 4, 8])
@pytest.mark.parametrize("vocab", [1, 7, 1000, 49152, 50304, 128256, 151936])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_next_token_argmax(kernels, layout, vocab, batch, dtype):
    from patcher.ops import reference

    if vocab < 4 and batch > 1:
        pytest.skip("the tricky rows need a few columns")
    scores = tricky_scores(batch, vocab, dtype, layout)
    state = next_token_state(batch, vocab, 576, dtype if dtype != torch.float32 else torch.float16, [False] * batch, [])
    got = run_next_token(kernels.next_token, scores, state)
    want = run_next_token(reference.next_token, scores.cpu(), on_cpu(state))
    assert_same_state(got, on_cuda(want))
    assert int(got["slot"]) == 10 and not got["workspace"][0], "the ticket must be left at zero"


@pytest.mark.parametrize("embed_dtype", DTYPES)
@pytest.mark.parametrize("hidden", [0, 7, 576, 2560, 4096])
def test_next_token_finished_rows_eos_and_embedding(kernels, hidden, embed_dtype):
    """Finished rows take the pad id; a row that emits an EOS id finishes; x gets each new token's embedding
    (rows of odd length take the kernel's 2- or 4-byte copy); without an embedding x is left alone."""
    from patcher.ops import reference

    batch, vocab = 5, 3000
    scores = make((batch, vocab), torch.float32)
    top = torch.tensor([11, 22, 33, 44, 55])
    scores[torch.arange(batch), top] = 10.0  # above every randn value
    finished = [False, True, False, False, True]
    eos = [int(top[2]), int(top[1]), 3]  # row 2 emits an EOS id; row 1 would, but it has finished (pad 3 is EOS too)
    state = next_token_state(batch, vocab, hidden, embed_dtype, finished, eos)
    got = run_next_token(kernels.next_token, scores, state)
    want = run_next_token(reference.next_token, scores.cpu(), on_cpu(state))
    assert_same_state(got, on_cuda(want))
    assert got["finished"].tolist() == [False, True, True, False, True]
    assert got["tokens"][:, 10].tolist() == [int(top[0]), 3, int(top[2]), int(top[3]), 3]
    if not hidden:
        assert torch.equal(got["x"], state["x"])


def test_next_token_in_a_graph(kernels):
    """Replayed in a CUDA graph, each replay writes the next column and advances the slot once (the workspace's
    ticket goes back to zero for the next replay)."""
    batch, vocab = 3, 50304
    scores = make((batch, vocab), torch.float16)
    state = next_token_state(batch, vocab, 2560, torch.float16, [False] * batch, [])
    s = state
    args = (scores, s["tokens"], s["slot"], s["finished"], s["eos"], s["pad_token"], s["embed"], s["x"], s["workspace"])
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())  # the state was written on the current stream
    with torch.cuda.stream(stream):
        kernels.next_token(*args)  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        kernels.next_token(*args)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    assert int(s["slot"]) == 9 + 6 and not s["workspace"][0]
    top = scores.argmax(-1)
    assert torch.equal(s["tokens"][:, 10:16], top[:, None].expand(batch, 6))
    assert torch.equal(s["x"], s["embed"][top])


@pytest.mark.parametrize(
    "case, message",
    [
        ("scores 1-D", "scores must be"),
        ("int scores", "unsupported dtype"),
        ("short embed", "at least as many rows"),
        ("x shape", "x must be"),
        ("finished dtype", "finished must be"),
        ("workspace dtype", "workspace must be"),
        ("small workspace", "workspace must be"),
    ],
)
def test_next_token_bad_inputs(kernels, case, message):
    state = next_token_state(2, 100, 64, torch.float16, [False, False], [])
    scores = make((2, 100), torch.float16)
    if case == "scores 1-D":
        scores = scores[0]
    elif case == "int scores":
        scores = scores.to(torch.int32)
    elif case == "short embed":
        state["embed"] = state["embed"][:50]
    elif case == "x shape":
        state["x"] = state["x"][:, :10]
    elif case == "finished dtype":
        state["finished"] = state["finished"].long()
    elif case == "workspace dtype":
        state["workspace"] = state["workspace"].long()
    elif case == "small workspace":
        state["workspace"] = state["workspace"][:-1]
    with pytest.raises(RuntimeError, match=message):
        run_next_token(kernels.next_token, scores, state)
