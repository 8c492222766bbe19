"""Random GGUF blocks at a model's shapes (patcher.gguf.random_weights): weights of the intended size, and a random
model with GGUF linears under patch_model."""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, max_err

from patcher import patch_model, unpatch_model
from patcher import random_models as rm
from patcher.gguf import GGUFLinear
from patcher.gguf import format as fmt
from patcher.gguf.random_weights import head_type, q4_k_m, quantize_random, random_blocks


@pytest.mark.parametrize("kind", list(fmt.TYPES))
def test_random_blocks_give_centered_weights_of_one_over_root_k(kind):
    cols = 1024
    w = fmt.dequantize(random_blocks(kind, 64, cols, torch.Generator().manual_seed(0)), kind)
    assert torch.isfinite(w).all()
    std = w.std().item() * cols**0.5
    assert 0.6 <= std <= 1.6, f"weight std {std:.3g} / sqrt(K)"
    assert abs(w.mean().item()) * cols**0.5 <= 0.12  # Q4_0: quants -8..7, a mean of -d / 2


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_random_gguf_model_runs_and_patch_model_keeps_its_logits(name):
    model = rm.build(name)
    kinds = {"q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_0", "gate_proj": "Q4_0"}
    quantize_random(model, {**kinds, "up_proj": "Q8_0", "down_proj": "Q4_1"})
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    assert len(layers) == 7 * model.config.num_hidden_layers == len(model.gguf_report.quantized)
    qkv_bias = model.model.layers[0].self_attn.q_proj.bias
    assert (qkv_bias is not None) == (name == "tiny-qwen2")
    tokens = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        assert torch.isfinite(expected).all() and expected.std() > 0
        report = patch_model(model)
        try:
            assert report.layers_restructured == model.config.num_hidden_layers and report.fully_patched
            got = model(tokens).logits
        finally:
            unpatch_model(model)
        again = model(tokens).logits
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    assert torch.equal(again, expected)


def test_q4_k_m_mix_follows_llama_cpp():
    """llama.cpp's Q4_K_M for 32 layers: Q6_K V and down projections in layers 0-3, 28-31 and every third from 6."""
    wide = [i for i in range(32) if q4_k_m(i, 32)["v_proj"] == "Q6_K"]
    assert wide == [0, 1, 2, 3, *range(6, 28, 3), 28, 29, 30, 31]
    assert all(q4_k_m(i, 32)["down_proj"] == q4_k_m(i, 32)["v_proj"] for i in range(32))
    assert {q4_k_m(5, 32)[name] for name in ("q_proj", "k_proj", "o_proj", "gate_proj", "up_proj")} == {"Q4_K"}


def test_q4_k_m_random_model():
    """`--gguf-random Q4_K_M`: every decoder linear of a model whose widths are whole super-blocks takes the mix's
    type for its layer, the untied lm_head Q6_K (llama.cpp's head_type)."""
    from transformers import AutoModelForCausalLM

    cfg = rm.config("tiny-llama")
    cfg.intermediate_size, cfg.num_hidden_layers = 512, 9
    model = AutoModelForCausalLM.from_config(cfg).eval()
    quantize_random(model, "Q4_K_M")
    for i, layer in enumerate(model.model.layers):
        expected = q4_k_m(i, 9)
        for parent in (layer.self_attn, layer.mlp):
            for name, module in parent.named_children():
                if isinstance(module, GGUFLinear):
                    assert module.kind == expected[name], (i, name)
    assert len(model.gguf_report.quantized) == 7 * 9 + 1 and model.lm_head.kind == "Q6_K"
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[1, 2, 3]])).logits).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia", "tiny-llama-tied"])
def test_random_head_follows_llama_cpp_and_keeps_the_logits(name):
    """An untied lm_head takes head_type's blocks (Q6_K where the hidden size is whole super-blocks of 256, tiny-llama's;
    Q8_0 otherwise, tiny-pythia's 320; Q8_0 in a Q8_0 file); a tied one stays the embedding. patch_model keeps the
    logits, and the decode runner's greedy tokens are HF's."""
    from patcher.decode import DecodeOptions, DecodeRunner, Sampling

    assert [head_type(k, 4096) for k in ("Q4_0", "Q4_K_M", "Q8_0")] == ["Q6_K", "Q6_K", "Q8_0"]
    assert head_type("Q4_0", 320) == "Q8_0" and head_type({"q_proj": "Q4_0"}, 4096) is None
    model = rm.build(name)
    quantize_random(model, "Q4_0")
    head = model.get_output_embeddings()
    if name == "tiny-llama-tied":
        assert head.weight is model.get_input_embeddings().weight and "lm_head" not in model.gguf_report.quantized
    else:
        want = head_type("Q4_0", model.config.hidden_size)
        name = next(n for n, m in model.named_modules() if m is head)
        assert isinstance(head, GGUFLinear) and head.kind == want == model.gguf_report.quantized[name]
    tokens = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(tokens).logits
        hf_tokens = model.generate(tokens, max_new_tokens=6, do_sample=False, pad_token_id=0)
        patch_model(model)
        try:
            got = model(tokens).logits
            runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
            ours = runner.generate(tokens, torch.ones_like(tokens), 6, Sampling(), eos=[], pad_token_id=0)
        finally:
            unpatch_model(model)
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    assert torch.equal(ours, hf_tokens)
