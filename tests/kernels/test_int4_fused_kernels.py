"""The int4 kernels that fuse the QKV projection with RoPE and the cache write, or with the MLP's first linear,
against their pure-torch references (GPU only), with the 2x rule of conftest.py and the references of
test_int4_kernels.py: heads of 64/72/80/128 with partial and interleaved rotary, GQA, q/k/v as one or separate
segments, bias, every prologue, batch 1 and 4, fp16/bf16/fp32; and their bad inputs.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
from conftest import (
    DTYPES,
    assert_within_torch_error,
    max_err,
    poison_cuda_cache,
    prologue_args,
    rope_tables,
)
from int4_weights import gptq_linear

from patcher.ops import int4 as int4_ops

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("kernels")]


class RopeCase(NamedTuple):
    """What an op with the RoPE + cache epilogue takes beside its input and weights, and the caches' copies."""

    splits: int
    workspace: torch.Tensor
    rope: tuple  # cos, sin, slot, pad
    caches: list[torch.Tensor]
    ref_caches: list[torch.Tensor]


def rope_case(lin, batch: int, hkv: int, d: int, rot: int, dtype, capacity: int, slot: int, pad_step: int) -> RopeCase:
    """K splits and a zeroed workspace for `lin` at `batch`, RoPE tables of `capacity` positions, the new rows' slot,
    per-row padding of pad_step * row, and random K/V caches with copies for the reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    splits = int4_ops.splits_for(batch, lin, sms, head_dim=d)
    workspace = torch.zeros(int4_ops.workspace_numel(batch, lin, splits, d), dtype=torch.int32, device="cuda")
    cos, sin = rope_tables((capacity, rot // 2), dtype)
    rope = (cos, sin, torch.tensor([slot], device="cuda"), torch.arange(batch, device="cuda") * pad_step)
    caches = [torch.randn(batch, hkv, capacity, d, device="cuda").to(dtype) for _ in range(2)]
    return RopeCase(splits, workspace, rope, caches, [c.clone() for c in caches])


def on_float64(op, x, pro, lin, case: RopeCase, tail: tuple) -> tuple:
    """`op` (a reference) on float64 copies of x, the prologue's tensors, the RoPE tables and the caches, with the
    same int4 weights: (its outputs, the float64 caches it wrote)."""
    cos, sin, slot, pad = case.rope
    pro64 = tuple(t.double() if isinstance(t, torch.Tensor) else t for t in pro)
    caches64 = [c.double() for c in case.caches]
    return op(x.double(), *pro64, *lin.args(), cos.double(), sin.double(), slot, pad, *caches64, *tail), caches64


def assert_q_and_caches(q, q_ref, q64, caches, ref_caches, caches64, slot: int):
    """q and the K/V caches of an op with the RoPE + cache epilogue against its reference in the working dtype and
    on float64 copies: the 2x rule for q and the slot's new rows, and no other cache row changed."""
    assert_within_torch_error(q, q_ref, q64, "q")
    for got, low, r64 in zip(caches, ref_caches, caches64):
        assert_within_torch_error(got, low, r64, "cache")
        untouched = torch.ones(got.shape[2], dtype=torch.bool, device=got.device)
        untouched[slot] = False
        assert torch.equal(got[:, :, untouched], low[:, :, untouched]), "only the slot's cache row may change"


