"""The model API of a patched model, driven broadly against an unpatched twin: attention masks with padding and
position ids, output_attentions and output_hidden_states, DynamicCache and StaticCache decoding, tuple outputs,
train/eval switches (with a training step between), in fp32 and bf16, with eager and SDPA attention.

fp32: within FP32_LOGIT_ATOL of the twin (CUDA: test_contract.CUDA_FP32_ATOL). bf16: the 2x rule against an fp32
run of the same rounded weights (conftest.py). CPU: the reference backend; GPU (marked gpu): the CUDA kernels.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import pytest
import torch
from conftest import assert_within_torch_error
from test_contract import assert_grads_equal, close, flat, linear_calls
from transformers import DynamicCache, StaticCache

from patcher import patch_model
from patcher import random_models as rm

CASES = [
    (name, attn, dtype)
    for name in ("tiny-llama", "tiny-qwen2", "tiny-pythia")
    for attn, dtype in (("eager", torch.float32), ("sdpa", torch.float32), ("sdpa", torch.bfloat16))
]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


class Twins:
    """The patched model, its unpatched twin, and (low precision) an fp32 twin of the same rounded weights."""

    def __init__(self, name, attn, dtype, device):
        exact = rm.build(name, device=device, attn_implementation=attn)
        with torch.no_grad():
            for p in exact.parameters():
                p.copy_(p.to(dtype))
        self.exact = exact if dtype != torch.float32 else None
        self.ref = copy.deepcopy(exact).to(dtype)
        self.model = copy.deepcopy(self.ref)
        self.report = patch_model(self.model)
        self.dtype = dtype

    def compare(self, run, what):
        """run(model) -> a tensor or a tuple/list of tensors; the patched model's against the twin's."""
        got, hf = run(self.model), run(self.ref)
        exact = run(self.exact) if self.exact is not None else None
        got, hf = flat(got), flat(hf)
        assert len(got) == len(hf) and [type(g) for g in got] == [type(h) for h in hf], what
        for i, (g, h) in enumerate(zip(got, hf)):
            if not isinstance(h, torch.Tensor):
                assert g == h, f"{what} [{i}]"
            elif exact is None:
                assert g.shape == h.shape and close(g, h), f"{what} [{i}]"
            else:
                assert_within_torch_error(g, h, flat(exact)[i].float(), f"{what} [{i}]")


def inputs(model, device):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, model.config.vocab_size, (2, 10), generator=g).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left padding
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def decode(model, ids, mask, cache, steps=3):
    """Prefill all but the last `steps` tokens into `cache`, then one token at a time: every step's logits."""
    out, prompt = [], ids.shape[1] - steps
    # the cache argument's name: `cache` since transformers 5.24, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():
        result = model(ids[:, :prompt], attention_mask=mask[:, :prompt], use_cache=True, **{name: cache})
        out.append(result.logits[:, -1])
        for t in range(prompt, ids.shape[1]):
            result = model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], **{name: result.past_key_values})
            out.append(result.logits[:, -1])
    return out, [layer.keys[:, :, : ids.shape[1]] for layer in result.past_key_values.layers]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("name", "attn", "dtype"), CASES)
def test_model_api_matches_unpatched(name, attn, dtype, device):
    t = Twins(name, attn, dtype, device)
    ids, mask, position_ids = inputs(t.ref, device)

    def forward(**kwargs):
        def run(m):
            with torch.no_grad():
                return m(ids, attention_mask=mask, position_ids=position_ids, **kwargs)

        return run

    t.compare(lambda m: forward()(m).logits, "logits with padding and position ids")
    t.compare(lambda m: forward(output_hidden_states=True)(m).hidden_states, "hidden states")
    if attn == "eager":
        t.compare(lambda m: forward(output_attentions=True)(m).attentions, "attentions")
    t.compare(lambda m: forward(return_dict=False)(m)[:1], "tuple output")
    t.compare(lambda m: decode(m, ids, mask, DynamicCache(config=m.config)), "DynamicCache decode")
    t.compare(lambda m: decode(m, ids, mask, StaticCache(config=m.config, max_cache_len=16)), "StaticCache decode")

    if dtype == torch.float32:  # train, a step, back to eval: HF's loss and gradients, then the fused path again
        for m in (t.ref, t.model):
            m.train()
            m(ids, attention_mask=mask, labels=ids).loss.backward()
        assert_grads_equal(t.ref, t.model)
        for m in (t.ref, t.model):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            m.eval()
    t.compare(lambda m: forward()(m).logits, "logits after train() and eval()")
    with linear_calls() as calls, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        forward()(t.model)
    assert calls[0] == 1  # the lm_head only: every projection ran fused
