"""The int4 step's fused accumulators: fixed-point partial sums, the output projections' unmet sums handed on, and
the norms in front of int4 linears (CPU reference backend; on the GPU the int4 kernels and the graph-captured decode).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    FP32_LOGIT_ATOL,
    max_err,
)
from gptq_models import EAGER, gptq_model

from patcher import patch_model
from patcher.decode import DecodeOptions, DecodeRunner, Sampling
from patcher.gptq.pack import quantize


def test_fixed_point_accumulators():
    """int4_gemv_acc's fixed point (value * 2^28 in int64): exact for fp32 values of magnitude 2^-5 or more, the
    rest within half a step of 2^-28; clamped to +-2^24 (NaN to -2^24), so 2^11 - 1 clamped terms still add up."""
    from patcher.ops.reference import FIXED_CLAMP, from_fixed, to_fixed

    v = torch.randn(10000) * torch.logspace(-12, 6, 10000, base=2.0)
    back = from_fixed(to_fixed(v), torch.float32)
    big = v.abs() >= 2.0**-5
    assert big.sum() > 1000 and torch.equal(back[big], v[big])
    assert (back[~big] - v[~big]).abs().max() <= 2.0**-29
    edge = to_fixed(torch.tensor([1e9, -1e9, float("nan"), float("inf")]))
    assert from_fixed(edge, torch.float32).tolist() == [FIXED_CLAMP, -FIXED_CLAMP, -FIXED_CLAMP, FIXED_CLAMP]
    assert from_fixed(edge[:1] * (2**11 - 1), torch.float32).item() == FIXED_CLAMP * (2**11 - 1)  # no overflow


def _quantized(n, k, group):
    """The int4 argument tuple (qweight, qzeros, scales, g_idx, bias, group, act_order, zero_offset) of a random
    [n, k] weight, one segment, no bias."""
    q = quantize(torch.randn(n, k) / k**0.5, group, sym=False)
    return [q["qweight"]], [q["qzeros"]], [q["scales"]], [q["g_idx"]], [None], group, False, 1


def test_int4_gemv_acc_reference():
    """CPU: int4_gemv_acc adds [x | x2] @ W into acc without rounding, bias or epilogue, zeroes `clear`, and rejects
    a bias; an int4 op reading acc as its prologue's delta, with the bias rows as delta2, computes what it computes
    from int4_gemv_cat's rounded, biased output."""
    from patcher.ops import KERNELS, reference

    torch.manual_seed(0)
    k1, k2, n = 128, 256, 96
    args = _quantized(n, k1 + k2, 64)
    bias = torch.randn(n).half()
    biased = (*args[:4], [bias], *args[5:])
    x, x2 = torch.randn(2, k1).half(), torch.randn(2, k2).half()
    start = torch.randint(-(2**40), 2**40, (2, n))
    acc, clear = start.clone(), torch.randint(1, 9, (5,))
    torch.library.opcheck(torch.ops.patcher.int4_gemv_acc.default, (x, x2, *args, 1, None, acc.clone(), clear.clone()))
    # the CPU dispatch: the reference (feeds_attention, as the decode step passes it, only places the CUDA trigger)
    KERNELS.int4_gemv_acc(x, x2, *args, 1, None, acc, clear, feeds_attention=True)
    assert int(clear.abs().sum()) == 0
    w = reference.int4_weight(args[0][0], args[1][0], args[2][0], args[3][0], 64, False, 1)
    exact = torch.cat([x, x2], -1).double() @ w.double()
    added = (acc - start).double() / reference.FIXED_SCALE
    assert (added - exact).abs().max() <= 1e-5 * exact.abs().max()
    with pytest.raises(ValueError, match="no bias"):
        reference.int4_gemv_acc(x, x2, *biased, 1, None, acc)
    with pytest.raises(ValueError, match="acc must be int64"):
        reference.int4_gemv_acc(x, x2, *args, 1, None, acc[:, :8])

    acc = torch.zeros(2, n, dtype=torch.int64)
    reference.int4_gemv_acc(x, x2, *args, 1, None, acc)
    out = reference.int4_gemv_cat(x, x2, *biased, 1, None)
    residual, norm_w = torch.randn(2, n).half(), torch.rand(n).half() + 0.5
    reader = (*_quantized(32, n, 32), "none", 1, None)
    norm = (norm_w, None, None, None, 1e-6, True)
    from_acc = reference.int4_gemv(residual, acc, bias.expand(2, n).contiguous(), *norm, *reader)
    from_out = reference.int4_gemv(residual, out, None, *norm, *reader)
    # round(round(bias + round(acc)) + residual) against round(round(round(acc) + bias) + residual): the same sums,
    # but where the fp32 product and the fp16 matmul round the last bit apart
    assert max_err(from_acc[1], from_out[1]) <= 2e-3 * from_out[1].abs().max()
    assert max_err(from_acc[0], from_out[0]) <= 2e-3 * from_out[0].abs().max()


