"""Copying and pickling a patched model: copy.deepcopy after generate (the decode runner and the generate lock made)
gives a patched model of its own; pickling one whole is refused with the ways to save it, and unpatch_model makes
it picklable again. CPU, the reference backend."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from test_contract import ARCHS, EAGER, greedy, ids_for, logits, twins

from patcher import unpatch_model
from patcher.decode import DecodeRunner, Sampling


@pytest.mark.parametrize("name", ARCHS)
def test_deepcopy_after_generate_decodes_on_its_own_weights(name):
    ref, model = twins(name)
    ids = ids_for(ref, batch=1, tokens=5)
    assert torch.equal(greedy(model, ids), greedy(ref, ids))  # makes the generate lock
    model._patcher_state.runner = DecodeRunner(model, EAGER)  # (the CPU's generate takes HF's path)
    twin = copy.deepcopy(model)  # failed on the lock
    assert twin._patcher_state.runner is None
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    assert torch.equal(greedy(twin, ids), greedy(ref, ids))
    runner = DecodeRunner(twin, EAGER)
    assert torch.equal(runner.generate(ids, torch.ones_like(ids), 12, Sampling(), eos=[], pad_token_id=0),
                       greedy(ref, ids))  # fmt: skip


@pytest.mark.parametrize("name", ARCHS)
def test_pickling_a_patched_model_is_refused_until_unpatched(name):
    ref, model = twins(name)
    ids = ids_for(ref)
    greedy(model, ids)
    with pytest.raises(TypeError, match="can't be pickled whole .* is patched.*unpatch_model"):
        torch.save(model, io.BytesIO())
    assert torch.equal(logits(model, ids), logits(ref, ids))  # nothing lost by the refusal
    assert unpatch_model(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    assert torch.equal(logits(torch.load(buf, weights_only=False), ids), logits(ref, ids))
