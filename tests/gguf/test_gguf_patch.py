"""patch_model on models whose linears are GGUFLinear (small GGUF files written here, LLaMA and Qwen2; random GGUF
blocks for GPT-NeoX): every layer patched, each GGUF projection running its modules' own ops, the logits of the
unpatched model, and the decode runner's greedy tokens equal to HF's.

CPU, fp32, both W4A16 and W4A8. GPU: the same files on CUDA, the graph decode path in fp32 and fp16.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, max_err
from gguf_blocks import write_tiny_model

from patcher import load_gguf, patch_model, unpatch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, generate_path
from patcher.decode import generate as gen
from patcher.gguf import GGUFLinear
from patcher.gguf.random_weights import quantize_random
from patcher.layers.weights import GGUFProjection

pytest.importorskip("gguf")

EAGER = DecodeOptions(use_graphs=False)
TOKENS = torch.tensor([[3, 17, 42, 5, 60, 8, 23, 1, 33], [9, 9, 14, 50, 2, 7, 61, 30, 11]])
# The types of a Q4_K_M file: q/k/v of two types in one projection.
Q4_K_M = {
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q4_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
}
FILES = {"llama": ("llama", None), "qwen2": ("qwen2", None), "llama-q4_k_m": ("llama", Q4_K_M),
         "qwen2-q4_k_m": ("qwen2", Q4_K_M)}  # fmt: skip


@pytest.fixture(scope="module", params=list(FILES))
def tiny_file(request, tmp_path_factory):
    architecture, types = FILES[request.param]
    path = tmp_path_factory.mktemp(request.param) / "tiny.gguf"
    write_tiny_model(path, architecture, types)
    return path


def load(path, quantize_activations: bool, dtype=torch.float32, device=None):
    kwargs = {} if device is None else {"device_map": device}
    model = load_gguf(path, dtype=dtype, quantize_activations=quantize_activations, **kwargs)
    model.generation_config.eos_token_id = None
    return model


def dense_twin(layer: GGUFLinear) -> torch.nn.Linear:
    """An nn.Linear holding `layer`'s dequantized weight (the tiny files' linears have no bias)."""
    dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=False)
    dense.weight.data = layer.dequantize()
    return dense


def prompt(batch: int, device="cpu", vocab: int = 64, seed: int = 3):
    """Token ids [batch, 9] and a left-padded mask (row 0 padded by 3 where batch > 1)."""
    ids = torch.randint(3, vocab, (batch, 9), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    if batch > 1:
        mask[0, :3], ids[0, :3] = 0, 0
    return ids.to(device), mask.to(device)


def hf_greedy(model, ids, mask, new_tokens: int):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_patched_gguf_model_gives_the_unpatched_logits(tiny_file, quantize_activations):
    """Every layer patched, each projection a GGUFProjection over the file's modules (q/k/v of different types run
    apart); the logits of the unpatched model within fp32 tolerance; unpatch gives them back bit for bit."""
    model = load(tiny_file, quantize_activations)
    with torch.no_grad():
        expected = model(TOKENS).logits
        report = patch_model(model)
        got = model(TOKENS).logits
        attention = model.model.layers[0].self_attn
        plan = attention._patcher
        unpatch_model(model)
        again = model(TOKENS).logits
    assert report.layers_restructured == report.layers_total == 2 and report.fully_patched, str(report)
    assert report.fused_weights == 0  # nothing is concatenated: the blocks stay in their modules
    assert isinstance(plan.qkv_gguf, GGUFProjection) and plan.qkv_weight is None
    assert plan.qkv_gguf.modules == (attention.q_proj, attention.k_proj, attention.v_proj)
    assert plan.qkv_gguf.kinds == tuple(m.kind for m in plan.qkv_gguf.modules)
    details = " ".join(r.detail for r in report.replaced)
    assert f"GGUF q/k/v ({', '.join(plan.qkv_gguf.kinds)})" in details
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    assert torch.equal(again, expected)
    assert all(isinstance(m, GGUFLinear) for m in plan.qkv_gguf.modules)


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_decode_runner_on_gguf_model_gives_hf_greedy_tokens(tiny_file, quantize_activations):
    """The eager decode step (separate norms, each GGUF projection, rope_qkv_cache): HF's greedy tokens, batch 1, a
    left-padded batch 3, and a batch of 11, which the step runs as chunks of 8 and 3 rows (the GEMV takes 1 to 8)."""
    model = load(tiny_file, quantize_activations)
    cases = [prompt(1), prompt(3), prompt(11)]
    expected = [hf_greedy(model, ids, mask, 16) for ids, mask in cases]
    patch_model(model)
    runner = DecodeRunner(model, EAGER)
    assert runner.step_rows() == (8, "the GGUF decode GEMV (gguf_gemv) takes 1 to 8 rows")
    for (ids, mask), want in zip(cases, expected):
        assert torch.equal(runner.generate(ids, mask, 16, Sampling(), eos=[], pad_token_id=0), want)


class CountingOps:
    """The ops namespace of a decode step, counting the calls of each op by name."""

    def __init__(self, ops):
        self.ops, self.calls, self.feeding_attention = ops, {}, 0

    def __getattr__(self, name):
        op = getattr(self.ops, name)

        def counted(*args, **kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            self.feeding_attention += bool(kwargs.get("feeds_attention"))
            return op(*args, **kwargs)

        return counted


def test_decode_step_norms_write_the_gguf_inputs(tiny_file):
    """Each RMSNorm in front of a GGUF projection (QKV, gate/up, a GGUF head) runs in one op with it
    (gguf_norm_gemv_cat: on CUDA the norm writes the GEMV's Q8_1 input), the down projection's op computes the
    activation, and the attention ropes the QKV's output, writes the cache and writes the output projection's input
    (gguf_attention_gemv_cat, the QKV op marked as feeding it): no separate norm, activation, RoPE or attention op
    in a layer."""
    model = load(tiny_file, True)
    ids, mask = prompt(1)
    want = hf_greedy(model, ids, mask, 4)
    patch_model(model)
    runner = DecodeRunner(model, EAGER)
    runner.decode_step.ops = counting = CountingOps(runner.decode_step.ops)
    assert torch.equal(runner.generate(ids, mask, 4, Sampling(), eos=[], pad_token_id=0), want)
    layers = model.config.num_hidden_layers
    steps = counting.calls["gguf_attention_gemv_cat"] // layers
    assert steps >= 3 and counting.calls["gguf_attention_gemv_cat"] == steps * layers
    head = runner.decode_step.lm_gguf is not None  # the final norm into a GGUF head: one more a step
    assert counting.calls["gguf_norm_gemv_cat"] == (2 * layers + head) * steps
    assert counting.feeding_attention == steps * layers  # the QKV's, not gate/up's or the head's
    assert counting.calls["gguf_silu_mul_gemv_cat"] == steps * layers
    separate = {"silu_and_mul", "rms_norm", "rope_qkv_cache", "decode_attention", "decode_attention_qkv"}
    assert not separate & set(counting.calls), counting.calls


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_prefill_rounds_the_activation_as_it_is_made(tiny_file, monkeypatch, quantize_activations):
    """Prefill (more than 8 rows) in W4A8: each gated MLP makes its GGUF down projection's input in one op, the
    activation rounded through Q8_1 as it is formed (round_q8_1 with silu_mul), with no silu_and_mul, and the
    logits are those of the activation and the rounding apart, bit for bit. W4A16 keeps silu_and_mul."""
    from patcher.ops import REFERENCE

    model = load(tiny_file, quantize_activations)
    patch_model(model)
    calls = {"silu_mul": 0, "silu_and_mul": 0}
    rounding, activation = REFERENCE.round_q8_1, REFERENCE.silu_and_mul

    def round_q8_1(x, silu_mul=False):
        calls["silu_mul"] += silu_mul
        return rounding(x, silu_mul)

    def silu_and_mul(x):
        calls["silu_and_mul"] += 1
        return activation(x)

    monkeypatch.setattr(REFERENCE, "round_q8_1", round_q8_1)
    monkeypatch.setattr(REFERENCE, "silu_and_mul", silu_and_mul)
    with torch.no_grad():
        got = model(TOKENS).logits
        layers = model.config.num_hidden_layers
        assert calls == ({"silu_mul": layers, "silu_and_mul": 0} if quantize_activations else
                         {"silu_mul": 0, "silu_and_mul": layers})  # fmt: skip
        monkeypatch.setattr(GGUFProjection, "silu_mul_gemm", lambda self, y: None)
        apart = model(TOKENS).logits
    assert torch.equal(got, apart)


@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_prefill_norms_round_the_gguf_inputs(tiny_file, monkeypatch, quantize_activations):
    """Prefill in W4A8: each RMSNorm in front of a GGUF projection (QKV, gate/up) rounds its output through Q8_1
    itself (rms_norm_q8_1) and the projection takes it as it is: the logits of the norm and the rounding apart, bit
    for bit. A hook on the attention sees the norm's plain output, rounded by the projection as before. W4A16 keeps
    the plain norms."""
    from patcher.layers.decoder import LayerPlan
    from patcher.ops import REFERENCE

    model = load(tiny_file, quantize_activations)
    patch_model(model)
    calls = []
    norm = REFERENCE.rms_norm_q8_1
    monkeypatch.setattr(REFERENCE, "rms_norm_q8_1", lambda *args: calls.append(args[1] is None) or norm(*args))
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        got = model(TOKENS).logits
        # the first layer's input norm has no residual to add; every other norm has one
        assert calls == ([True] + [False] * (2 * layers - 1) if quantize_activations else [])
        calls.clear()
        seen = []
        handle = model.model.layers[1].self_attn.register_forward_pre_hook(
            lambda m, args, kwargs: seen.append(kwargs["hidden_states"]), with_kwargs=True
        )
        hooked = model(TOKENS).logits
        handle.remove()
        assert isinstance(seen[0], torch.Tensor) and len(calls) == (2 * layers - 1 if quantize_activations else 0)
        with monkeypatch.context() as m:
            m.setattr(LayerPlan, "rounds", lambda self, module, norm_q8_1, x: False)
            apart = model(TOKENS).logits
    assert torch.equal(got, apart) and torch.equal(hooked, apart)


def test_gguf_model_generates_past_eight_rows(tiny_file, monkeypatch):
    """generate takes the runner for a batch of 9 (chunks of 8 and 1 rows) and gives HF's tokens (the CPU model
    stands in for a CUDA one: its runner runs eagerly)."""
    model = load(tiny_file, False)
    ids, mask = prompt(9)
    want = hf_greedy(model, ids, mask, 3)
    patch_model(model)
    model._patcher_state.runner = DecodeRunner(model, EAGER)
    monkeypatch.setattr(gen, "model_reason", lambda model: None)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert generate_path(model)["path"] == "eager-runner"
    assert torch.equal(got, want)


def test_gguf_and_dense_in_one_projection_stay_on_hf(tmp_path):
    """A file whose up projection transformers dequantizes (Q5_0) beside a GGUF gate; and a k_proj replaced by an
    nn.Linear: such a layer keeps HF's forward with the reason, and the logits do not change."""
    (tmp_path / "qwen2").mkdir()
    path = tmp_path / "qwen2" / "tiny.gguf"
    write_tiny_model(path, "qwen2", {"ffn_up": "Q5_0"})
    model = load(path, False)
    with torch.no_grad():
        expected = model(TOKENS).logits
        report = patch_model(model)
        got = model(TOKENS).logits
        unpatch_model(model)
    assert report.layers_restructured == 0 and len(report.unpatched) == 2
    reason = "gate_proj is GGUFLinear (Q5_K), up_proj is Linear: GGUF linears are read as one projection only"
    assert all(reason in r.detail for r in report.unpatched), str(report)
    assert torch.equal(got, expected)

    (tmp_path / "llama").mkdir()
    path = tmp_path / "llama" / "tiny.gguf"
    write_tiny_model(path, "llama")
    model = load(path, False)
    attention = model.model.layers[0].self_attn
    attention.k_proj = dense_twin(attention.k_proj)
    with torch.no_grad():
        expected = model(TOKENS).logits
        report = patch_model(model)
        got = model(TOKENS).logits
    assert report.layers_restructured == 1 and [r.name for r in report.unpatched] == ["model.layers.0"]
    assert "q_proj is GGUFLinear (Q4_0), k_proj is Linear, v_proj is GGUFLinear (Q8_0)" in report.unpatched[0].detail
    assert max_err(got, expected) <= FP32_LOGIT_ATOL


