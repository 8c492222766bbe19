"""The decode path under real use: bounded memory over many shapes, memory released on request, expanded prompts
for num_return_sequences, and concurrent callers (GPU)."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from transformers import GenerationConfig

from patcher import patch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, decode_memory, release_decode_memory
from patcher.decode.generate import CACHE_FIELD
from patcher.decode.reasons import call_reason
from patcher.decode.runner import MIN_CAPACITY

VOCAB = 512


def capacity(needed: int) -> int:
    return max(MIN_CAPACITY, 1 << (needed - 1).bit_length())


def test_memory_stays_within_the_largest_shape():
    """100 calls over 10 random (batch, prompt, new tokens) shapes: the static caches held never exceed the largest
    one a call needed, and release() frees them all."""
    model = rm.build("tiny-llama")
    patch_model(model)
    runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
    rng = random.Random(0)
    shapes = [(rng.randint(1, 8), rng.randint(1, 300), rng.randint(1, 4)) for _ in range(10)]
    largest = 0
    for _ in range(100):
        batch, prompt, new = rng.choice(shapes)
        ids = torch.randint(3, VOCAB, (batch, prompt))
        out = runner.generate(ids, torch.ones_like(ids), new, Sampling(), eos=[], pad_token_id=0)
        assert out.shape == (batch, prompt + new)
        largest = max(largest, runner.cache_bytes(batch, capacity(prompt + new)))
        held = sum(runner.cache_bytes(s.batch, s.capacity) for s in runner.states.values())
        assert held <= largest
    assert len(runner.states) >= 1 and runner.memory_bytes() > 0
    runner.release()
    assert runner.memory_bytes() == 0 and not runner.states


def test_decode_memory_report_and_release():
    model = rm.build("tiny-qwen2")
    patch_model(model)
    assert decode_memory(model) == {"bytes": 0, "states": []}
    model._patcher_state.runner = runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
    ids = torch.randint(3, VOCAB, (2, 5))
    runner.generate(ids, torch.ones_like(ids), 3, Sampling(), eos=[], pad_token_id=0)
    report = decode_memory(model)
    assert report["states"] == [{"batch": 2, "capacity": MIN_CAPACITY, "bytes": runner.memory_bytes()}]
    assert report["bytes"] > 0
    release_decode_memory(model)
    assert decode_memory(model)["bytes"] == 0


def test_num_return_sequences_expands_the_prompts_as_hf_does():
    model = rm.build("tiny-llama")
    patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 5))
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    config = GenerationConfig(do_sample=True, num_return_sequences=3, max_new_tokens=4)
    reason, prepared = call_reason(model, config, {"input_ids": ids, "attention_mask": mask})
    assert reason is None, reason
    assert torch.equal(prepared["input_ids"], ids.repeat_interleave(3, 0))
    assert torch.equal(prepared["attention_mask"], mask.repeat_interleave(3, 0))
    reason, prepared = call_reason(model, config, {"input_ids": torch.randint(3, VOCAB, (3, 5))})
    assert reason is None and prepared["input_ids"].shape[0] == 9, reason
    reason, _ = call_reason(model, config, {"input_ids": torch.randint(3, VOCAB, (22, 5))})
    assert "batch 66" in reason


@pytest.mark.gpu
def test_two_threads_generate_on_one_model():
    """Two threads calling generate at once on one patched model both get their own sequential result."""
    model = rm.build("tiny-llama", dtype=torch.float16, device="cuda")
    model.generation_config.eos_token_id = None
    patch_model(model)
    prompts = [torch.randint(3, VOCAB, (b, 9), device="cuda") for b in (1, 3)]
    kwargs = {"max_new_tokens": 32, "do_sample": False, "pad_token_id": 0}
    expected = [model.generate(p, **kwargs) for p in prompts]
    results = [None, None]

    def run(i):
        for _ in range(5):
            results[i] = model.generate(prompts[i], **kwargs)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


@pytest.mark.parametrize("sample", [False, True])
def test_dict_output_with_scores_and_logits(sample, monkeypatch):
    """return_dict_in_generate with output_scores and output_logits: the eager runner's output holds HF's sequences,
    one float32 [B, V] score and logit tensor a generated token (HF's processed, warped scores; the raw logits), and
    the cache of every position but the last token's. Greedy: the scores equal HF's within the patched logits'
    fp32 rounding; sampling: the same shapes and a draw that reproduces with the seed."""
    import patcher.decode.generate as gen

    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    kwargs = {
        "max_new_tokens": 5,
        "do_sample": sample,
        "pad_token_id": 0,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
        "repetition_penalty": 1.2,
    }
    if sample:
        kwargs.update(temperature=0.8, top_k=30)
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    patch_model(model)
    # the CPU model takes the eager runner, as a GPU model takes the graph one
    model._patcher_state.runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
    monkeypatch.setattr(gen, "model_reason", lambda model: None)
    torch.manual_seed(0)
    got = model.generate(ids, **kwargs)
    assert gen.generate_path(model)["path"] == "eager-runner"
    torch.manual_seed(0)
    again = model.generate(ids, **kwargs)
    assert type(got) is type(expected)
    assert len(got.scores) == len(got.logits) == got.sequences.shape[1] - ids.shape[1] == 5
    assert all(s.dtype == torch.float32 and s.shape == (2, VOCAB) for s in got.scores + got.logits)
    got_cache, hf_cache = getattr(got, CACHE_FIELD), getattr(expected, CACHE_FIELD)
    assert got_cache.get_seq_length() == hf_cache.get_seq_length() == got.sequences.shape[1] - 1
    if sample:
        assert torch.equal(got.sequences, again.sequences)
        assert all(torch.isinf(s).sum(-1).min() >= VOCAB - 30 for s in got.scores)  # top-k left 30 finite
        return
    assert torch.equal(got.sequences, expected.sequences)
    for ours, theirs in zip(got.scores + got.logits, expected.scores + expected.logits):
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    k_ours, k_hf = got_cache.layers[0].keys, hf_cache.layers[0].keys
    assert torch.allclose(k_ours, k_hf, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_graph_path_dict_output_matches_hf():
    """GPU, fp32: the dict output with scores and logits keeps the call on the graph path, with HF's sequences and
    scores within the patched logits' rounding."""
    model = rm.build("tiny-qwen2", device="cuda")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 6), device="cuda")
    kwargs = {
        "max_new_tokens": 8,
        "do_sample": False,
        "pad_token_id": 0,
        "return_dict_in_generate": True,
        "output_scores": True,
        "output_logits": True,
    }
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    patch_model(model)
    got = model.generate(ids, **kwargs)
    from patcher.decode import generate_path

    assert generate_path(model)["path"] == "graph"
    assert torch.equal(got.sequences, expected.sequences)
    assert all(torch.allclose(a, b, atol=1e-3, rtol=1e-3) for a, b in zip(got.scores, expected.scores))


