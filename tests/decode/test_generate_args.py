"""no_repeat_ngram_size, bad_words_ids, the caller's stopping criteria and batches past 8 on the decode path.

CPU (reference backend, eager runner): each step's processed scores equal HF's processors on token histories made
to repeat n-grams and to end in bad words' prefixes; greedy tokens equal HF's generate; a caller's StoppingCriteria
finishes rows where HF's loop does, with and without EOS ids, with a streamer; batches 16 and 64 of left-padded
prompts give HF's tokens; GPTQ int4 models keep to the int4 kernels' 8 rows. GPU: the same on the graph path.
"""

from __future__ import annotations

import pytest
import torch
from test_processors import VOCAB, Recorder, graph_path_equals_hf, hf_processors, ours, state
from transformers import GenerationConfig, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria, MaxTimeCriteria

import patcher.decode.generate as gen
from patcher import patch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner, Sampling, reasons

EAGER = DecodeOptions(use_graphs=False)

SCORE_ARGS = [
    {"no_repeat_ngram_size": 1},
    {"no_repeat_ngram_size": 2},
    {"no_repeat_ngram_size": 3, "repetition_penalty": 1.3},
    # overlapping prefixes ([2, 3] inside [1, 2, 3], one prefix for two words), a word longer than the sequences at
    # first, pad (0) inside a prefix, an EOS word HF drops
    {"bad_words_ids": [[4], [2, 3, 5], [3, 5], [3, 6], [1, 2, 3, 6], [0, 0, 1], [1] * 9 + [2]], "eos_token_id": 6},
    {"bad_words_ids": [[3, 4], [4, 3]], "no_repeat_ngram_size": 2, "min_new_tokens": 4, "eos_token_id": [1, 4]},
]


@pytest.mark.parametrize("args", SCORE_ARGS, ids=lambda a: ",".join(a))
def test_ngram_and_bad_words_scores_equal_hf(args):
    """Token histories over 7 ids (left padding with 0 in one row): at every length our processed scores equal
    HF's processors' exactly, -inf and ties included."""
    model = rm.build("tiny-llama")
    g = torch.Generator().manual_seed(0)
    batch, prompt, new_tokens = 4, 5, 14
    tokens = torch.randint(0, 7, (batch, prompt + new_tokens + 1), generator=g)
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[1, :3], tokens[1, :3] = 0, 0
    tokens[2, :] = torch.tensor([1, 2, 3] * 7)[: tokens.shape[1]]  # repeats every n-gram and bad-word prefix
    hf = hf_processors(model, args, tokens[:, :prompt], mask, new_tokens)
    processors, _ = ours(model, args, tokens[:, :prompt], mask, new_tokens)
    banned = 0
    for length in range(prompt, prompt + new_tokens):
        logits = torch.randn(batch, VOCAB, generator=g).mul(3).round(decimals=1)
        expected = hf(tokens[:, :length], logits.clone())
        st = state(tokens, (mask == 0).sum(-1), length, prompt, new_tokens, prompt, processors.sampling)
        if length == prompt:
            processors.start(st, prompt)
        got = processors(logits, st)
        assert torch.equal(got, expected), f"{args} at length {length}"
        banned += int(torch.isinf(expected[:, :7]).sum())
    assert banned > 10  # the histories made the processors act


def free_run(model, ids, mask, new_tokens):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)


def runner_generate(model, ids, mask, args: dict, streamer=None):
    """The eager runner's output for generate's arguments `args` on the patched `model`."""
    kwargs = {k: v for k, v in args.items() if k != "stopping_criteria"}
    reason, prepared = reasons.call_reason(model, GenerationConfig(**kwargs), {
        "input_ids": ids, "attention_mask": mask, "streamer": streamer,
        "stopping_criteria": args.get("stopping_criteria")})  # fmt: skip
    assert reason is None, reason
    return DecodeRunner(model, EAGER).generate(**prepared)


