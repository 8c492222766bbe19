"""The trained SmolLM2-135M Q4_1 file through load_gguf: W4A16 against transformers' dequantized model, W4A8,
and patch_model on it (CPU, fp32).

Needs the GGUF file at $PATCHER_SMOLLM2_GGUF (../shared/tools/get-smollm2.sh fetches it) and the `gguf` package.
"""

from __future__ import annotations

import pytest
import torch
from conftest import FP32_LOGIT_ATOL, max_err, smollm2_gguf, smollm2_transformers
from gguf_blocks import patched_logits, set_mode

from patcher import load_gguf
from patcher.gguf import GGUFLinear

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(GGUF is None, reason="set PATCHER_SMOLLM2_GGUF (../shared/tools/get-smollm2.sh) to run"),
]
PROMPT = "The capital of France is Paris. The largest city in Germany is Berlin, and the river through it is the"


@pytest.fixture(scope="module")
def tokens():
    _, tokenizer = smollm2_transformers()
    return tokenizer(PROMPT, return_tensors="pt").input_ids


@pytest.fixture(scope="module")
def dequantized_logits(tokens):
    model, _ = smollm2_transformers()
    with torch.no_grad():
        return model(tokens).logits


@pytest.fixture(scope="module")
def model():
    return load_gguf(GGUF, dtype=torch.float32, quantize_activations=False)


def nll(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    return torch.nn.functional.cross_entropy(logits[0, :-1].double(), tokens[0, 1:]).item()


def test_every_decoder_linear_kept_as_q4_1(model):
    report = model.gguf_report
    assert len(report.quantized) == 30 * 7 and set(report.quantized.values()) == {"Q4_1"}
    assert list(report.dequantized) == ["model.embed_tokens"]  # Q8_0, an embedding: transformers dequantizes it
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, GGUFLinear) and layer.qweight.shape == (576, 576 // 32 * 20)


def test_w4a16_logits_equal_transformers(model, tokens, dequantized_logits):
    set_mode(model, False)
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, dequantized_logits)


def test_w4a8_logits_close(model, tokens, dequantized_logits):
    """Q8_1 activations in all 210 linears: the prompt's mean next-token loss within 3% of W4A16's and the same
    top token at 85% of the positions or more (a short prompt; the perplexity goal is measured on WikiText)."""
    set_mode(model, True)
    try:
        with torch.no_grad():
            logits = model(tokens).logits
    finally:
        set_mode(model, False)
    reference = nll(dequantized_logits, tokens)
    assert abs(nll(logits, tokens) - reference) <= 0.03 * reference
    assert (logits.argmax(-1) == dequantized_logits.argmax(-1)).float().mean() >= 0.85


@pytest.mark.parametrize("quantize_activations", [False, True])
def test_patch_model_leaves_the_logits_as_they_were(model, tokens, quantize_activations):
    """All 30 layers patched (each GGUF projection running its modules' own ops between the fused norms and
    rope_qkv); the logits of the unpatched model within fp32 tolerance."""
    set_mode(model, quantize_activations)
    try:
        with torch.no_grad():
            expected = model(tokens).logits
            report, got = patched_logits(model, tokens)
            again = model(tokens).logits
    finally:
        set_mode(model, False)
    assert report.layers_restructured == 30 and report.fully_patched, str(report)
    assert "GGUF q/k/v (Q4_1, Q4_1, Q4_1)" in " ".join(r.detail for r in report.replaced)
    assert max_err(got, expected) <= FP32_LOGIT_ATOL
    assert torch.equal(again, expected)