def test_a_gguf_projection_replaced_after_patching_runs_hf(tmp_path):
    """q_proj swapped for an nn.Linear after patching (an adapter would do so): that attention runs HF's forward,
    with a note, and the logits stay those of the unpatched model."""
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    model = load(path, False)
    patch_model(model)
    attention = model.model.layers[1].self_attn
    attention.q_proj = dense_twin(attention.q_proj)
    with torch.no_grad():
        got = model(TOKENS).logits
        state = model._patcher_state
        notes = list(state.report.messages)
        unpatch_model(model)
        expected = model(TOKENS).logits
    assert any("model.layers.1.self_attn: HF's forward runs" in note for note in notes), notes
    assert max_err(got, expected) <= FP32_LOGIT_ATOL


@pytest.mark.parametrize("name", ["tiny-pythia", "tiny-neox-sequential"])
def test_gpt_neox_with_gguf_linears(name):
    """GPT-NeoX (parallel and sequential residual, GELU MLP): random GGUF blocks in every linear, biases kept in the
    GGUFLinears; the patched logits and the decode runner's greedy tokens are the unpatched model's."""
    model = rm.build(name)
    model.generation_config.eos_token_id = None
    kinds = {"query_key_value": "Q4_1", "dense": "Q8_0", "dense_h_to_4h": "Q4_0", "dense_4h_to_h": "Q4_0"}
    quantize_random(model, kinds, quantize_activations=True)
    ids, mask = prompt(3, vocab=model.config.vocab_size)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
    tokens = hf_greedy(model, ids, mask, 12)
    report = patch_model(model)
    with torch.no_grad():
        got = model(ids, attention_mask=mask).logits
    assert report.fully_patched and report.layers_restructured == model.config.num_hidden_layers
    assert report.launches_per_layer["gguf_linear"] == 4 and "gemm" not in report.launches_per_layer
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    runner = DecodeRunner(model, EAGER)
    assert torch.equal(runner.generate(ids, mask, 12, Sampling(), eos=[], pad_token_id=0), tokens)


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_graph_generate_fp32_gives_hf_greedy_tokens(tiny_file, quantize_activations):
    """fp32 on CUDA: the patched model's generate takes the graph path and gives the unpatched model's greedy tokens
    (batch 1 and a left-padded batch 3); a batch of 9 takes the graph path too, as chunks of 8 and 1 rows."""
    model = load(tiny_file, quantize_activations, device="cuda")
    cases = [prompt(1, "cuda"), prompt(3, "cuda")]
    expected = [hf_greedy(model, ids, mask, 24) for ids, mask in cases]
    patch_model(model)
    for (ids, mask), want in zip(cases, expected):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert generate_path(model)["path"] == "graph", generate_path(model)
        assert torch.equal(got, want)
    # A batch of 9: the step runs chunks of 8 and 1 rows, whose tokens are those of the two batches run apart.
    ids, mask = prompt(9, "cuda")
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert generate_path(model)["path"] == "graph", generate_path(model)
    apart = [model.generate(i, attention_mask=m, max_new_tokens=8, do_sample=False, pad_token_id=0)
             for i, m in ((ids[:8], mask[:8]), (ids[8:], mask[8:]))]  # fmt: skip
    assert torch.equal(got, torch.cat(apart))