def test_a_failed_capture_decodes_with_the_eager_step(monkeypatch):
    """A capture that fails after its warm-up leaves the step without a graph: generate makes the tokens the eager
    step makes, says why in generate_path and one warning, and does not try the same state and mode again. An error
    in the warm-up is the step's own: it reaches the caller, and the next generate captures again."""
    import patcher.decode.generate as gen
    from patcher.decode.runner import CaptureError

    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 6), generator=torch.Generator().manual_seed(3))
    kwargs = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    eager = DecodeRunner(model, DecodeOptions(use_graphs=False))
    expected = eager.generate(ids, torch.ones_like(ids), 6, Sampling(), eos=[], pad_token_id=0)
    attempts, warm_up_error = [], [ValueError("the step's own error")]

    def failing_graph(device, step):
        if warm_up_error:  # the first warm-up raises: the step's own error reaches the caller
            raise warm_up_error.pop()
        step()  # the warm-up runs, as in _graph
        attempts.append(device)
        raise CaptureError("AcceleratorError: operation not permitted when stream is capturing")

    runner = DecodeRunner(model, DecodeOptions(use_graphs=False))
    runner.use_graphs = True  # the graph path's control flow on the CPU; the capture itself is failing_graph
    model._patcher_state.runner = runner
    monkeypatch.setattr(DecodeRunner, "_graph", staticmethod(failing_graph))
    monkeypatch.setattr(gen, "model_reason", lambda model: None)
    with pytest.raises(ValueError, match="the step's own error"):
        model.generate(ids, **kwargs)
    with pytest.warns(UserWarning, match="capture of the decode step failed .*not permitted"):
        got = model.generate(ids, **kwargs)
    assert torch.equal(got, expected)
    path = gen.generate_path(model)
    assert path["path"] == "eager-runner" and "not permitted" in path["reason"], path
    assert runner.states[2].graph is None and "not permitted" in runner.states[2].capture_error
    assert torch.equal(model.generate(ids, **kwargs), expected)
    assert len(attempts) == 1, "the same state and mode were captured again"
    release_decode_memory(model)
    model.generate(ids, **kwargs)
    assert len(attempts) == 2, "a released state is captured again"


@pytest.mark.gpu
def test_capture_survives_a_dead_graph_collected_meanwhile(monkeypatch):
    """An unreachable CUDAGraph of an earlier model, in a reference cycle, must not be destroyed inside the capture
    (its cudaGraphExecDestroy is not permitted while a stream captures, and invalidates the capture): with such a
    cycle made garbage during the capture and the collector due at the next allocation, generate still runs its
    graph, with the tokens of the eager step, and the collector frees the cycle afterwards."""
    import gc
    import weakref

    import patcher.decode.generate as gen

    model = rm.build("tiny-llama", dtype=torch.float16, device="cuda")
    model.generation_config.eos_token_id = None
    patch_model(model)
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    eager = DecodeRunner(model, DecodeOptions(use_graphs=False))
    expected = eager.generate(ids, torch.ones_like(ids), 8, Sampling(), eos=[], pad_token_id=0)

    class Cycle:
        pass

    earlier = [torch.cuda.CUDAGraph()]
    buffer = torch.zeros(4, device="cuda")
    with torch.cuda.graph(earlier[0]):
        buffer.add_(1)
    seen = {}
    run_step = DecodeRunner.run_step

    def step_dropping_a_graph(self, *args, **kwargs):
        if torch.cuda.is_current_stream_capturing() and earlier:
            cycle = Cycle()  # young garbage: only its own cycle holds it and the graph
            cycle.graph, cycle.self = earlier.pop(), cycle
            seen["freed"] = weakref.ref(cycle)
            seen["collector_on"] = gc.isenabled()
            del cycle
            [[] for _ in range(1000)]  # container allocations: the collector's trigger
        return run_step(self, *args, **kwargs)

    monkeypatch.setattr(DecodeRunner, "run_step", step_dropping_a_graph)
    thresholds = gc.get_threshold()
    gc.set_threshold(1)
    try:
        got = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    finally:
        gc.set_threshold(*thresholds)
    assert gen.generate_path(model) == {"path": "graph", "reason": None}, gen.generate_path(model)
    assert torch.equal(got, expected)
    assert seen["collector_on"] is False
    gc.collect()
    assert seen["freed"]() is None