def test_qkv_acc_reference():
    """CPU: the QKV projection handed on unmet and finished by the attention (runner.py) against the op it replaces:
    int4_norm_gemv_acc gives int4_gemv's residual sum and the product unrounded in acc; decode_attention_qkv_acc
    over it (the bias as rows) writes the current token's K/V at slot only and attends as decode_attention does over
    int4_gemv's rounded, biased output through rope_qkv_cache (within fp16 rounding: the fixed point may round a last
    bit apart)."""
    from patcher.ops import KERNELS, reference

    torch.manual_seed(0)
    hq, hkv, d, k, slot = 4, 2, 8, 64, 5
    n = (hq + 2 * hkv) * d
    args = _quantized(n, k, 32)
    bias = torch.randn(n).half()
    biased = (*args[:4], [bias], *args[5:])
    x, delta, w = torch.randn(2, k).half(), torch.randn(2, k).half(), torch.rand(k).half() + 0.5
    pro = (x, delta, None, w, None, None, None, 1e-6, True)
    acc, clear = torch.zeros(2, n, dtype=torch.int64), torch.ones(7, dtype=torch.int64)
    ops = torch.ops.patcher
    torch.library.opcheck(ops.int4_norm_gemv_acc.default, (*pro, *args, 1, None, acc.clone(), clear.clone()))
    total, h2 = KERNELS.int4_norm_gemv_acc(*pro, *args, 1, None, acc, clear)  # the CPU dispatch: the reference
    qkv, total_ref, _ = reference.int4_gemv(*pro, *biased, "none", 1, None)
    assert torch.equal(total, total_ref) and h2.numel() == 0 and int(clear.abs().sum()) == 0

    angles = torch.randn(16, d // 2) * 3
    cos, sin = torch.cat([angles, angles], -1).cos().half(), torch.cat([angles, angles], -1).sin().half()
    caches = [torch.randn(2, hkv, 16, d).half() for _ in range(2)]
    expected_caches = [c.clone() for c in caches]
    slots, pad = torch.tensor([slot]), torch.tensor([0, 2])
    rows = bias.expand(2, n).contiguous()
    tail = (hq, False, d**-0.5, 1, None)
    torch.library.opcheck(ops.decode_attention_qkv_acc.default,
                          (acc, rows, cos, sin, slots, pad, *[c.clone() for c in caches], *tail))  # fmt: skip
    out = KERNELS.decode_attention_qkv_acc(acc, rows, cos, sin, slots, pad, *caches, *tail)
    q = reference.rope_qkv_cache(qkv, cos, sin, slots, pad, *expected_caches, hq, hkv, d, False)
    expected = reference.decode_attention(q, *expected_caches, slots, pad, d**-0.5, 1, None)
    assert max_err(out, expected) <= 4e-3 * expected.abs().max()
    keep = torch.arange(16) != slot
    for got, want in zip(caches, expected_caches):
        assert torch.equal(got[:, :, keep], want[:, :, keep])
        assert max_err(got[:, :, slot], want[:, :, slot]) <= 4e-3 * want[:, :, slot].abs().max()


def deferred_expected(runner) -> set:
    """The (kind, layer) producers that should run as int4_gemv_acc (with defer_qkv also the QKV projections, as
    int4_norm_gemv_acc) in an all-int4 model (decode/int4_plan.py)."""
    step = runner.decode_step
    layers = range(step.num_layers)  # the last layer's output projection too: the final norm reads its sums
    if step.parallel:
        return {("out", i) for i in layers}
    kinds = ("qkv", "attn_out", "mlp_out") if runner.options.defer_qkv else ("attn_out", "mlp_out")
    return {(kind, i) for kind in kinds for i in layers}


def check_accumulators(runner, batch: int) -> None:
    """After a step: each producer zeroes the accumulator of the producer of its kind before it, so of each kind only
    the last one's holds a sum (which the next step's first producer zeroes)."""
    st = runner.states[batch]
    for kind in {k for k, _ in st.deferred}:
        keys = sorted(key for key in st.deferred if key[0] == kind)
        assert all(st.deferred[key].clear is st.deferred[prev].acc for prev, key in zip(keys[-1:] + keys[:-1], keys))
        assert [bool(st.deferred[key].acc.any()) for key in keys] == [False] * (len(keys) - 1) + [True], kind


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia", "tiny-neox-sequential"])
def test_int4_output_projections_hand_on_unmet_sums(name, tmp_path):
    """CPU, reference backend: the decode step runs every int4 output projection whose output an int4 norm prologue
    reads as int4_gemv_acc (runner.py; the biases of GPT-NeoX's as the reader's delta2), and gives the tokens and
    logits of the step with the K slices meeting (defer_int4=False), over steps that reuse every accumulator; so
    does the step whose QKV projections the attention finishes too (defer_qkv, the default; LLaMA/Qwen2)."""
    model = gptq_model(name, tmp_path)
    patch_model(model)
    ids, mask = torch.randint(3, 500, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    results = {}
    with torch.no_grad():
        for defer in ("qkv", True, False):
            runner = DecodeRunner(model, EAGER.replace(defer_int4=bool(defer), defer_qkv=defer == "qkv"))
            assert set(runner.decode_step.int4.deferred) == (deferred_expected(runner) if defer else set())
            tokens = runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0)
            results[defer] = (tokens, runner.logits(runner.states[2]))
            if defer:
                check_accumulators(runner, 2)
                # as a step cut short would leave them: generate starts from zeros again
                for d in runner.states[2].deferred.values():
                    d.acc.random_(-(2**40), 2**40)
                assert torch.equal(runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0), tokens)
    for defer in ("qkv", True):
        assert torch.equal(results[defer][0], results[False][0])
        assert max_err(results[defer][1], results[False][1]) <= FP32_LOGIT_ATOL