@pytest.mark.gpu
@pytest.mark.parametrize("quantize_activations", [False, True], ids=["w4a16", "w4a8"])
def test_graph_generate_fp16_equals_the_eager_step(tiny_file, quantize_activations):
    """fp16 on CUDA: the graph path, batch 1 to 8, replays exactly the tokens the same step gives eagerly (the
    K-quants' reference ops inside the capture included)."""
    model = load(tiny_file, quantize_activations, dtype=torch.float16, device="cuda")
    patch_model(model)
    for batch in (1, 3, 8):
        ids, mask = prompt(batch, "cuda")
        eager = DecodeRunner(model, EAGER).generate(ids, mask, 24, Sampling(), eos=[], pad_token_id=0)
        got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
        assert generate_path(model)["path"] == "graph", generate_path(model)
        assert torch.equal(got, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-pythia", "tiny-neox-sequential"])
def test_gpt_neox_graph_generate_fp32_gives_hf_greedy_tokens(name):
    """GPT-NeoX with random GGUF blocks on CUDA, fp32: the graph path (the parallel layer's MLP on its branch stream)
    gives the unpatched model's greedy tokens."""
    model = rm.build(name, dtype=torch.float32, device="cuda")
    model.generation_config.eos_token_id = None
    kinds = {"query_key_value": "Q4_1", "dense": "Q8_0", "dense_h_to_4h": "Q4_0", "dense_4h_to_h": "Q4_0"}
    quantize_random(model, kinds, quantize_activations=True)
    ids, mask = prompt(3, "cuda", vocab=model.config.vocab_size)
    expected = hf_greedy(model, ids, mask, 24)
    patch_model(model)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert generate_path(model)["path"] == "graph", generate_path(model)
    assert torch.equal(got, expected)
