"""GPTQ int4 kernels against their pure-torch references (GPU only), with the 2x rule of conftest.py.

The float64 reference takes the checkpoint's exact weights, scales * (q - zero) (patcher/ops/int4_ops.py:
int4_linear): the precise product of what the checkpoint means. The working-dtype reference (PyTorch's own error)
rounds each weight to fp16 first, as HF's GPTQ linears do, and so do the CUDA-core kernel and the prefill path; the
tensor-core kernel multiplies x by the exact q - zero and applies the scales to its fp32 sums, so its error is the
smaller one (which matters where nothing rounds the output: int4_gemv_acc's fixed-point sums).
Covered: group sizes 16/32/128/one group, act-order, GPTQ v1/v2 zero points, batch 1-8 (and 83 rows: the
dequantize + cuBLAS path), odd widths and K, fp16/bf16/fp32 activations, every prologue (none, RMSNorm, add +
RMSNorm, LayerNorm with one or two deltas and two outputs) and epilogue (none, GELU, SwiGLU, RoPE into the cache),
K splits, heads of 64/72/80/128. fp16/bf16 without act-order take the tensor-core kernel (kernels/int4_mma.cuh) where
the group size is a multiple of 32 and the heads tile into whole warps; the rest take the CUDA-core kernel.
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    DTYPES,
    PROLOGUES,
    QKV_HEADS,
    assert_within_torch_error,
    check_op,
    max_err,
    poison_cuda_cache,
    prologue_args,
    rope_tables,
)
from int4_weights import gptq_linear

from patcher.ops import int4 as int4_ops

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 83])
@pytest.mark.parametrize(
    "k,widths,group_size,act_order",
    [
        (2560, [7680], 128, False),  # Pythia-2.8B query_key_value
        (576, [576, 192, 192], 32, False),  # SmolLM2 q/k/v side by side
        (1536, [264], -1, False),  # one group, a width that is not a multiple of the tile
        (1024, [520, 1040], 64, True),  # act-order, two segments
        (1064, [200], 128, False),  # K not a multiple of 32 (a last group of 40), a partly filled warp of columns
        (512, [264], 16, False),  # a group of 16: the CUDA-core kernel for every dtype
    ],
)
def test_int4_linear(k, widths, group_size, act_order, rows, dtype):
    lin = gptq_linear(k, widths, group_size, act_order, bias=len(widths) == 3)
    x = torch.randn(rows, k, device="cuda").to(dtype)
    check_op("int4_linear", (x, *lin.args()))


@pytest.mark.parametrize("version", [1, 2])
def test_int4_linear_zero_point_formats(version):
    lin = gptq_linear(512, [256], 64, version=version)
    check_op("int4_linear", (torch.randn(2, 512, device="cuda").half(), *lin.args()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 2, 5, 8])
@pytest.mark.parametrize("prologue", PROLOGUES)
@pytest.mark.parametrize("activation", ["none", "gelu", "gelu_tanh", "silu_mul"])
@pytest.mark.parametrize("shape,splits", [((2560, 2560), None), ((1024, 1400), 1), ((2048, 512), 7), ((1064, 200), 3)])
def test_int4_gemv(shape, splits, activation, prologue, batch, dtype):
    k, n = shape
    widths = [n, n] if activation == "silu_mul" else [n]
    lin = gptq_linear(k, widths, 128, bias=activation == "gelu")
    splits = splits or int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x, pro = prologue_args(prologue, batch, k, dtype)
    (_, total, h2), (_, total_ref, _) = check_op("int4_gemv", (x, *pro, *lin.args(), activation, splits, workspace))
    # The residual sum mirrors torch's rounding, so it must be equal bit for bit; h2 is LayerNorm's output.
    assert torch.equal(total, total_ref)
    assert (h2.numel() > 0) == (prologue == "add2_dual_layer") and (total.numel() > 0) == prologue.startswith("add")
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize(
    "k1,k2,n,group_size,splits",
    [
        (2560, 10240, 2560, 128, None),  # Pythia-2.8B dense + dense_4h_to_h
        (512, 2048, 520, 64, None),  # a last tile of 8 columns
        (264, 1000, 200, 8, 3),  # x's width a multiple of 8 only: slices across the seam (CUDA-core kernel)
        (128, 384, 256, 128, 1),  # one slice over both inputs
    ],
)
def test_int4_gemv_cat(k1, k2, n, group_size, splits, batch, dtype):
    """[x | x2] @ W + b, one linear over two inputs side by side along k (patcher/layers/out_pair.py), with x and
    x2 as column slices of wider tensors (row strides of their own)."""
    lin = gptq_linear(k1 + k2, [n], group_size, bias=True)
    splits = splits or int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x = torch.randn(batch, k1 + 8, device="cuda").to(dtype)[:, 8:]
    x2 = torch.randn(batch, k2 + 16, device="cuda").to(dtype)[:, :k2]
    check_op("int4_gemv_cat", (x, x2, *lin.args(), splits, workspace))
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("k1,k2,n", [(2560, 10240, 2560), (512, 2048, 520)])
def test_int4_gemv_cat_x2_early(k1, k2, n, dtype):
    """x2_early (the decode step's output pair right after the attention): x comes out of the kernel just before,
    launched as a programmatic dependent, and x2 from before that one. The blocks that read only x2 start while the
    producer runs; those that read x must wait for it, or they read the buffer before it is written (the allocator's
    previous contents: each round has another source, so stale values differ from the right ones)."""
    from patcher.ops import KERNELS, reference

    producer = gptq_linear(8192, [k1], 128)  # long enough that the early blocks run beside it
    lin = gptq_linear(k1 + k2, [n], 128, bias=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x2 = torch.randn(1, k2, device="cuda").to(dtype)
    none = (None,) * 6 + (0.0, False)
    results = []
    for _ in range(3):
        splits = [int4_ops.splits_for(1, w, sms) for w in (producer, lin)]
        spaces = [torch.zeros(int4_ops.workspace_numel(1, w, s), dtype=torch.int32, device="cuda")
                  for w, s in zip((producer, lin), splits)]  # fmt: skip
        source = torch.randn(1, 8192, device="cuda").to(dtype)
        torch.cuda.synchronize()
        x = KERNELS.int4_gemv(source, *none, *producer.args(), "none", splits[0], spaces[0])[0]
        got = KERNELS.int4_gemv_cat(x, x2, *lin.args(), splits[1], spaces[1], True)
        results.append((x, got))
    for x, got in results:
        low = reference.int4_gemv_cat(x, x2, *lin.args(), 1, None)
        ref64 = reference.int4_gemv_cat(x.double(), x2.double(), *lin.args(), 1, None)
        assert_within_torch_error(got, low, ref64, "int4_gemv_cat with x2_early")


def test_int4_gemv_cat_bad_inputs(kernels):
    lin = gptq_linear(256, [128], 64)
    workspace = torch.zeros(int4_ops.workspace_numel(2, lin, 2), dtype=torch.int32, device="cuda")
    x, x2 = torch.randn(2, 64, device="cuda").half(), torch.randn(2, 192, device="cuda").half()
    torch.library.opcheck(torch.ops.patcher.int4_gemv_cat.default, (x, x2, *lin.args(), 2, workspace))
    with pytest.raises(RuntimeError, match="add up"):
        kernels.int4_gemv_cat(x, x2[:, :128], *lin.args(), 2, workspace)
    with pytest.raises(RuntimeError, match="one dtype"):
        kernels.int4_gemv_cat(x, x2.float(), *lin.args(), 2, workspace)
    with pytest.raises(RuntimeError, match="multiple of 8"):
        kernels.int4_gemv_cat(x[:, :60], torch.randn(2, 196, device="cuda").half(), *lin.args(), 2, workspace)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize(
    "k1,k2,n,group_size,act_order,splits",
    [
        (2560, 10240, 2560, 128, False, None),  # Pythia-2.8B's out pair, the split rule's slices
        (4096, 0, 4096, 128, False, None),  # Llama-3.1-8B's o_proj (no x2)
        (1024, 0, 1040, 64, True, 5),  # act-order: the CUDA-core kernel; a last tile of 16 columns
        (264, 1000, 200, 8, False, 3),  # slices across the seam of x and x2
        (512, 0, 520, 128, False, 1),  # one slice: a block alone still adds into acc
    ],
)
def test_int4_gemv_acc(k1, k2, n, group_size, act_order, splits, batch, dtype):
    """acc += [x | x2] @ W in fixed point, every K slice's block adding its own sums (Int4Params::acc): the added
    values against the float64 product with the 2x rule of the fp32 reference (the kernels accumulate in fp32);
    acc's previous contents kept, `clear` zeroed, the tile counters untouched."""
    from patcher.ops import KERNELS, reference

    lin = gptq_linear(k1 + k2, [n], group_size, act_order)
    splits = splits or int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x = torch.randn(batch, k1 + 8, device="cuda").to(dtype)[:, 8:]
    x2 = torch.randn(batch, k2 + 16, device="cuda").to(dtype)[:, :k2] if k2 else None
    start = torch.randint(-(2**40), 2**40, (batch, n), device="cuda")
    clear = torch.randint(1, 9, (3, 1000), device="cuda")
    poison_cuda_cache()
    got = start.clone()
    KERNELS.int4_gemv_acc(x, x2, *lin.args(), splits, workspace, got, clear)
    low = start.clone()
    reference.int4_gemv_acc(x, x2, *lin.args(), splits, None, low)
    h64 = x.double() if x2 is None else torch.cat([x, x2], dim=-1).double()
    ref64 = reference.int4_linear(h64, *lin.args())
    added = [((a - start).double() / reference.FIXED_SCALE).float() for a in (got, low)]
    assert_within_torch_error(added[0], added[1], ref64, "int4_gemv_acc")
    assert int(clear.abs().sum()) == 0, "clear must be zeroed"
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rms", [True, False])
def test_int4_prologue_reads_an_accumulator(rms, with_bias, batch, dtype):
    """The norm prologue with delta an int4_gemv_acc accumulator (NormPrologue::delta_fixed) and delta2 the
    producer's bias rows: each value rounded to the dtype, then added as the producer's epilogue and the residual add
    would have; the residual sum bit for bit, the product with the 2x rule."""
    from patcher.ops import reference

    k = 2560
    lin = gptq_linear(k, [1024], 128)
    splits = int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x = torch.randn(batch, k, device="cuda").to(dtype)
    acc = reference.to_fixed(torch.randn(batch, k, device="cuda") * 3)
    rows = (torch.randn(k, device="cuda") * 0.1).to(dtype).expand(batch, k).contiguous() if with_bias else None
    w, b = ((torch.randn(k, device="cuda") * 0.3 + 1).to(dtype) for _ in range(2))
    pro = (acc, rows, w, None, None, None, 1e-6, True) if rms else (acc, rows, w, b, None, None, 1e-5, False)
    (_, total, _), (_, total_ref, _) = check_op("int4_gemv", (x, *pro, *lin.args(), "none", splits, workspace))
    assert torch.equal(total, total_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("k", [2560, 4096, 1032, 6144])
@pytest.mark.parametrize("prologue", ["rms", "add_rms", "layer", "add2_dual_layer", "acc_rms", "acc_layer"])
def test_int4_norm_prologue(prologue, k, batch, dtype):
    """The int4 ops' add + norm prologue as its own kernel (the decode step's): h and h2 with the 2x rule, the
    residual sum bit for bit; "acc_*": delta an int4_gemv_acc accumulator and delta2 the producer's bias rows, as the
    decode step hands them on. In fp16, K <= 4096 takes the kernel's narrow form (8 elements a thread), 6144 the
    16-element one that bf16 and fp32 always take."""
    from patcher.ops import reference

    if prologue.startswith("acc"):
        x, pro = prologue_args("add2_dual_layer" if prologue == "acc_layer" else "add_rms", batch, k, dtype)
        acc = reference.to_fixed(torch.randn(batch, k, device="cuda") * 3)
        rows = (torch.randn(k, device="cuda") * 0.1).to(dtype).expand(batch, k).contiguous()
        pro = (acc, rows, *pro[2:])
    else:
        x, pro = prologue_args(prologue, batch, k, dtype)
    x = torch.cat([x, x], dim=1)[:, :k]  # strided rows
    _, total, h2 = check_op("int4_norm_prologue", (x, *pro), exact_outputs=(1,))[0]
    assert total.numel() == (0 if pro[0] is None else batch * k)
    assert h2.numel() == (0 if pro[4] is None else batch * k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
@pytest.mark.parametrize("prologue", ["rms", "add_rms", "layer"])
def test_int4_norm_gemv_acc(prologue, batch, dtype):
    """The QKV op of the decode step whose sums the attention finishes: int4_gemv's add + norm prologue (the residual
    sum bit for bit), then acc += h @ W in fixed point as int4_gemv_acc adds it (the 2x rule against float64),
    `clear` zeroed, the tile counters untouched."""
    from patcher.ops import KERNELS, reference

    k = 4096
    lin = gptq_linear(k, [4096, 1024, 1024], 128)  # Llama-3.1-8B's q | k | v
    splits = int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x, pro = prologue_args(prologue, batch, k, dtype)
    start = torch.randint(-(2**40), 2**40, (batch, 6144), device="cuda")
    clear = torch.randint(1, 9, (2, 300), device="cuda")
    got, low = start.clone(), start.clone()
    total, _ = KERNELS.int4_norm_gemv_acc(x, *pro, *lin.args(), splits, workspace, got, clear)
    total_ref, _ = reference.int4_norm_gemv_acc(x, *pro, *lin.args(), splits, None, low)
    as64 = [t.double() if isinstance(t, torch.Tensor) else t for t in (x, *pro)]
    ref64 = reference.int4_gemv(*as64, *lin.args(), "none", splits, None)[0]
    added = [((a - start).double() / reference.FIXED_SCALE).float() for a in (got, low)]
    assert_within_torch_error(added[0], added[1], ref64, "int4_norm_gemv_acc")
    assert torch.equal(total, total_ref)
    assert int(clear.abs().sum()) == 0, "clear must be zeroed"
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("arch", list(QKV_HEADS))
@pytest.mark.parametrize("length", [1, 7, 129, 1000])
@pytest.mark.parametrize("batch,splits", [(1, 1), (1, 16), (3, 7)])
def test_decode_attention_qkv_acc(batch, splits, length, arch, bias, dtype):
    """decode_attention_qkv_acc against the kernels it stands for: the QKV accumulator rounded (+ bias) as the
    projection's epilogue rounds it, then rope_qkv_cache and decode_attention. The caches bit for bit (the current
    token's K/V written at slot, nothing else touched); the output is the same attention over the same values, equal
    but for the compiler's FMA contraction in a different instantiation (within 2 ulps of the dtype at 1)."""
    from patcher.ops import KERNELS, decode_attention_workspace, reference

    hq, hkv, d, rot, interleaved = QKV_HEADS[arch]
    capacity, width = length + 9, (hq + 2 * hkv) * d
    acc = reference.to_fixed(torch.randn(batch, width, device="cuda") * 2)
    rows = (torch.randn(width, device="cuda") * 0.5).to(dtype).expand(batch, width).contiguous() if bias else None
    cos, sin = rope_tables((capacity, rot // 2), dtype)
    slot = torch.tensor([length - 1], device="cuda")
    pad = torch.tensor([min(r * 3, length - 1) for r in range(batch)], device="cuda")
    caches = [torch.randn(batch, hkv, capacity, d, device="cuda").to(dtype) for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    workspaces = [decode_attention_workspace(batch, hq, hkv, d, splits, "cuda") for _ in range(2)]
    scale = d**-0.5
    out = KERNELS.decode_attention_qkv_acc(acc, rows, cos, sin, slot, pad, *caches, hq, interleaved, scale, splits,
                                           workspaces[0])  # fmt: skip
    qkv = reference.from_fixed(acc, dtype)
    if rows is not None:
        qkv = qkv + rows
    q = KERNELS.rope_qkv_cache(qkv, cos, sin, slot, pad, *expected_caches, hq, hkv, d, interleaved)
    expected = KERNELS.decode_attention(q, *expected_caches, slot, pad, scale, splits, workspaces[1])
    assert torch.equal(caches[0], expected_caches[0]) and torch.equal(caches[1], expected_caches[1])
    assert max_err(out, expected) <= 2 * torch.finfo(dtype).eps * max(1.0, expected.abs().max().item())
    assert int(workspaces[0][: batch * hq].abs().sum()) == 0, "split counters must be left at zero"


def test_decode_attention_qkv_acc_bad_inputs(kernels):
    from patcher.ops import decode_attention_workspace

    kc, vc = (torch.zeros(1, 2, 16, 64, device="cuda").half() for _ in range(2))
    acc = torch.zeros(1, 8 * 64, dtype=torch.int64, device="cuda")
    cos, sin = rope_tables((16, 32), torch.float16)
    slot, pad = torch.tensor([3], device="cuda"), torch.zeros(1, dtype=torch.long, device="cuda")
    workspace = decode_attention_workspace(1, 4, 2, 64, 2, "cuda")
    args = (cos, sin, slot, pad, kc, vc, 4, False, 0.125, 2, workspace)
    torch.library.opcheck(torch.ops.patcher.decode_attention_qkv_acc.default, (acc, None, *args))
    with pytest.raises(RuntimeError, match="acc must be a contiguous int64"):
        kernels.decode_attention_qkv_acc(acc[:, :64], None, *args)
    with pytest.raises(RuntimeError, match="acc must be a contiguous int64"):
        kernels.decode_attention_qkv_acc(acc.int(), None, *args)
    with pytest.raises(RuntimeError, match="bias_rows must be"):
        kernels.decode_attention_qkv_acc(acc, torch.zeros(1, 8 * 64, device="cuda"), *args)
    with pytest.raises(RuntimeError, match="supports head_dim"):
        small = [torch.zeros(1, 2, 16, 32, device="cuda").half() for _ in range(2)]
        kernels.decode_attention_qkv_acc(acc[:, :256], None, cos, sin, slot, pad, *small, 4, False, 0.1, 2, workspace)


def test_int4_gemv_acc_bad_inputs(kernels):
    lin = gptq_linear(256, [128], 64)
    biased = gptq_linear(256, [128], 64, bias=True)
    workspace = torch.zeros(int4_ops.workspace_numel(2, lin, 2), dtype=torch.int32, device="cuda")
    x, acc = torch.randn(2, 256, device="cuda").half(), torch.zeros(2, 128, dtype=torch.int64, device="cuda")
    torch.library.opcheck(torch.ops.patcher.int4_gemv_acc.default, (x, None, *lin.args(), 2, workspace, acc))
    with pytest.raises(RuntimeError, match="adds no bias"):
        kernels.int4_gemv_acc(x, None, *biased.args(), 2, workspace, acc)
    with pytest.raises(RuntimeError, match="acc must be a contiguous int64"):
        kernels.int4_gemv_acc(x, None, *lin.args(), 2, workspace, acc.int())
    with pytest.raises(RuntimeError, match="acc must be a contiguous int64"):
        kernels.int4_gemv_acc(x, None, *lin.args(), 2, workspace, acc[:, :64])
    with pytest.raises(RuntimeError, match="clear must not be acc"):
        kernels.int4_gemv_acc(x, None, *lin.args(), 2, workspace, acc, acc)
    with pytest.raises(RuntimeError, match="x2_early needs x2"):
        kernels.int4_gemv_acc(x, None, *lin.args(), 2, workspace, acc, None, True)
    with pytest.raises(RuntimeError, match="at most 2047 terms"):
        kernels.int4_gemv_acc(torch.randn(1, 2**16, device="cuda").half(), None,
                              *gptq_linear(2**16, [128], 128).args(), 2048, workspace, acc[:1])  # fmt: skip
    # The dense GEMVs' prologue takes no accumulator.
    weight = torch.randn(64, 256, device="cuda").half()
    with pytest.raises(RuntimeError, match="dtype Long"):
        kernels.norm_gemv(x, acc.new_zeros(2, 256), None, torch.ones(256, device="cuda").half(), None, None, None,
                          1e-6, True, weight, None, "none")  # fmt: skip
    assert int(acc.abs().sum()) == 0, "a rejected call must leave acc as it was"


def test_int4_ops_sharing_a_workspace():
    """The decode step runs all its int4 ops on one workspace: an op with more column tiles than the one before it
    (Llama's gate | up: 224 tiles, after o_proj's 32) must not take that op's leftover partial sums for its tile
    counters. Before the counters had a fixed region, the second op's tiles past the first's 64 finished early."""
    from patcher.ops import KERNELS, reference

    small, large = gptq_linear(4096, [4096]), gptq_linear(4096, [14336, 14336])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = {id(lin): int4_ops.splits_for(1, lin, sms) for lin in (small, large)}
    numel = max(int4_ops.workspace_numel(1, lin, splits[id(lin)]) for lin in (small, large))
    workspace = torch.zeros(numel, dtype=torch.int32, device="cuda")
    x = torch.randn(1, 4096, device="cuda").half()
    none = (None, None, None, None, None, None, 0.0, False)
    for lin in (small, large, small, large):
        args = (x, *none, *lin.args(), "none", splits[id(lin)], workspace)
        got = KERNELS.int4_gemv(*args)[0]
        ref64 = reference.int4_gemv(x.double(), *none, *lin.args(), "none", 1, None)[0]
        low = reference.int4_gemv(*args)[0]
        assert_within_torch_error(got, low, ref64, f"{sum(lin.widths)} columns")


def test_int4_opcheck_and_bad_inputs(kernels):
    lin = gptq_linear(256, [128, 128], 64)
    x = torch.randn(2, 256, device="cuda").half()
    workspace = torch.zeros(int4_ops.workspace_numel(2, lin, 2), dtype=torch.int32, device="cuda")
    torch.library.opcheck(torch.ops.patcher.int4_linear.default, (x, *lin.args()))
    none = (None,) * 6 + (0.0, False)
    torch.library.opcheck(torch.ops.patcher.int4_gemv.default, (x, *none, *lin.args(), "silu_mul", 2, workspace))
    args = list(lin.args())
    with pytest.raises(RuntimeError, match="float16"):
        kernels.int4_linear(x, args[0], args[1], [s.float() for s in args[2]], *args[3:])
    with pytest.raises(RuntimeError, match="in_features"):
        kernels.int4_linear(torch.randn(2, 128, device="cuda").half(), *args)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernels.int4_gemv(torch.randn(9, 256, device="cuda").half(), *none, *args, "none", 2, workspace)
    with pytest.raises(RuntimeError, match="workspace"):
        kernels.int4_gemv(x, *none, *args, "none", 2, workspace[:10])
    with pytest.raises(RuntimeError, match="silu_mul"):
        kernels.int4_gemv(x, *none, *gptq_linear(256, [128], 64).args(), "silu_mul", 2, workspace)


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize(
    "k,widths,group_size,activation",
    [
        (4096, [2656], 32, "none"),  # 83 warps of columns: a last tile of 96
        (4096, [1024], 64, "gelu"),
        (2048, [3072], 256, "none"),
        (2048, [512, 512], 512, "silu_mul"),  # a group wider than a K slice
        (1024, [4096, 4096], -1, "silu_mul"),  # one group
        (256, [32768], 128, "none"),  # many tiles, a short K
        (4096, [128], 128, "none"),  # one tile shared by every K slice
    ],
)
def test_int4_gemv_work_split(k, widths, group_size, activation, batch, dtype):
    """The tensor-core kernel at the K slices splits_for picks, over every group size it takes, tiles cut short, one
    tile shared by many slices and many tiles of a short K."""
    lin = gptq_linear(k, widths, group_size, bias=activation == "gelu")
    splits = int4_ops.splits_for(batch, lin, torch.cuda.get_device_properties(0).multi_processor_count)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits), dtype=torch.int32, device="cuda")
    x, pro = prologue_args("add_rms", batch, k, dtype)
    check_op("int4_gemv", (x, *pro, *lin.args(), activation, splits, workspace))
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("prologue,activation", [("none", "silu_mul"), ("add_rms", "silu_mul"), ("none", "none")])
def test_int4_gemv_largest_x_stage(prologue, activation, dtype):
    """8 rows of a gate/up-sized op in the K slices the decode step picks for fp16/bf16 (int4_ops.splits_for with
    the dtype): the tensor-core kernel's x stage then holds its whole 32 KB (twice what the fp32 rule allows)."""
    lin = gptq_linear(4096, [8192, 8192] if activation == "silu_mul" else [16384], 128)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = int4_ops.splits_for(8, lin, sms, dtype=dtype)
    assert splits < int4_ops.splits_for(8, lin, sms)
    assert int4_ops.stage_bytes(8, lin, splits, dtype) > int4_ops.STAGE_BYTES // 2
    workspace = torch.zeros(int4_ops.workspace_numel(8, lin, splits), dtype=torch.int32, device="cuda")
    x, pro = prologue_args(prologue, 8, 4096, dtype)
    check_op("int4_gemv", (x, *pro, *lin.args(), activation, splits, workspace))
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"


@pytest.mark.parametrize("dtype", DTYPES[:2])
@pytest.mark.parametrize("batch", [1, 2])
def test_int4_gemv_largest_group_stage(batch, dtype, kernels):
    """K slices whose scales and zero points fill the tensor-core kernel's 40 KB of shared memory (8192 k at group
    size 32 in 2 slices of 128 groups; with batch 2's x stage past a block's default 48 KB), and the same op in one
    slice, whose 256 groups would take 80 KB: rejected, naming the split rule."""
    lin = gptq_linear(8192, [256], 32)
    assert int4_ops.group_stage_bytes(lin, 2) == int4_ops.GROUP_STAGE_BYTES
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, 2), dtype=torch.int32, device="cuda")
    x, pro = prologue_args("add_rms", batch, 8192, dtype)
    check_op("int4_gemv", (x, *pro, *lin.args(), "none", 2, workspace))
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0, "the tile counters must be left at zero"
    with pytest.raises(RuntimeError, match="splits_for"):
        kernels.int4_gemv(x, *pro, *lin.args(), "none", 1, workspace)