def run_both(model, ids, mask, args):
    """HF's generate on the unpatched model and the eager runner with the same arguments: (HF's tokens, ours)."""
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, **args)
    patch_model(model)
    return expected, runner_generate(model, ids, mask, args)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_runner_greedy_with_ngrams_and_bad_words_matches_hf(name):
    """Greedy tokens equal HF's generate for n-gram sizes 1 to 3 and for bad words the model would otherwise make
    (one token, and two sharing a prefix), left-padded rows included. The 1-gram ban and the bad words change the
    tokens here (test_ngram_and_bad_words_scores_equal_hf has longer n-grams act)."""
    model = rm.build(name)
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    free = free_run(model, ids, mask, 14)
    a, b = int(free[1, 12]), int(free[1, 13])
    bad = [[int(free[0, 10])], [a, b], [a, (b + 1) % VOCAB], [int(free[0, 9]), a, b]]
    cases = [{"no_repeat_ngram_size": n} for n in (1, 2, 3)] + [{"bad_words_ids": bad}]
    cases = [dict(args, max_new_tokens=14, do_sample=False, pad_token_id=0) for args in cases]
    with torch.no_grad():
        expected = [model.generate(ids, attention_mask=mask, **args) for args in cases]
    patch_model(model)
    for args, tokens in zip(cases, expected):
        assert torch.equal(runner_generate(model, ids, mask, args), tokens), args
        if args.get("no_repeat_ngram_size", 1) == 1:
            assert not torch.equal(tokens, free), args


def test_repetition_penalty_mask_starts_afresh_each_call():
    """One runner, two calls with repetition_penalty and the same batch, so that its Processors and their mask of the
    tokens so far are reused: each call gives HF's greedy tokens, and after the second the mask holds exactly that
    call's tokens before its last (the last is never a step's current token)."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (2, 7), generator=g) for _ in range(2)]
    args = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": 0, "repetition_penalty": 1.5}
    with torch.no_grad():
        expected = [model.generate(ids, attention_mask=torch.ones_like(ids), **args) for ids in prompts]
    patch_model(model)
    runner = DecodeRunner(model, EAGER)
    for ids, want in zip(prompts, expected, strict=True):
        reason, prepared = reasons.call_reason(model, GenerationConfig(**args),
                                               {"input_ids": ids, "attention_mask": torch.ones_like(ids)})  # fmt: skip
        assert reason is None, reason
        assert torch.equal(runner.generate(**prepared), want)
    seen = runner.states[2].processors.seen
    tokens = expected[1][:, :-1]
    assert torch.equal(seen, torch.zeros_like(seen).scatter(1, tokens, True))


class StopAfter(StoppingCriteria):
    """Stops each row at the first token in `tokens[row]`, as a bool tensor [B]; records what it was given."""

    def __init__(self, tokens):
        self.tokens, self.seen = tokens, []

    def __call__(self, input_ids, scores, **kwargs):
        self.seen.append((input_ids.shape, input_ids.device.type, None if scores is None else len(scores)))
        return torch.tensor([int(input_ids[r, -1]) in t for r, t in enumerate(self.tokens)], device=input_ids.device)


class StopAtLength(StoppingCriteria):
    """Stops every row once the sequences reach `length`, as one bool."""

    def __init__(self, length):
        self.length = length

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids.shape[1] >= self.length


@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("with_streamer", [False, True])
def test_callers_stopping_criteria_stop_rows_as_hf_does(with_eos, with_streamer):
    """A caller's StoppingCriteria (a [B] tensor, and one bool) finishes rows where HF's loop does: padded from
    there where the call has EOS ids, run on where it has none; the call ends where HF's ends; a streamer gets HF's
    tokens; the criteria see the sequences on the model's device and the scores as HF passes them."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (3, 6), generator=torch.Generator().manual_seed(8))
    mask = torch.ones_like(ids)
    free = free_run(model, ids, mask, 20)
    stops = [[int(free[0, 9])], [int(free[1, 13])], []]  # row 2 never stops on a token
    args = {"max_new_tokens": 20, "do_sample": False, "pad_token_id": 0, "return_dict_in_generate": True,
            "output_scores": True}  # fmt: skip
    if with_eos:
        args["eos_token_id"] = 1  # a token no row makes here
    assert not (free[:, 6:] == 1).any()
    hf_seen, our_seen = StopAfter(stops), StopAfter(stops)
    hf_streamer, streamer = (Recorder(), Recorder()) if with_streamer else (None, None)
    with torch.no_grad():
        criteria = StoppingCriteriaList([hf_seen, StopAtLength(22)])
        expected = model.generate(ids, attention_mask=mask, streamer=hf_streamer, stopping_criteria=criteria, **args)
    patch_model(model)
    got, _, _ = runner_generate(model, ids, mask, dict(
        args, stopping_criteria=StoppingCriteriaList([our_seen, StopAtLength(22)])), streamer)  # fmt: skip
    assert expected.sequences.shape[1] == 22  # StopAtLength ends it, before max_new_tokens
    assert torch.equal(got, expected.sequences)
    assert (expected.sequences[0, 10:] == 0).all() == with_eos  # row 0 padded after its stop only with EOS ids
    assert our_seen.seen == hf_seen.seen
    if with_streamer:
        assert len(streamer.puts) == len(hf_streamer.puts)
        assert all(torch.equal(a, b) for a, b in zip(streamer.puts, hf_streamer.puts))


