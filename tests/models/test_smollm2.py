"""The trained SmolLM2-135M (LLaMA architecture, tied embeddings) on real text: patched against unpatched.

Needs the GGUF file (../shared/tools/get-smollm2.sh fetches it) at $PATCHER_SMOLLM2_GGUF and the `gguf`
package; .ci/run provides both. WikiText-2 test text comes from ../shared/data (or $PATCHER_WIKITEXT).
"""

from __future__ import annotations

import pytest
import torch
from conftest import (
    FP32_LOGIT_ATOL,
    assert_within_torch_error,
    max_err,
    smollm2_gguf,
    smollm2_transformers,
    wikitext_path,
)

from patcher import patch_model, unpatch_model

GGUF = smollm2_gguf()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        GGUF is None or wikitext_path() is None,
        reason="set PATCHER_SMOLLM2_GGUF (../shared/tools/get-smollm2.sh) to run",
    ),
]


@pytest.fixture(scope="module")
def smollm2_fp32():
    return smollm2_transformers(torch.float32)


@pytest.fixture(scope="module")
def text_ids(smollm2_fp32):
    _, tokenizer = smollm2_fp32
    text = wikitext_path().read_text(encoding="utf-8")[:20000]
    return tokenizer(text, return_tensors="pt").input_ids[:, :512]


def test_fp32_logits_on_wikitext(smollm2_fp32, text_ids):
    model, _ = smollm2_fp32
    with torch.no_grad():
        expected = model(text_ids).logits
        report = patch_model(model)
        try:
            assert report.layers_restructured == 30 and not report.unpatched
            got = model(text_ids).logits
        finally:
            unpatch_model(model)
    assert max_err(got, expected) <= FP32_LOGIT_ATOL * expected.abs().max().item()  # logits reach ~30 here
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_fp32_greedy_generation(smollm2_fp32):
    model, tokenizer = smollm2_fp32
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    kwargs = {"max_new_tokens": 24, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    expected = model.generate(ids, **kwargs)
    patch_model(model)
    try:
        got = model.generate(ids, **kwargs)
    finally:
        unpatch_model(model)
    assert torch.equal(got, expected), tokenizer.decode(got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_logits_on_wikitext(text_ids, dtype):
    model32, _ = smollm2_transformers(torch.float32, "cuda")
    ids = text_ids.cuda()
    with torch.no_grad():
        for p in model32.parameters():
            p.data = p.data.to(dtype).float()
        ref32 = model32(ids).logits
        model = model32.to(dtype)
        hf_low = model(ids).logits
        patch_model(model)
        got = model(ids).logits
    assert_within_torch_error(got, hf_low, ref32, f"SmolLM2 {dtype}")
    agree = (got.argmax(-1) == hf_low.argmax(-1)).float().mean().item()
    assert agree >= 0.98, f"top-1 agreement {agree:.3f}"