ARCHS = {  # heads q, kv, head_dim, rotary dim, interleaved, q/k/v as separate segments, bias
    "pythia-2.8b": (32, 32, 80, 20, True, False, True),
    "llama-8b-gqa": (32, 8, 128, 128, False, True, False),
    "qwen2-1.5b": (12, 2, 128, 128, False, True, True),
    "smollm2": (9, 3, 64, 64, False, True, False),
    "head-72": (6, 2, 72, 36, False, True, False),  # no whole-warp tile of whole heads: the CUDA-core kernel
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("prologue", ["none", "add_rms", "add2_dual_layer"])
def test_int4_qkv_rope_cache(prologue, batch, arch, dtype):
    from patcher.ops import KERNELS, reference

    hq, hkv, d, rot, interleaved, separate, bias = ARCHS[arch]
    k = min(hq * d, 4096)
    widths = [hq * d, hkv * d, hkv * d] if separate else [(hq + 2 * hkv) * d]
    lin = gptq_linear(k, widths, 128, bias=bias)
    case = rope_case(lin, batch, hkv, d, rot, dtype, capacity=48, slot=29, pad_step=5)
    splits, workspace, rope, caches, ref_caches = case
    x, pro = prologue_args(prologue, batch, k, dtype)
    heads = (hq, hkv, d, interleaved, splits, workspace)
    (q64, _, _), caches64 = on_float64(reference.int4_qkv_rope_cache, x, pro, lin, case, heads)
    poison_cuda_cache()
    q, total, h2 = KERNELS.int4_qkv_rope_cache(x, *pro, *lin.args(), *rope, *caches, *heads)
    q_ref, total_ref, h2_ref = reference.int4_qkv_rope_cache(x, *pro, *lin.args(), *rope, *ref_caches, *heads)
    # q and the new cache rows come from one int4 product each: the same tolerance as int4_gemv's output, checked
    # against the reference run on float64 copies (cos/sin/x/norm weights in float64, the same int4 weights).
    assert_q_and_caches(q, q_ref, q64, caches, ref_caches, caches64, slot=29)
    assert torch.equal(total, total_ref) and h2.shape == h2_ref.shape
    if h2.numel():  # LayerNorm's second output, computed as launch_norm computes it
        assert max_err(h2, h2_ref) <= 1e-2 * max(1.0, h2_ref.abs().max().item())
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0


QKV_MLP = {  # heads q, kv, head_dim, rotary dim, interleaved, q/k/v segments, MLP width, group size, bias
    "pythia-2.8b": (32, 32, 80, 20, True, 1, 10240, 128, True),
    "tiny-neox": (4, 4, 64, 16, True, 1, 1000, 64, True),  # an MLP of 6.25 tiles of 160 columns
    "split-qkv": (6, 2, 64, 64, False, 2, 768, 32, False),  # q | k and v as two segments
    "act-order": (4, 4, 80, 20, True, 1, 640, 64, False),  # the CUDA-core kernel
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("arch", list(QKV_MLP))
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("prologue", ["layer", "add2_dual_layer", "in_front"])
def test_int4_qkv_mlp_in(prologue, batch, arch, dtype):
    """GPT-NeoX's parallel residual in one launch: QKV with RoPE and the cache writes from the first LayerNorm, the
    MLP's input projection with its GELU from the second; tiles of both in one grid (K slices, shared counters).
    "in_front": both LayerNorms by int4_norm_prologue, the op's QKV tiles reading its h and its MLP tiles h2 (the
    decode step), against the same reference."""
    from patcher.ops import KERNELS, reference

    hq, hkv, d, rot, interleaved, qkv_segments, mlp, group, bias = QKV_MLP[arch]
    k = hq * d
    qkv = [(hq + 2 * hkv) * d] if qkv_segments == 1 else [(hq + hkv) * d, hkv * d]
    lin = gptq_linear(k, [*qkv, mlp], group, act_order=arch == "act-order", bias=bias)
    case = rope_case(lin, batch, hkv, d, rot, dtype, capacity=40, slot=17, pad_step=3)
    splits, workspace, rope, caches, ref_caches = case
    x, pro = prologue_args("add2_dual_layer", batch, k, dtype)
    if prologue == "layer":  # the first layer: both LayerNorms of x, no add
        pro = (None, None, *pro[2:])
    tail = (hq, hkv, d, interleaved, qkv_segments, "gelu", splits, workspace)
    (q64, hidden64, _), caches64 = on_float64(reference.int4_qkv_mlp_in, x, pro, lin, case, tail)
    poison_cuda_cache()
    if prologue == "in_front":
        h, total, h2 = KERNELS.int4_norm_prologue(x, *pro)
        no_prologue = (None,) * 6 + (0.0, False)
        q, hidden, empty = KERNELS.int4_qkv_mlp_in(h, *no_prologue, *lin.args(), *rope, *caches, *tail, h2)
        assert empty.numel() == 0
    else:
        q, hidden, total = KERNELS.int4_qkv_mlp_in(x, *pro, *lin.args(), *rope, *caches, *tail)
    q_ref, hidden_ref, total_ref = reference.int4_qkv_mlp_in(x, *pro, *lin.args(), *rope, *ref_caches, *tail)
    assert_q_and_caches(q, q_ref, q64, caches, ref_caches, caches64, slot=17)
    assert_within_torch_error(hidden, hidden_ref, hidden64, "MLP hidden")
    assert torch.equal(total, total_ref)  # the residual sum, rounded as torch rounds it
    assert int(workspace[: int4_ops.COUNTERS].abs().sum()) == 0


def test_int4_qkv_mlp_in_bad_inputs(kernels):
    lin = gptq_linear(256, [768, 512], 64)
    workspace = torch.zeros(int4_ops.workspace_numel(2, lin, 2, 64), dtype=torch.int32, device="cuda")
    x, pro = prologue_args("add2_dual_layer", 2, 256, torch.float16)
    cos, sin = rope_tables((16, 8), torch.float16)
    caches = [torch.zeros(2, 4, 16, 64, device="cuda").half() for _ in range(2)]
    rope = (cos, sin, torch.tensor([3], device="cuda"), torch.zeros(2, dtype=torch.long, device="cuda"), *caches)
    args = (x, *pro, *lin.args(), *rope, 4, 4, 64, True)
    torch.library.opcheck(torch.ops.patcher.int4_qkv_mlp_in.default, (*args, 1, "gelu", 2, workspace))
    with pytest.raises(RuntimeError, match="q/k/v segments"):
        kernels.int4_qkv_mlp_in(*args, 2, "gelu", 2, workspace)
    with pytest.raises(RuntimeError, match="gelu"):
        kernels.int4_qkv_mlp_in(*args, 1, "silu_mul", 2, workspace)
    with pytest.raises(RuntimeError, match="both LayerNorms"):
        kernels.int4_qkv_mlp_in(x, *pro[:4], None, None, *pro[6:], *lin.args(), *rope, 4, 4, 64, True, 1, "gelu", 2,
                                workspace)  # fmt: skip
    with pytest.raises(RuntimeError, match="x2 only without the norm prologue"):
        kernels.int4_qkv_mlp_in(*args, 1, "gelu", 2, workspace, x)
    no_prologue = (None,) * 6 + (0.0, False)
    with pytest.raises(RuntimeError, match="x2 .* must match x"):
        kernels.int4_qkv_mlp_in(x, *no_prologue, *lin.args(), *rope, 4, 4, 64, True, 1, "gelu", 2, workspace, x[:1])


def test_int4_norm_prologue_bad_inputs(kernels):
    x, pro = prologue_args("add2_dual_layer", 2, 256, torch.float16)
    torch.library.opcheck(torch.ops.patcher.int4_norm_prologue.default, (x, *pro))
    with pytest.raises(RuntimeError, match="needs norm_weight"):
        kernels.int4_norm_prologue(x, None, None, None, None, None, None, 1e-5, False)
    with pytest.raises(RuntimeError, match="one token per row"):
        kernels.int4_norm_prologue(x[None], *pro)
    with pytest.raises(RuntimeError, match="1 to 8 rows"):
        kernels.int4_norm_prologue(x.repeat(5, 1), None, None, *pro[2:])
    with pytest.raises(RuntimeError, match="delta"):
        kernels.int4_norm_prologue(x, pro[0][:1], *pro[1:])