def randomize_norms(model, seed=0):
    """Random weights and biases for every norm (HF initializes them to ones and zeros, which makes GPT-NeoX's two
    LayerNorms of a layer equal, so that a step reading one for the other would pass)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Norm"):
                module.weight.copy_(1 + 0.3 * torch.randn(module.weight.shape, generator=g))
                if getattr(module, "bias", None) is not None:
                    module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=g))


# (model, DecodeOptions fields, int4_norm_prologue calls a layer): every path of the step through an int4 norm op.
NORM_IN_FRONT = [
    ("tiny-llama", {}, 2),  # QKV as int4_gemv_acc (the attention finishes it), gate/up
    ("tiny-llama", {"defer_qkv": False}, 2),  # QKV as int4_qkv_rope_cache
    ("tiny-qwen2", {}, 2),
    ("tiny-pythia", {}, 1),  # both LayerNorms in front of int4_qkv_mlp_in
    ("tiny-pythia", {"merge_int4": False}, 1),  # ... of int4_qkv_rope_cache and the MLP's int4_gemv on h2
    ("tiny-neox-sequential", {}, 2),
]


@pytest.mark.parametrize("name,kwargs,per_layer", NORM_IN_FRONT)
def test_int4_norm_in_front(name, kwargs, per_layer, tmp_path, monkeypatch):
    """CPU, reference backend: from DecodeOptions.int4_separate_norm_batch rows on (every batch size by default),
    the decode step runs each int4 op's add + norm as int4_norm_prologue in front of it, the op reading h (and h2),
    and the final norm as int4_norm_prologue where the last layer's sums come unmet (at any batch size), and gives
    the tokens and logits of the step with the norms inside the ops (int4_separate_norm_batch above the batch
    size)."""
    model = gptq_model(name, tmp_path)
    randomize_norms(model)
    patch_model(model)
    ids, mask = torch.randint(3, 500, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    results = {}
    with torch.no_grad():
        for in_front in (True, False):
            options = EAGER.replace(int4_separate_norm_batch=2 if in_front else 9, **kwargs)
            runner = DecodeRunner(model, options)
            tokens = runner.generate(ids, mask, 8, Sampling(), eos=[], pad_token_id=0)
            calls = []
            ops = runner.decode_step.ops
            monkeypatch.setattr(
                ops, "int4_norm_prologue", lambda *a, f=ops.int4_norm_prologue, c=calls: c.append(1) or f(*a)
            )
            results[in_front] = (tokens, runner.logits(runner.states[2]))
            monkeypatch.undo()
            assert runner.states[2].int4_separate_norm == in_front
            layers = model.config.num_hidden_layers
            # and the final norm where the last layer's output projection leaves its sums unmet
            deferred = runner.decode_step.int4.deferred
            final = int(any(kind in ("mlp_out", "out") and i == layers - 1 for kind, i in deferred))
            assert len(calls) == (per_layer * layers if in_front else 0) + final
    assert torch.equal(results[True][0], results[False][0])
    assert torch.equal(results[True][1], results[False][1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-neox-sequential"])
def test_int4_unmet_sums_on_the_gpu(name, tmp_path):
    """GPU: the graph-captured decode with the int4 output projections as int4_gemv_acc leaves the accumulators
    zeroed in turn across replays, and one step on the same cache and tokens gives the logits of the step with the
    K slices meeting (defer_int4=False) within fp16 rounding (a missing bias, a stale or doubled sum: O(1) off); so
    does the step whose QKV projections the attention finishes too (defer_qkv, the default)."""
    model = gptq_model(name, tmp_path, False, dtype=torch.float16, device="cuda")
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    runners = {defer: DecodeRunner(model, DecodeOptions(defer_int4=defer, defer_qkv=False)) for defer in (True, False)}
    runners["qkv"] = DecodeRunner(model, DecodeOptions(defer_int4=True, defer_qkv=True))
    with torch.no_grad():
        for runner in runners.values():
            runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0)
            assert runner.states[3].graph is not None
        for defer in (True, "qkv"):
            assert set(runners[defer].decode_step.int4.deferred) == deferred_expected(runners[defer])
            check_accumulators(runners[defer], 3)
        states = {defer: runner.states[3] for defer, runner in runners.items()}
        for other in (False, "qkv"):
            for field in ("k", "v", "tokens", "slot", "pad"):
                getattr(states[other], field).copy_(getattr(states[True], field))
        logits = {defer: runners[defer].logits(states[defer]) for defer in runners}
    for defer in (True, "qkv"):
        assert max_err(logits[defer], logits[False]) <= 1e-2 * max(1.0, logits[False].abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("name,kwargs", [(name, kwargs) for name, kwargs, _ in NORM_IN_FRONT])
def test_int4_norm_in_front_on_the_gpu(name, kwargs, tmp_path):
    """GPU: the graph-captured decode (batch 3) with each int4 op's add + norm as int4_norm_prologue in front gives,
    one step on the same cache and tokens, the logits of the step with the norms inside the ops, within fp16
    rounding (the two compute each row's statistics in blocks of different sizes, so h may differ in its last bit)."""
    model = gptq_model(name, tmp_path, False, dtype=torch.float16, device="cuda")
    randomize_norms(model)
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    options = {front: DecodeOptions(int4_separate_norm_batch=2 if front else 9, **kwargs) for front in (1, 0)}
    runners = {front: DecodeRunner(model, options[front]) for front in (1, 0)}
    with torch.no_grad():
        for runner in runners.values():
            runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0)
            assert runner.states[3].graph is not None
        states = {front: runner.states[3] for front, runner in runners.items()}
        for field in ("k", "v", "tokens", "slot", "pad"):
            getattr(states[0], field).copy_(getattr(states[1], field))
        logits = {front: runners[front].logits(states[front]) for front in runners}
    assert states[1].int4_separate_norm and not states[0].int4_separate_norm
    assert max_err(logits[1], logits[0]) <= 1e-2 * max(1.0, logits[0].abs().max().item())