def test_callers_criteria_of_types_hf_makes():
    """A caller's MaxTimeCriteria takes the place of the config's (as HF merges them); a MaxLengthCriteria or an
    EosTokenCriteria (they set the length and the padding) goes to HF's loop with the reason."""
    model = rm.build("tiny-llama")
    patch_model(model)
    ids = torch.randint(3, VOCAB, (1, 5))
    config = GenerationConfig(max_new_tokens=4, max_time=5.0)
    mine = MaxTimeCriteria(max_time=0.0)
    reason, prepared = reasons.call_reason(model, config, {"input_ids": ids, "stopping_criteria": [mine]})
    assert reason is None and prepared["criteria"] == [] and prepared["own_criteria"] == [mine], reason
    for criterion in (MaxLengthCriteria(max_length=7), EosTokenCriteria(eos_token_id=3)):
        reason, _ = reasons.call_reason(model, config, {"input_ids": ids, "stopping_criteria": [criterion]})
        assert reason is not None and type(criterion).__name__ in reason, reason
    reason, _ = reasons.call_reason(model, config, {"input_ids": ids, "stopping_criteria": mine})  # not in a list
    assert reason is not None and "not a list" in reason, reason


def padded_prompts(batch: int, seed: int):
    """Left-padded prompts of 4 to 12 tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(torch.randint(0, 9, (batch,), generator=g).tolist()):
        mask[row, :pad], ids[row, :pad] = 0, 0
    return ids, mask


@pytest.mark.parametrize("batch", [16, 64])
def test_runner_large_batches_match_hf(batch):
    """Batches past the GEMV kernels' 8 rows: greedy tokens equal HF's for left-padded prompts of different
    lengths (with n-grams banned and EOS ids, so rows finish at different steps)."""
    model = rm.build("tiny-qwen2")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(batch, batch)
    free = free_run(model, ids, mask, 6)
    args = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "no_repeat_ngram_size": 2,
            "eos_token_id": [int(free[0, 14]), int(free[5, 15])]}  # fmt: skip
    expected, got = run_both(model, ids, mask, args)
    assert torch.equal(got, expected)


def test_num_return_sequences_past_eight_rows():
    """3 prompts x 5 sequences = 15 rows; top_k=1 sampling (one token left to draw) gives HF's tokens."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(3, 1)
    args = {"max_new_tokens": 5, "do_sample": True, "top_k": 1, "num_return_sequences": 5, "pad_token_id": 0}
    expected, got = run_both(model, ids, mask, args)
    assert got.shape[0] == 15 and torch.equal(got, expected)


def test_int4_models_decode_past_eight_rows_in_chunks(monkeypatch):
    """A model with GPTQ int4 linears, whose kernels take 1 to 8 rows: a left-padded batch of 11 decodes as chunks of
    8 and 3 rows over one cache and gives HF's greedy tokens; generate takes the runner for it (the CPU model stands
    in for a CUDA one: its runner runs eagerly), and sends a batch past 64 rows to HF's loop with the reason."""
    model = rm.quantize_random(rm.build("tiny-llama"), group_size=32)
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(11, 3)
    args = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    expected, got = run_both(model, ids, mask, args)
    assert torch.equal(got, expected)
    runner = DecodeRunner(model, EAGER)
    assert runner.step_rows()[0] == 8
    runner.generate(ids, mask, 2, Sampling(), eos=[], pad_token_id=0)
    st = runner.states[11]
    assert [c.batch for c in st.chunks] == [8, 3]
    assert st.chunks[1].k.data_ptr() == st.k[:, 8].data_ptr()  # views of one cache
    assert st.chunks[1].tokens.data_ptr() == st.tokens[8].data_ptr()
    model._patcher_state.runner = runner
    monkeypatch.setattr(gen, "model_reason", lambda model: None)
    model.generate(ids, attention_mask=mask, **args)
    assert gen.generate_path(model)["path"] == "eager-runner"
    many = torch.randint(3, VOCAB, (65, 4))
    with pytest.warns(UserWarning, match="batch 65.*1 to 64"):
        model.generate(many, max_new_tokens=1, do_sample=False, pad_token_id=0)
    assert gen.generate_path(model)["path"] == "hf"


