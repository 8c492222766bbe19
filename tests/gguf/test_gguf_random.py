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
from patcher.gguf.random_weights import quantize_random, random_blocks


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
