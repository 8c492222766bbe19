"""The int4 decode step as one persistent kernel (kernels/step.cuh, patcher/decode/step.py).

CPU: the work split the kernel uses (mirrored in step.py) gives every unit of a stage to exactly one block and
keeps a block's units of a strip together, and the runner says why the kernel is not used off the GPU.
GPU (Hopper): one decode step through the kernel against the same step op by op and against an fp32 run (the 2x
rule of conftest), over architectures, dtypes, group sizes, batch sizes with left padding and cache positions; the
K/V it writes into the cache; the graph-captured decode equal to the eager one, token for token; models the
kernel cannot take keep the per-op step and say why.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import HAS_CUDA, assert_within_torch_error, max_err
from test_gptq import gptq_model

from patcher import patch_model
from patcher.decode import DecodeRunner, Sampling, generate_path
from patcher.decode import step as step_mod

HOPPER = HAS_CUDA and torch.cuda.get_device_capability()[0] == 9
requires_hopper = pytest.mark.skipif(not HOPPER, reason="needs a Hopper GPU (sm_90)")


@pytest.mark.parametrize(
    "blocks,strips0,ku0,strips1,ku1",
    [
        (132, 60, 10, 80, 10),  # Pythia-2.8B: QKV and the MLP's first linear
        (132, 20, 10, 20, 40),  # Pythia-2.8B: the attention output and the MLP's second linear, K 2560 and 10240
        (132, 5, 3, 0, 1),  # fewer units than blocks
        (132, 32, 56, 0, 1),  # Llama-3.1-8B down
        (4, 3, 3, 2, 2),
        (7, 7, 1, 0, 1),
        (5, 1, 1, 0, 1),
    ],
)
def test_work_split_covers_every_unit_once(blocks, strips0, ku0, strips1, ku1):
    """Each unit is in exactly one block's run (owner agrees with run_start); the run's pieces cover it, one piece
    per strip (its last strip first), and the blocks sharing a strip are consecutive."""
    split = step_mod.StageSplit(blocks, strips0, ku0, strips1, ku1)
    seen = []
    for b in range(blocks):
        u0, u1 = split.run_start(b), split.run_start(b + 1)
        if u1 == u0:
            continue
        pieces = split.pieces(u0, u1)
        order = [u for _, first, count in pieces for u in range(first, first + count)]
        assert sorted(order) == list(range(u0, u1))
        assert all(split.owner(u) == b and split.strip_of(u) == s for s, f, n in pieces for u in range(f, f + n))
        strips = [s for s, _, _ in pieces]
        assert len(strips) == len(set(strips)), f"block {b}: a strip in two pieces {strips}"
        assert strips[0] == split.strip_of(u1 - 1) and (len(strips) == 1 or strips[1] == split.strip_of(u0))
        seen += order
    assert sorted(seen) == list(range(split.units))
    for strip in range(strips0 + strips1):
        units = range(split.first_unit(strip), split.last_unit(strip) + 1)
        assert len(units) == (ku0 if strip < strips0 else ku1)
        owners = {split.owner(u) for u in units}
        assert owners == set(range(min(owners), max(owners) + 1))


def test_runner_says_why_the_step_kernel_is_not_used_on_the_cpu(tmp_path, monkeypatch):
    model = gptq_model("tiny-llama", tmp_path)
    patch_model(model)
    runner = DecodeRunner(model, use_graphs=False)
    ids = torch.randint(3, 500, (1, 5))
    runner.generate(ids, torch.ones_like(ids), 3, Sampling(), eos=[], pad_token_id=0)
    assert runner.step_kernel_reason(1).startswith("off (opt-in")  # CPU runners never use it
    assert "no decode step" in runner.step_kernel_reason(2)
    assert step_mod.model_reason(runner) == "not a CUDA model"
    assert not step_mod.enabled()
    monkeypatch.setenv("PATCHER_STEP_KERNEL", "1")
    assert step_mod.enabled() and DecodeRunner(model, use_graphs=False).use_step_kernel is False  # (a CPU model)


# ---- GPU ---------------------------------------------------------------------------------------------------------


def decode_step_logits(runner, batch, ctx, pads, seed, steps=1):
    """The logits of `steps` decode steps from position ctx on random caches and tokens (the same for every runner
    of the same model, whatever its dtype); also the K and V each step wrote."""
    st = runner.state_for(batch, ctx + steps + 1)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(st.k.shape, generator=g).to(torch.float16)  # fp16 values, exact in every runner's dtype
    v = torch.randn(st.v.shape, generator=g).to(torch.float16)
    st.k.copy_(k)
    st.v.copy_(v)
    st.pad.copy_(torch.tensor(pads, dtype=torch.long))
    tokens = torch.randint(3, runner.config.vocab_size, (batch, steps), generator=g)
    logits, written = [], []
    with torch.no_grad():
        for i in range(steps):
            st.slot.fill_(ctx + i)
            st.tokens[:, ctx + i].copy_(tokens[:, i])
            logits.append(runner.logits(st).float())
            written.append(torch.stack([st.k[:, :, :, ctx + i], st.v[:, :, :, ctx + i]]).float())
    return logits, written


CASES = [  # (model, dtype, group size, batch, context, pads)
    ("tiny-llama", torch.float16, 64, 1, 9, [0]),
    ("tiny-llama", torch.bfloat16, 128, 3, 40, [0, 5, 17]),
    ("tiny-qwen2", torch.float16, 128, 2, 300, [0, 250]),
    ("tiny-qwen2", torch.bfloat16, -1, 1, 17, [0]),
    ("tiny-pythia", torch.float16, 64, 3, 33, [2, 0, 30]),
    ("tiny-pythia", torch.bfloat16, 128, 1, 130, [0]),
    ("tiny-neox-sequential", torch.float16, -1, 2, 12, [0, 3]),
    ("tiny-neox-sequential", torch.bfloat16, 64, 8, 7, [0, 1, 2, 3, 4, 5, 6, 0]),
]


@requires_hopper
@pytest.mark.parametrize("name,dtype,group_size,batch,ctx,pads", CASES)
def test_step_kernel_matches_the_per_op_step(name, dtype, group_size, batch, ctx, pads, tmp_path):
    """Three decode steps through the step kernel, op by op in the same dtype, and op by op in fp32 (the reference):
    logits and the K/V written into the cache within the 2x rule."""
    runs = {}
    for key, run_dtype, use_step in (("kernel", dtype, True), ("ops", dtype, False), ("ref", torch.float32, False)):
        model = gptq_model(name, tmp_path / key, dtype=run_dtype, device="cuda", group_size=group_size)
        patch_model(model)
        runner = DecodeRunner(model, use_graphs=False, use_step_kernel=use_step)
        runs[key] = decode_step_logits(runner, batch, ctx, pads, seed=11, steps=3)
        if use_step:
            assert runner.step_kernel_reason(batch) is None, runner.step_kernel_reason(batch)
    for i in range(3):
        for what, j in (("logits", 0), ("k/v", 1)):
            got, low, ref = (runs[key][j][i] for key in ("kernel", "ops", "ref"))
            assert_within_torch_error(got.to(dtype), low.to(dtype), ref, f"{name} step {i} {what}")


@requires_hopper
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_step_kernel_graph_replay_equals_eager(name, tmp_path):
    """generate (graph-captured step kernel) gives the eager step kernel's tokens exactly: the kernel is
    deterministic (partial sums meet in block order) and captures with its cooperative launch."""
    model = gptq_model(name, tmp_path, dtype=torch.float16, device="cuda", group_size=128)
    patch_model(model)
    ids = torch.randint(3, 500, (3, 13), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    eager = DecodeRunner(model, use_graphs=False, use_step_kernel=True)
    eager = eager.generate(ids, mask, 40, Sampling(), eos=[], pad_token_id=0)
    model._patcher_state.runner = DecodeRunner(model, use_step_kernel=True)
    graph = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    path = generate_path(model)
    assert path["path"] == "graph" and path["step_kernel"], path
    assert torch.equal(graph, eager)
    again = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert torch.equal(again, graph)


@requires_hopper
def test_models_the_step_kernel_cannot_take_keep_the_per_op_step(tmp_path, monkeypatch):
    """Group size 32 (a step of the kernel's mma spans 64 k): the per-op step runs, with the reason recorded."""
    monkeypatch.setenv("PATCHER_STEP_KERNEL", "1")
    model = gptq_model("tiny-llama", tmp_path, dtype=torch.float16, device="cuda", group_size=32)
    patch_model(model)
    ids = torch.randint(3, 500, (1, 7), device="cuda")
    out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    path = generate_path(model)
    assert out.shape == (1, 15) and not path["step_kernel"]
    assert "group size" in path["step_kernel_reason"]


def real_size_int4(name, layers, dtype=torch.float32):
    """A real-shape model with `layers` layers and random int4 g128 weights (the speed benchmark's), on the GPU."""
    from transformers import AutoModelForCausalLM

    from patcher import random_models as rm

    cfg = rm.config(name)
    cfg.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    return rm.quantize_random(model, 128)


@requires_hopper
@pytest.mark.parametrize("name", ["pythia-2.8b", "llama-3.1-8b"])
@pytest.mark.parametrize("layers", [1, 3])
def test_step_kernel_stages_at_real_size(name, layers):
    """Real shapes: each stage's output buffer of the last layer against the fp32 reference ops applied to the
    kernel's own inputs of that stage (so a fault shows where it is): QKV, attention with RoPE and the cache write,
    the output projection, the MLP's two linears, and the residual sum the second norm takes (sequential). And the
    kernel writes nothing into the model's tensors."""
    from patcher.ops import reference as ref

    model = real_size_int4(name, layers, torch.float16)
    patch_model(model)
    named = [*model.named_parameters(), *model.named_buffers()]
    tensors = {n: t.double().sum().item() for n, t in named}
    runner = DecodeRunner(model, use_graphs=False, use_step_kernel=True)
    logits, _ = decode_step_logits(runner, 1, 200, [0], seed=3)
    assert runner.step_kernel_reason(1) is None and torch.isfinite(logits[0]).all()
    changed = [n for n, t in named if t.double().sum().item() != tensors[n]]
    assert not changed, f"the step kernel wrote into {changed[:5]}"
    st = runner.states[1]
    sk, layer, last = st.step_kernel, runner.layers[-1], layers - 1
    a, m = layer.attention, layer.mlp
    (w1, b1, eps), (w2, b2, _) = layer.norms
    f32 = [None if t is None else t.float() for t in (w1, b1, w2, b2)]

    def linear(x, lin, act="none"):
        return ref.int4_gemv(x.float(), *([None] * 6), 0.0, False, *lin.args(), act, 1, None)[0]

    faults = []  # every stage is checked, so that the message shows all that are off

    def check(got, want, what):
        err, scale = max_err(got.float(), want), want.abs().max().item()
        if not err <= 1e-2 * scale:
            faults.append(f"{what}: max error {err:.3g} against max |ref| {scale:.3g}")

    # The last layer's input: the residual sum its first stage wrote (or the embedding row, for one layer).
    x = sk.resid[sk.final if runner.parallel else sk.final ^ 1].float()
    h1 = ref._rms(x, f32[0], eps) if runner.rms else ref.layer_norm(x, f32[0], f32[1], eps)
    check(sk.qkv, linear(h1, a.qkv_int4), "qkv")
    slot = int(st.slot)
    k_cache, v_cache = st.k[last].float(), st.v[last].float()  # the kernel wrote slot: compare, then recompute
    k_got, v_got = k_cache[:, :, slot].clone(), v_cache[:, :, slot].clone()
    cos, sin = st.cos.float(), st.sin.float()
    q = ref.rope_qkv_cache(sk.qkv.float(), cos, sin, st.slot, st.pad, k_cache, v_cache, a.num_heads, a.num_kv_heads,
                           a.head_dim, a.interleaved)  # fmt: skip
    check(k_got, k_cache[:, :, slot], "k written into the cache")
    check(v_got, v_cache[:, :, slot], "v written into the cache")
    check(sk.attn, ref.decode_attention(q, k_cache, v_cache, st.slot, st.pad, layer.scale, 1, None), "attention")
    check(sk.delta[0], linear(sk.attn, a.out_int4), "attention output projection")
    if runner.parallel:
        h2 = ref.layer_norm(x, f32[2], f32[3], eps)
    else:
        s2 = (sk.resid[sk.final ^ 1] + sk.delta[0]).float()  # HF's fp16 residual add, which block 0 wrote
        check(sk.resid[sk.final], s2, "residual sum")
        h2 = ref._rms(s2, f32[2], eps)
    check(sk.act, linear(h2, m.in_int4, layer.mlp_act), "MLP first linear and activation")
    check(sk.delta[1], linear(sk.act, m.out_int4), "MLP second linear")
    assert not faults, f"{name}: " + "; ".join(faults)


@requires_hopper
@pytest.mark.parametrize("name", ["pythia-2.8b", "llama-3.1-8b"])
def test_step_kernel_at_real_size(name):
    """Real shapes with random int4 weights (the speed benchmark's model), two layers: the step kernel's logits
    within the 2x rule of the per-op step against fp32."""
    ref_model = real_size_int4(name, 2)
    half_model = copy.deepcopy(ref_model).half()  # the same int4 weights (int32, fp16 scales), fp16 elsewhere
    logits = {}
    for key, model, use_step in (("ops", half_model, False), ("kernel", half_model, True), ("ref", ref_model, False)):
        if not hasattr(model, "_patcher_state"):
            patch_model(model)
        runner = DecodeRunner(model, use_graphs=False, use_step_kernel=use_step)
        logits[key] = decode_step_logits(runner, 1, 100, [0], seed=5, steps=2)[0]
        if use_step:
            assert runner.step_kernel_reason(1) is None, runner.step_kernel_reason(1)
    for i in range(2):
        assert_within_torch_error(logits["kernel"][i].half(), logits["ops"][i].half(), logits["ref"][i], f"{name} {i}")
    assert max_err(logits["kernel"][0], logits["ops"][0]) > 0  # two different kernels, not the same path twice


@requires_hopper
@pytest.mark.parametrize("name", ["pythia-2.8b", "llama-3.1-8b"])
def test_residual_stream_at_real_size(name):
    """The residual stream after the last of 3 layers (what the final norm reads: residual + deltas) through the
    step kernel and through the per-op CUDA layers, each within the 2x rule of the pure-torch reference ops in fp16,
    against the same ops in fp32, on the same input rows and caches."""
    half_model = real_size_int4(name, 3, torch.float16)
    ref_model = copy.deepcopy(half_model)
    for p in ref_model.parameters():  # fp32 activations; the GPTQ buffers stay as they are
        p.data = p.data.float()
    torch_model = copy.deepcopy(half_model)
    totals = {}
    runs = (
        ("per-op kernels", half_model, False, "kernels"),
        ("step kernel", half_model, True, "kernels"),
        ("torch fp16", torch_model, False, "reference"),
        ("torch fp32", ref_model, False, "reference"),
    )
    for key, model, use_step, backend in runs:
        if not hasattr(model, "_patcher_state"):
            patch_model(model, backend=backend)
        runner = DecodeRunner(model, use_graphs=False, use_step_kernel=use_step)
        decode_step_logits(runner, 1, 100, [0], seed=5)  # caches, tokens and slot
        st = runner.states[1]
        x = torch.randn(1, runner.hidden, generator=torch.Generator().manual_seed(9)).to(torch.float16).to(st.k)
        with torch.no_grad():
            outs = st.step_kernel.run(x) if use_step else runner._layers(x, st)
        totals[key] = sum(t.float() for t in outs if t is not None)
    errors = {key: f"{max_err(totals[key], totals['torch fp32']):.3g}" for key in totals}
    print(f"{name}: max error against torch fp32 {errors}")
    low, ref = totals["torch fp16"].half(), totals["torch fp32"]
    for key in ("per-op kernels", "step kernel"):
        assert_within_torch_error(totals[key].half(), low, ref, f"{name} {key}")