# ---- GPU ---------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 16, 64])
@pytest.mark.parametrize("args", [{"no_repeat_ngram_size": 2}, {"no_repeat_ngram_size": 3},
                                  {"bad_words_ids": [[11], [12, 13], [12, 14], [40, 12, 13]]}],
                         ids=lambda a: ",".join(f"{k}={v}" for k, v in a.items())[:40])  # fmt: skip
def test_graph_path_with_ngrams_and_bad_words_matches_hf(args, batch):
    """GPU, fp32: the graph path with these arguments gives HF's greedy tokens, left-padded rows included."""
    model = rm.build("tiny-llama", device="cuda")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(batch, batch)
    graph_path_equals_hf(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, do_sample=False,
                         pad_token_id=0, **args)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 7, 16, 64])
@pytest.mark.parametrize("with_eos", [False, True])
def test_graph_path_with_callers_stopping_criteria_matches_hf(batch, with_eos):
    """GPU, fp32: a caller's StoppingCriteria keeps the call on the graph path and stops rows as HF's loop does."""
    model = rm.build("tiny-qwen2", device="cuda")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(batch, batch + 1)
    ids, mask = ids.cuda(), mask.cuda()
    kwargs = {"attention_mask": mask, "max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    free = free_run(model, ids, mask, 20)
    stops = [[int(free[r, 12 + r % 6])] for r in range(batch)]
    extra = {"eos_token_id": 1} if with_eos else {}
    with torch.no_grad():
        expected = model.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(stops)]), **kwargs, **extra)
    patch_model(model)
    got = model.generate(ids, stopping_criteria=StoppingCriteriaList([StopAfter(stops)]), **kwargs, **extra)
    assert gen.generate_path(model)["path"] == "graph"
    assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [16, 64])
def test_graph_path_large_batches_match_hf(batch):
    """GPU, fp32: batches 16 and 64 (dense linears on cuBLAS) take the graph path and give HF's greedy tokens, with
    repetition_penalty and EOS ids."""
    model = rm.build("tiny-pythia", device="cuda")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(batch, 2)
    graph_path_equals_hf(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=24, do_sample=False,
                         pad_token_id=0, repetition_penalty=1.1, eos_token_id=[5, 6])  # fmt: skip


@pytest.mark.gpu
def test_graph_path_num_return_sequences_matches_hf():
    """GPU, fp32: 4 prompts x 4 sequences (16 rows) with top_k=1 sampling: the graph path gives HF's tokens."""
    model = rm.build("tiny-llama", device="cuda")
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(4, 3)
    graph_path_equals_hf(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=12, do_sample=True, top_k=1,
                         num_return_sequences=4, pad_token_id=0, no_repeat_ngram_size=3)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-pythia"])
def test_graph_path_int4_past_eight_rows_matches_hf(name):
    """GPU, fp32: a GPTQ int4 model at batch 19 takes the graph path, its step running chunks of 8, 8 and 3 rows over
    one cache, and gives HF's greedy tokens, with repetition_penalty and EOS ids."""
    model = rm.quantize_random(rm.build(name, device="cuda"), group_size=32)
    model.generation_config.eos_token_id = None
    ids, mask = padded_prompts(19, 4)
    graph_path_equals_hf(model, ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=16, do_sample=False,
                         pad_token_id=0, repetition_penalty=1.1, eos_token_id=[5, 6])  # fmt: skip
    assert [c.batch for c in model._patcher_state.runner.states[19].chunks] == [8, 8, 3]
