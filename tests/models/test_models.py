"""Patched against unpatched on tiny random models of every variant (CPU), and in fp16/bf16 with the CUDA kernels.

CPU: the reference backend (pure torch) and the `kernels` backend (the patcher:: ops through the dispatcher,
whose CPU kernels are the references) must reproduce the unpatched fp32 logits within FP32_LOGIT_ATOL and the
same greedy tokens; unpatching must give bit-identical outputs; state_dict and save_pretrained are unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import tempfile
import warnings

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, assert_within_torch_error, max_err
from safetensors.torch import load_file

from patcher import PatchReport, UnsupportedModelError, is_patched, patch_model, unpatch_model
from patcher import random_models as rm

TINY = rm.TINY


def ids_for(model, batch=2, tokens=13, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (batch, tokens), generator=g).to(device)


def logits(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def layer_stack(model):
    base = getattr(model, "gpt_neox", None) or model.model
    return base.layers


@pytest.mark.parametrize("backend", ["reference", "kernels"])
@pytest.mark.parametrize("name", TINY)
def test_fp32_logits_match_unpatched(name, backend):
    model = rm.build(name)
    ids = ids_for(model)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding in the first row
    expected, expected_masked = logits(model, ids), logits(model, ids, attention_mask=mask)
    report = patch_model(model, backend=backend)
    assert report.layers_restructured == report.layers_total == model.config.num_hidden_layers
    assert not report.unpatched and report.backend == backend
    assert max_err(logits(model, ids), expected) <= FP32_LOGIT_ATOL
    assert max_err(logits(model, ids, attention_mask=mask), expected_masked) <= FP32_LOGIT_ATOL


@pytest.mark.parametrize("name", TINY)
def test_greedy_generate_identical(name):
    model = rm.build(name)
    ids = ids_for(model, batch=2, tokens=7)
    kwargs = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0, "attention_mask": torch.ones_like(ids)}
    expected = model.generate(ids, **kwargs)
    patch_model(model)
    assert torch.equal(model.generate(ids, **kwargs), expected)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_patched_attention_updates_the_cache_under_any_name(name):
    """transformers renamed the attention's cache argument once (LLaMA/Qwen2: past_key_values -> cache in 5.24), and
    the patched attention then dropped the cache: decoding attended to the current token only. A cache passed under
    any name is updated, the same as under the known ones."""
    from transformers import DynamicCache

    model = rm.build(name)
    patch_model(model)
    base = model.base_model
    layer = base.layers[0]
    attn = layer.self_attn if hasattr(layer, "self_attn") else layer.attention
    h = torch.randn(1, 5, model.config.hidden_size)
    position_embeddings = base.rotary_emb(h, torch.arange(5)[None])
    keys = []
    for kwarg in ("past_key_values", "layer_past", "cache", "a_future_name"):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            attn(hidden_states=h, position_embeddings=position_embeddings, attention_mask=None, **{kwarg: cache})
        keys.append(cache.layers[0].keys)
    assert keys[0] is not None and keys[0].shape[-2] == 5
    assert all(k is not None and torch.equal(k, keys[0]) for k in keys)


@pytest.mark.parametrize("name", TINY)
def test_unpatch_is_bit_identical(name):
    model = rm.build(name)
    ids = ids_for(model)
    expected = logits(model, ids)
    forwards = {n: m.__dict__.get("forward") for n, m in model.named_modules()}
    patch_model(model)
    logits(model, ids)
    assert unpatch_model(model) is True
    assert not is_patched(model)
    assert torch.equal(logits(model, ids), expected)
    for n, m in model.named_modules():
        assert m.__dict__.get("forward") is forwards[n], f"{n}: forward not restored"
        assert "_patcher" not in m.__dict__
        assert not any(b.startswith("_patcher") for b in m._buffers), f"{n}: fused buffer left behind"
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    assert len(set(storages)) == len(storages), "some parameters still share a fused buffer"
    # and it can be patched again
    patch_model(model)
    assert max_err(logits(model, ids), expected) <= FP32_LOGIT_ATOL


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia"])
def test_state_dict_and_save_pretrained_unchanged(name, tmp_path):
    model = rm.build(name)
    ids = ids_for(model)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp_path / "before")
    patch_model(model)
    after = model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    model.save_pretrained(tmp_path / "after")
    saved_before = load_file(tmp_path / "before" / "model.safetensors")
    saved_after = load_file(tmp_path / "after" / "model.safetensors")
    assert saved_before.keys() == saved_after.keys()
    for k in saved_before:
        assert torch.equal(saved_before[k], saved_after[k]), k
    reloaded = type(model).from_pretrained(tmp_path / "after").eval()
    assert max_err(logits(reloaded, ids), logits(model, ids)) <= FP32_LOGIT_ATOL
    # no extra memory: the fused q/k/v and gate/up parameters are views into one buffer each
    storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
    layers = model.config.num_hidden_layers
    expected_shared = 0 if name == "tiny-pythia" else layers * (5 - 2)  # 5 parameters in 2 buffers per layer
    qkv_bias = name == "tiny-qwen2"
    expected_shared += layers * 2 if qkv_bias else 0  # 3 biases in 1 buffer
    assert len(storages) - len(set(storages)) == expected_shared


def test_report_contents():
    model = rm.build("tiny-llama")
    report = patch_model(model)
    assert isinstance(report, PatchReport)
    assert (report.model_class, report.model_type, report.backend) == ("LlamaForCausalLM", "llama", "reference")
    assert report.devices == ["cpu"] and report.dtype == "float32"
    names = {r.name for r in report.replaced}
    layers = model.config.num_hidden_layers
    # layer, attention, MLP, two norms per layer; the final norm; the model's generate
    assert len(report.replaced) == 5 * layers + 2
    assert {
        "model.layers.0",
        "model.layers.0.self_attn",
        "model.layers.0.mlp",
        "model.norm",
        "(model).generate",
    } <= names
    assert report.fused_weights == 2 * layers  # q/k/v and gate/up per layer
    assert sum(report.launches_per_layer.values()) == 8
    text = str(report)
    assert "3/3 decoder layers restructured" in text and "left unpatched: none" in text
    assert report.to_dict()["layers_total"] == layers and '"model_type": "llama"' in report.to_json()


def test_patching_twice_is_a_noop_with_a_message():
    model = rm.build("tiny-qwen2")
    first = patch_model(model)
    with pytest.warns(UserWarning, match="already patched"):
        second = patch_model(model)
    assert second is first
    unpatch_model(model)
    with pytest.warns(UserWarning, match="not patched"):
        assert unpatch_model(model) is False


def test_output_hidden_states_are_plain_tensors():
    model = rm.build("tiny-pythia")
    ids = ids_for(model)
    with torch.no_grad():
        expected = model(ids, output_hidden_states=True).hidden_states
        patch_model(model)
        got = model(ids, output_hidden_states=True).hidden_states
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert isinstance(g, torch.Tensor) and max_err(g, e) <= FP32_LOGIT_ATOL


# ---- bad input: clear errors, nothing lost --------------------------------------------------------------------


def test_unsupported_model_is_rejected_and_unchanged():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64)).eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError, match="gpt2.*supported model types: gpt_neox, llama, qwen2"):
        patch_model(model)
    assert not is_patched(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(TypeError):
        patch_model("not a model")
    with pytest.raises(ValueError, match="backend"):
        patch_model(rm.build("tiny-llama"), backend="triton")
    with pytest.raises(UnsupportedModelError, match="before torch.compile"):
        patch_model(torch.compile(rm.build("tiny-llama")))


def test_unsupported_dtype_is_left_unpatched_with_reason():
    model = rm.build("tiny-llama").double()
    ids = ids_for(model)
    expected = logits(model, ids)
    report = patch_model(model, backend="kernels")  # the CUDA kernels take fp16/bf16/fp32 only
    assert report.layers_restructured == 0
    assert len(report.unpatched) == model.config.num_hidden_layers + 1
    assert all("float64" in r.detail for r in report.unpatched)
    assert "no module could be patched" in str(report)
    assert torch.equal(logits(model, ids), expected)


def test_training_mode_with_dropout_is_left_unpatched():
    cfg = rm.config("tiny-llama")
    cfg.attention_dropout = 0.1
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(cfg)
    model.train()
    report = patch_model(model)
    assert report.layers_restructured == 0
    assert all("dropout" in r.detail for r in report.unpatched if "layers" in r.name)


def test_unsupported_activation_is_left_unpatched():
    from transformers import AutoModelForCausalLM

    cfg = rm.config("tiny-llama")
    cfg.hidden_act = "relu"
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = ids_for(model)
    expected = logits(model, ids)
    report = patch_model(model)
    assert report.layers_restructured == 0 and all("activation" in r.detail for r in report.unpatched[:-1])
    # the final norm alone is patched, and the last layer hands it a plain tensor
    assert max_err(logits(model, ids), expected) <= FP32_LOGIT_ATOL


# tiny-llama under accelerate's hooks on the CPU, its second layer offloaded to disk
OFFLOADED_LAYER_1 = {
    "model.embed_tokens": "cpu",
    "model.layers.0": "cpu",
    "model.layers.1": "disk",
    "model.layers.2": "cpu",
    "model.norm": "cpu",
    "model.rotary_emb": "cpu",
    "lm_head": "cpu",
}


@contextlib.contextmanager
def offloaded_tiny_llama():
    """(model, ids, its logits before dispatch): tiny-llama dispatched by accelerate with OFFLOADED_LAYER_1, for the
    duration of the block (its offload folder goes after it)."""
    from accelerate import dispatch_model

    model = rm.build("tiny-llama")
    ids = ids_for(model)
    expected = logits(model, ids)
    with tempfile.TemporaryDirectory() as offload, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield dispatch_model(model, device_map=OFFLOADED_LAYER_1, offload_dir=offload, main_device="cpu"), ids, expected


def test_accelerate_hooks_and_offloaded_layers():
    """device_map hooks stay in place; an offloaded layer is left as it was and its neighbours adapt."""
    with offloaded_tiny_llama() as (model, ids, expected):
        hooked_forward = model.model.layers[0].forward
        report = patch_model(model)
        assert [r.name for r in report.unpatched] == ["model.layers.1"]
        assert "offloaded" in report.unpatched[0].detail
        assert model.model.layers[0].forward is hooked_forward  # the accelerate wrapper is kept
        assert max_err(logits(model, ids), expected) <= FP32_LOGIT_ATOL
        unpatch_model(model)
        assert torch.equal(logits(model, ids), expected)


def test_original_forwards_for_a_call():
    """PatchState.original_forwards (generate's static-cache fallback) puts HF's forward back on every patched module
    for its duration, under accelerate's hooks too (their _old_forward), so the model computes the unpatched logits
    exactly; the fused forwards are back after it, also when the call inside raises."""
    with offloaded_tiny_llama() as (model, ids, expected):
        patch_model(model)
        state = model._patcher_state
        swaps = state.forward_swaps
        assert any(s.slot == "_old_forward" for s in swaps)  # modules under accelerate's hooks
        fused = [s.module.__dict__[s.slot] for s in swaps]
        with state.original_forwards():
            assert all(s.module.__dict__.get(s.slot, s.original) is s.original for s in swaps)  # (or no slot at all)
            assert torch.equal(logits(model, ids), expected)
        assert all(s.module.__dict__[s.slot] is f for s, f in zip(swaps, fused))
        with pytest.raises(RuntimeError, match="inside"), state.original_forwards():
            raise RuntimeError("inside")
        assert all(s.module.__dict__[s.slot] is f for s, f in zip(swaps, fused))
        assert max_err(logits(model, ids), expected) <= FP32_LOGIT_ATOL


def test_no_graph_breaks_from_patched_ops():
    """torch._dynamo.explain over the patched forward under no_grad (with gradients recorded the patched modules
    run HF's forwards): the patcher:: ops trace without graph breaks."""
    model = rm.build("tiny-llama")
    ids = ids_for(model, batch=1)
    with torch.no_grad():
        unpatched = torch._dynamo.explain(model)(ids, use_cache=False)
        patch_model(model, backend="kernels")
        patched = torch._dynamo.explain(model)(ids, use_cache=False)
    assert patched.graph_break_count <= unpatched.graph_break_count, patched.break_reasons
    ops = {str(n.target) for g in patched.graphs for n in g.graph.nodes if n.op == "call_function"}
    assert any("patcher" in t for t in ops), "the patched graph should contain patcher:: ops"


def test_inductor_makes_no_implicit_fallback_for_patcher_ops(caplog):
    """torch.compile (Inductor) of a patched GPT-NeoX: the patcher:: ops come with their fallbacks registered, so
    Inductor never creates one implicitly. torch <= 2.11 formats the IR behind the op's inputs into its
    implicit-fallback message, exponentially long in the depth of the graph (the final add_layer_norm comes after
    every layer), which kept a 32-layer decode step compiling for minutes. The Inductor caches are off, so the graph
    really is lowered here."""
    import torch._inductor.config as inductor_config
    from torch._inductor.lowering import lowerings

    model = rm.build("tiny-pythia")
    ids = ids_for(model, batch=1)
    patch_model(model, backend="kernels")
    expected = logits(model, ids)
    torch._dynamo.reset()
    with (
        inductor_config.patch(fx_graph_cache=False, autotune_local_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
        caplog.at_level(logging.INFO, logger="torch._inductor.graph"),
    ):
        compiled = torch.compile(model)
        with torch.no_grad():
            got = compiled(ids, use_cache=False).logits.float()
    torch._dynamo.reset()
    implicit = [r.getMessage()[:200] for r in caplog.records if "implicit fallback" in r.getMessage()]
    assert not [m for m in implicit if "patcher" in m], implicit
    assert torch.ops.patcher.add_layer_norm.default in lowerings
    assert max_err(got, expected) <= FP32_LOGIT_ATOL


# ---- GPU: fp16 / bf16 with the CUDA kernels -------------------------------------------------------------------


def _low_precision_case(name, dtype, batch=2, tokens=13):
    """(model in `dtype` on CUDA, ids, fp32 logits of the same rounded weights, HF logits in `dtype`)."""
    model = rm.build(name, dtype=torch.float32, device="cuda")
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.to(dtype).float()  # the fp32 reference sees exactly the low-precision weights
    ids = ids_for(model, batch, tokens, device="cuda")
    ref32 = logits(model, ids)
    model.to(dtype)
    return model, ids, ref32, logits(model, ids)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", TINY)
def test_cuda_logits_within_tolerance(name, dtype):
    model, ids, ref32, hf_low = _low_precision_case(name, dtype)
    report = patch_model(model)
    assert report.backend == "kernels" and report.layers_restructured == report.layers_total
    got = logits(model, ids)
    assert_within_torch_error(got, hf_low, ref32, f"{name} {dtype}")
    agree = (got.argmax(-1) == hf_low.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"top-1 agreement {agree:.3f}"
    unpatch_model(model)
    assert torch.equal(logits(model, ids), hf_low)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-qwen2"])
def test_cuda_graph_capture_of_a_decode_step(name):
    """One decode step of the patched model (HF static cache, our kernels) captured in a CUDA graph and replayed."""
    from transformers import StaticCache

    model = rm.build(name, dtype=torch.float16, device="cuda")
    patch_model(model)
    prompt = ids_for(model, batch=1, tokens=9, device="cuda")
    cache = StaticCache(config=model.config, max_cache_len=32)
    with torch.no_grad():
        model(prompt, past_key_values=cache, use_cache=True, cache_position=torch.arange(9, device="cuda"))
        token = torch.full((1, 1), 5, device="cuda")
        position = torch.tensor([9], device="cuda")

        def rewind():  # HF's StaticCache advances a device-side length counter on every update
            for layer in cache.layers:
                layer.cumulative_length.fill_(9)

        def step():
            return model(token, past_key_values=cache, use_cache=True, cache_position=position).logits

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            rewind()
            eager = step().clone()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        rewind()
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("name", TINY)
def test_model_split_over_two_gpus(name):
    """accelerate puts the embeddings and the first half of the layers on cuda:0, the rest with the final norm (and
    an untied head) on cuda:1; patch_model patches every layer with its own device's kernels (the residual stream
    crosses the boundary through accelerate's hook), generate decodes through one graph a GPU where the final norm
    and the head share a GPU and keeps HF's loop with the reason where a tied head stays with the embeddings, and
    unpatch restores."""
    from accelerate import dispatch_model

    from patcher.decode import generate_path
    from patcher.registry import REGISTRY

    model, ids, ref32, hf_low = _low_precision_case(name, torch.float16)
    spec = REGISTRY[model.config.model_type].spec
    base = getattr(model, spec.base_model)
    n = len(getattr(base, spec.layers))
    device_map = {f"{spec.base_model}.{spec.layers}.{i}": 0 if i < n // 2 else 1 for i in range(n)}
    for child, _ in base.named_children():
        if child != spec.layers:
            device_map[f"{spec.base_model}.{child}"] = 1 if child == spec.final_norm else 0
    tied = getattr(model.config, "tie_word_embeddings", False)
    for child, _ in model.named_children():
        if child != spec.base_model:
            device_map[child] = 0 if tied else 1  # the head (a tied head stays with the embeddings)
    model = dispatch_model(model, device_map=device_map)
    split = logits(model, ids).to(hf_low.device)
    assert torch.equal(split, hf_low)  # the placement alone changes nothing
    report = patch_model(model)
    assert report.devices == ["cuda:0", "cuda:1"] and report.layers_restructured == report.layers_total == n
    got = logits(model, ids).to(hf_low.device)
    assert_within_torch_error(got, hf_low, ref32, f"{name} split over two GPUs")
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, pad_token_id=0)
    path = generate_path(model)
    if tied:
        assert path["path"] == "hf" and "the final norm and the lm_head on different devices" in path["reason"], path
    else:
        assert path["path"] == "graph", path
    unpatch_model(model)
    assert torch.equal(logits(model, ids).to(hf_low.device), hf_low)


REAL_SIZE = pytest.mark.skipif(
    not __import__("os").environ.get("PATCHER_REAL_SIZE"),
    reason="real-size models: set PATCHER_REAL_SIZE=1 on a GPU with >= 40 GB",
)


@pytest.mark.gpu
@pytest.mark.slow
@REAL_SIZE
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["pythia-2.8b", "llama-3.1-8b", "qwen2-1.5b"])
def test_real_size_logits_within_tolerance(name, dtype):
    model, ids, ref32, hf_low = _low_precision_case(name, dtype, batch=1, tokens=64)
    patch_model(model)
    got = logits(model, ids)
    assert_within_torch_error(got, hf_low, ref32, f"{name} {dtype}")
    print(
        f"\n{name} {dtype}: max|patched-fp32| {max_err(got, ref32):.4g}, max|hf-fp32| {max_err(hf_low, ref32):.4g}, "
        f"max|patched-hf| {max_err(got, hf_low):.4g}"
    )
    del model
    torch.cuda.empty_cache()
