"""The decode runner's logits processing (patcher/decode/processors.py) against transformers' own processors.

CPU: the processors on random logits and token histories give HF's scores exactly (the same float32 ops), at the
lengths where each one switches on or off; the eager decode runner's greedy tokens equal HF's generate with the same
arguments on tiny models; the instruct models' generation configs take the decode path. GPU: the same through the
captured graph.
"""

from __future__ import annotations

import dataclasses
import math
import types
import warnings

import pytest
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import TopKLogitsWarper

from patcher import patch_model
from patcher import random_models as rm
from patcher.decode import DecodeOptions, DecodeRunner
from patcher.decode.generate import generate_path
from patcher.decode.processors import SURVIVORS_PER_K, Processors, Sampling
from patcher.decode.reasons import call_reason

EAGER = DecodeOptions(use_graphs=False)
VOCAB = 512  # the tiny models' vocabulary

# Each a set of generate arguments (greedy) the runner must reproduce.
GREEDY_ARGS = [
    {"repetition_penalty": 1.3},
    {"repetition_penalty": 0.7},
    {"min_new_tokens": 6, "eos_token_id": [7, 11]},
    {"min_length": 20, "eos_token_id": 7},
    {"suppress_tokens": [1, 2, 3, 300], "begin_suppress_tokens": [5, 9]},
    {"forced_eos_token_id": 4},
    {"repetition_penalty": 1.1, "min_new_tokens": 3, "eos_token_id": [7], "suppress_tokens": [8]},
    {"no_repeat_ngram_size": 1},
    {"no_repeat_ngram_size": 2},
    {"no_repeat_ngram_size": 3, "repetition_penalty": 1.2},
    {"bad_words_ids": [[5], [17, 18], [18, 19, 20]], "eos_token_id": [5, 9]},  # [5] is an EOS id: dropped
    {"bad_words_ids": [[7], [20, 21], [21, 20]], "eos_token_id": 7},  # HF drops [7]
]
SAMPLING_ARGS = [
    {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.1},  # Qwen2-Instruct
    {"do_sample": True, "temperature": 0.6, "top_p": 0.9},  # Llama-3.1-Instruct
    {"do_sample": True, "min_p": 0.1, "temperature": 1.3},
    {"do_sample": True, "top_k": 0, "top_p": 0.9},  # top-k off: the warpers read the whole vocabulary
]


def hf_processors(model, args: dict, ids, mask, new_tokens: int):
    """transformers' own processor list for a generate call with `args`, as generate builds it."""
    config, _ = model._prepare_generation_config(GenerationConfig(**args, max_new_tokens=new_tokens))
    config.max_length = ids.shape[1] + new_tokens
    model._prepare_special_tokens(config, device=ids.device)
    return model._get_logits_processor(
        config, input_ids_seq_length=ids.shape[1], device=ids.device, model_kwargs={"attention_mask": mask}
    )


def ours(model, args: dict, ids, mask, new_tokens: int, batch: int | None = None):
    """The runner's Processors for the same call (for `batch` rows, default the prompt's), and the generate arguments
    call_reason prepared."""
    reason, prepared = call_reason(model, GenerationConfig(**args, max_new_tokens=new_tokens),
                                   {"input_ids": ids, "attention_mask": mask})  # fmt: skip
    assert reason is None, reason
    rows = ids.shape[0] if batch is None else batch
    return Processors(prepared["sampling"], VOCAB, ids.device, batch=rows), prepared


def state(tokens, pad, length: int, prompt_len: int, new_tokens: int, begin_index: int, sampling: Sampling):
    """The StepState fields the processors read, for the step whose sequence so far has `length` tokens."""
    return types.SimpleNamespace(
        tokens=tokens, slot=torch.tensor([length - 1]), pad=pad, prompt_len=torch.tensor(prompt_len),
        begin_index=torch.tensor(begin_index), max_length=torch.tensor(prompt_len + new_tokens),
        min_length=torch.tensor(sampling.min_length), min_new_tokens=torch.tensor(sampling.min_new_tokens),
    )  # fmt: skip


@pytest.mark.parametrize("args", GREEDY_ARGS + SAMPLING_ARGS, ids=lambda a: ",".join(a))
def test_processors_give_hf_scores(args):
    """At every length from the prompt's to max_length - 1, on logits with ties and negative and positive values:
    our greedy scores equal HF's processors' exactly; with sampling, the warped scores before the draw equal HF's
    warpers' up to the order of tied scores (the draw itself differs: HF's multinomial against probs / Exp(1), the
    same distribution)."""
    model = rm.build("tiny-llama")
    g = torch.Generator().manual_seed(0)
    batch, prompt, new_tokens = 3, 6, 12
    mask = torch.ones(batch, prompt, dtype=torch.long)
    mask[1, :2] = 0
    tokens = torch.randint(0, 40, (batch, prompt + new_tokens + 1), generator=g)  # few ids: many repeats
    pad = (mask == 0).sum(-1)
    hf = hf_processors(model, args, tokens[:, :prompt], mask, new_tokens)
    processors, _ = ours(model, args, tokens[:, :prompt], mask, new_tokens)
    for length in range(prompt, prompt + new_tokens):
        logits = torch.randn(batch, VOCAB, generator=g).mul(3).round(decimals=1)
        st = state(tokens, pad, length, prompt, new_tokens, prompt, processors.sampling)
        if length == prompt:  # as generate does; each step then adds its current token to the penalty's mask
            processors.start(st, prompt)
        expected = hf(tokens[:, :length], logits.clone())
        if processors.sampling.do_sample:
            before = _before_warpers(processors, logits, st)
            assert_warped_as_hf(processors.warp(before), expected, before, f"{args} at length {length}")
        else:
            assert torch.equal(processors(logits, st), expected), f"{args} at length {length}"


def assert_warped_as_hf(got, expected, before, what: str) -> None:
    """Warped scores equal HF's up to which of several equal scores top-p removes: HF sorts with torch's unstable
    sort, whose order of equal values is the implementation's (the runner sorts top-k's survivors in id order).
    Each row keeps the same scores, and where the two differ, the scores before warping are all one value."""
    for row in range(got.shape[0]):
        kept, hf_kept = got[row][got[row] > -math.inf], expected[row][expected[row] > -math.inf]
        assert torch.equal(kept.sort().values, hf_kept.sort().values), f"{what}, row {row}: different scores kept"
        differ = got[row] != expected[row]
        assert before[row][differ].unique().numel() <= 1, f"{what}, row {row}: differs beyond a tie"


def _before_warpers(processors, logits, st):
    """The processors' scores with the warpers and the draw left out (a fresh mask of the tokens so far)."""
    sampling = dataclasses.replace(processors.sampling, do_sample=False)
    greedy = Processors(sampling, VOCAB, logits.device, batch=logits.shape[0])
    greedy.start(st, int(st.slot) + 1)
    return greedy(logits, st)


def test_top_k_survivors_keep_every_tie_of_the_kth_score():
    """More tokens than top_k tie with the k-th largest score (fewer than SURVIVORS_PER_K * top_k): HF keeps them
    all, and so do the survivors."""
    k = 4
    scores = torch.linspace(-5, 0, VOCAB).repeat(2, 1)
    scores[0, [10, 70, 130, 190, 250, 310]] = 1.0  # six tokens tie at the top: all of them are the k-th largest
    scores[1, [3, 5]] = 2.0
    scores[1, [7, 9, 11]] = 1.5  # the k-th largest is 1.5, tied three times: five tokens kept
    assert 6 < SURVIVORS_PER_K * k
    processors = Processors(Sampling(do_sample=True, top_k=k), VOCAB, scores.device)
    expected = TopKLogitsWarper(k)(None, scores.clone())
    assert torch.equal(processors.warp(scores), expected)
    assert (expected > -math.inf).sum(-1).tolist() == [6, 5]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_top_k_sampling_reads_the_logits_as_the_float_path_does(dtype):
    """With top-k on and no processor before the warpers, the step samples from the logits in their own dtype (no
    float32 copy); the draw, its ids and the seed's use equal the float32 path's (the one that keeps the scores)."""
    sampling = Sampling(do_sample=True, temperature=0.7, top_k=20, top_p=0.8, eos=(VOCAB - 1,))
    processors = Processors(sampling, VOCAB, torch.device("cpu"))
    assert not processors.masks
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(5)).mul(3).to(dtype)
    tokens = torch.zeros(4, 8, dtype=torch.long)
    st = state(tokens, torch.zeros(4, dtype=torch.long), 6, 6, 2, 6, sampling)
    torch.manual_seed(6)
    drawn, ids = processors(logits, st)
    torch.manual_seed(6)
    kept = (torch.empty(4, VOCAB), torch.empty(4, VOCAB))
    drawn_float, ids_float = processors(logits, st, kept)
    assert torch.equal(ids, ids_float) and torch.equal(drawn, drawn_float)
    assert torch.equal(kept[1], logits.float())


@pytest.mark.parametrize("args", SAMPLING_ARGS, ids=lambda a: ",".join(a))
def test_sampling_draws_from_the_warped_scores(args):
    """What the step hands next_token: its argmax is a draw from softmax(warped scores), the warped scores it keeps
    for the dict output are `warp`'s; 20,000 rows of one row's logits drawn at once, total variation <= 0.03."""
    model = rm.build("tiny-llama")
    prompt, new_tokens, rows = 6, 4, 20_000
    ids = torch.randint(0, 40, (1, prompt), generator=torch.Generator().manual_seed(2))
    processors, _ = ours(model, args, ids, torch.ones_like(ids), new_tokens, batch=rows)
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3)).mul(3).expand(rows, -1).contiguous()
    tokens = torch.cat([ids, torch.zeros(1, new_tokens + 1, dtype=torch.long)], 1).expand(rows, -1)
    st = state(tokens, torch.zeros(rows, dtype=torch.long), prompt, prompt, new_tokens, prompt, processors.sampling)
    processors.start(st, prompt)
    kept = (torch.empty(rows, VOCAB), torch.empty(rows, VOCAB))
    torch.manual_seed(4)
    out = processors(logits, st, kept)
    if isinstance(out, tuple):  # with top-k: (probs / E of the survivors, their ids)
        drawn = out[1].gather(1, out[0].argmax(-1, keepdim=True)).squeeze(1)
    else:
        drawn = out.argmax(-1)
    warped = processors.warp(_before_warpers(processors, logits, st))
    assert torch.equal(kept[0], warped) and torch.equal(kept[1], logits)
    probs = warped[0].softmax(-1)
    assert bool((probs[drawn] > 0).all()), "a token the warpers removed was drawn"
    frequency = torch.bincount(drawn, minlength=VOCAB).float() / rows
    assert (frequency - probs).abs().sum().item() / 2 <= 0.03


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-pythia"])
@pytest.mark.parametrize("args", GREEDY_ARGS, ids=lambda a: ",".join(a))
def test_runner_greedy_matches_hf_generate(name, args):
    """fp32 on the CPU: the eager decode runner with HF's processing gives HF generate's greedy tokens, left-padded
    rows included."""
    model = rm.build(name)
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    new_tokens = 16
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                  pad_token_id=0, **args)  # fmt: skip
    patch_model(model)
    _, prepared = ours(model, {"do_sample": False, "pad_token_id": 0, **args}, ids, mask, new_tokens)
    got = DecodeRunner(model, EAGER).generate(**prepared)
    assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "config",
    [
        {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1},
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [5, 6, 7]},
    ],
    ids=["qwen2-instruct", "llama-3.1-instruct"],
)
def test_instruct_generation_configs_take_the_decode_path(config):
    """Qwen2-1.5B-Instruct's and Llama-3.1-8B-Instruct's generation configs set on a model: nothing in them sends
    a call to HF's loop."""
    model = rm.build("tiny-qwen2")
    patch_model(model)
    model.generation_config = GenerationConfig(**config)
    ids = torch.randint(3, VOCAB, (1, 5))
    reason, prepared = call_reason(model, None, {"input_ids": ids, "max_new_tokens": 4})
    assert reason is None, reason
    assert prepared["sampling"].do_sample and prepared["sampling"].top_p < 1


def test_bad_processor_arguments_go_to_hf_with_the_reason():
    model = rm.build("tiny-llama")
    patch_model(model)
    ids = torch.randint(3, VOCAB, (1, 5))
    for args, message in (
        ({"suppress_tokens": [VOCAB + 3]}, "outside the vocabulary"),
        ({"bad_words_ids": [[3, VOCAB + 1]]}, "outside the vocabulary"),
        ({"bad_words_ids": [3, 4]}, "bad_words_ids"),  # not a list of lists
        ({"bad_words_ids": [[3], []]}, "an empty word"),  # each transformers release treats it its own way
        ({"sequence_bias": [[[3], -1.0]]}, "sequence_bias"),
    ):
        reason, _ = call_reason(model, GenerationConfig(**args, max_new_tokens=3), {"input_ids": ids})
        assert reason is not None and message in reason, reason


def graph_path_equals_hf(model, ids, **kwargs):
    """GPU: patched generate with `kwargs` takes the graph path (no fallback warning) and gives unpatched HF's
    output; returns both."""
    with torch.no_grad():
        expected = model.generate(ids, **kwargs)
    patch_model(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = model.generate(ids, **kwargs)
    assert generate_path(model)["path"] == "graph"
    assert torch.equal(got, expected)
    return got, expected


@pytest.mark.gpu
@pytest.mark.parametrize("args", GREEDY_ARGS, ids=lambda a: ",".join(a))
def test_graph_path_with_processors_matches_hf(args):
    """GPU, fp32: generate takes the graph path with these arguments, and its greedy tokens equal HF's."""
    model = rm.build("tiny-llama", device="cuda")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    graph_path_equals_hf(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                         pad_token_id=0, **args)  # fmt: skip


def test_min_lengths_share_one_graph_key():
    """Calls that differ only in min_length or min_new_tokens share the processors' masks and the captured graph:
    the values reach the step as device tensors."""
    base = Sampling(eos=(7,), min_new_tokens=3, min_length=4)
    assert base.graph_key() == Sampling(eos=(7,), min_new_tokens=9, min_length=30).graph_key()
    assert base.graph_key() != Sampling(eos=(7,)).graph_key()  # off is another graph: no processing at all


@pytest.mark.gpu
def test_graph_is_captured_once_for_any_min_new_tokens():
    """GPU, fp32: min_new_tokens 3, then 9, then min_length 20 on one patched model: HF's tokens each time, and the
    second and third calls replay the first call's graph."""
    model = rm.build("tiny-llama", device="cuda")
    ids = torch.randint(3, VOCAB, (2, 9), device="cuda")
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 16, "do_sample": False, "pad_token_id": 0,
              "eos_token_id": [7, 11]}  # fmt: skip
    calls = [{"min_new_tokens": 3}, {"min_new_tokens": 9}, {"min_new_tokens": 5, "min_length": 20}]
    with torch.no_grad():
        expected = [model.generate(ids, **kwargs, **c) for c in calls]
    patch_model(model)
    graphs = []
    for call, want in zip(calls, expected, strict=True):
        assert torch.equal(model.generate(ids, **kwargs, **call), want), call
        assert generate_path(model)["path"] == "graph"
        graphs.append(model._patcher_state.runner.states[2].graph)
    assert graphs[0] is graphs[1], "a new min_new_tokens value captured a new graph"
    assert graphs[1] is not graphs[2]  # min_length switched on: another processing


class Recorder:
    """A BaseStreamer that keeps what it is given."""

    def __init__(self):
        self.puts, self.ended = [], 0

    def put(self, value):
        self.puts.append(value.clone())

    def end(self):
        self.ended += 1


@pytest.mark.parametrize("eos", [None, "early"])
def test_streamer_gets_what_hf_gives_it(eos):
    """The eager runner hands a streamer the prompt, then each step's tokens, and ends it, exactly as HF's generate
    does; with an EOS id that every row reaches, both stop feeding after the step in which the last row finished."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    args = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, **args)
    if eos == "early":  # a token each row makes, so that the rows finish at different steps
        args["eos_token_id"] = [int(free[0, 9]), int(free[1, 12])]
    hf = Recorder()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, streamer=hf, **args)
    patch_model(model)
    streamer = Recorder()
    reason, prepared = call_reason(model, GenerationConfig(**args), {"input_ids": ids, "attention_mask": mask,
                                                                     "streamer": streamer})  # fmt: skip
    assert reason is None, reason
    got = DecodeRunner(model, EAGER).generate(**prepared)
    assert torch.equal(got, expected)
    assert (expected.shape[1] < ids.shape[1] + 24) == (eos == "early")
    assert streamer.ended == hf.ended == 1
    assert len(streamer.puts) == len(hf.puts) and all(torch.equal(a, b) for a, b in zip(streamer.puts, hf.puts))


def test_streamer_without_its_methods_goes_to_hf():
    model = rm.build("tiny-llama")
    patch_model(model)
    reason, _ = call_reason(model, None, {"input_ids": torch.ones(1, 3, dtype=torch.long), "streamer": object()})
    assert "streamer" in reason


@pytest.mark.gpu
def test_graph_path_feeds_a_streamer_as_hf_does():
    """GPU, fp32: a streamer keeps the call on the graph path and gets what HF's generate gives it."""
    model = rm.build("tiny-qwen2", device="cuda")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (1, 9), device="cuda")
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 20, "do_sample": False, "pad_token_id": 0}
    hf, ours_ = Recorder(), Recorder()
    with torch.no_grad():
        expected = model.generate(ids, streamer=hf, **kwargs)
    patch_model(model)
    got = model.generate(ids, streamer=ours_, **kwargs)
    assert generate_path(model)["path"] == "graph"
    assert torch.equal(got, expected)
    assert len(ours_.puts) == len(hf.puts) and all(torch.equal(a, b) for a, b in zip(ours_.puts, hf.puts))


def char_tokenizer():
    """A tokenizer over the tiny models' 512 ids: letters, digits and punctuation, then letter pairs."""
    import itertools
    import string

    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_lowercase + string.digits + " .,!?")
    pairs = ["".join(p) for p in itertools.product(string.ascii_lowercase, repeat=2)]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate((chars + pairs)[:VOCAB])}, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("with_eos", [False, True])
@pytest.mark.parametrize("with_streamer", [False, True])
def test_stop_strings_stop_rows_as_hf_does(with_streamer, with_eos):
    """stop_strings (with the tokenizer, as HF takes them): the eager runner finishes each row where HF's
    StopStringCriteria does, pads it from there where the call has EOS ids (HF lets it run on where it has none),
    and stops where HF stops; a streamer gets HF's tokens, pads included."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    tokenizer = char_tokenizer()
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    args = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free = model.generate(ids, attention_mask=mask, **args)
    # a string each row makes at a different step: row 0's 4th new token, row 1's 9th
    stops = [tokenizer.decode(free[0, 10:11]), tokenizer.decode(free[1, 14:16])]
    args.update(stop_strings=stops, tokenizer=tokenizer)
    if with_eos:
        args["eos_token_id"] = 1  # a token neither row makes here
    hf, streamer = Recorder(), Recorder()
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, streamer=hf if with_streamer else None, **args)
    assert not (free[:, 7:16] == 1).any()
    assert expected.shape[1] == 16 and (expected[0, 11:] == 0).all() == with_eos  # row 0 padded after its stop
    patch_model(model)
    kwargs = {"input_ids": ids, "attention_mask": mask, "streamer": streamer if with_streamer else None}
    reason, prepared = call_reason(model, GenerationConfig(**{k: v for k, v in args.items() if k != "tokenizer"}),
                                   {**kwargs, "tokenizer": tokenizer})  # fmt: skip
    assert reason is None, reason
    got = DecodeRunner(model, EAGER).generate(**prepared)
    assert torch.equal(got, expected)
    if with_streamer:
        assert len(streamer.puts) == len(hf.puts) and all(torch.equal(a, b) for a, b in zip(streamer.puts, hf.puts))


def test_max_time_stops_the_runner():
    """max_time: the runner stops once the time is up (after at least one token), as HF's MaxTimeCriteria does."""
    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    patch_model(model)
    ids = torch.randint(3, VOCAB, (1, 5))
    reason, prepared = call_reason(model, GenerationConfig(max_new_tokens=200, max_time=0.0, pad_token_id=0),
                                   {"input_ids": ids})  # fmt: skip
    assert reason is None, reason
    got = DecodeRunner(model, EAGER).generate(**prepared)
    assert ids.shape[1] < got.shape[1] <= ids.shape[1] + 2


def test_stop_string_criteria_are_built_once_per_tokenizer_and_strings():
    """The StopStringCriteria a call needs is built on its first use and kept (the last STOP_STRING_CRITERIA_KEPT),
    for the same tokenizer and strings only."""
    from patcher.decode.reasons import STOP_STRING_CRITERIA_KEPT

    model = rm.build("tiny-llama")
    patch_model(model)
    ids = torch.ones(1, 3, dtype=torch.long)
    tokenizer, other = char_tokenizer(), char_tokenizer()

    def criterion(strings, tok):
        reason, prepared = call_reason(model, GenerationConfig(stop_strings=strings, max_new_tokens=3),
                                       {"input_ids": ids, "tokenizer": tok})  # fmt: skip
        assert reason is None, reason
        (made,) = prepared["criteria"]
        return made

    first = criterion(["ab", "c"], tokenizer)
    assert criterion(["ab", "c"], tokenizer) is first
    assert criterion(["ab", "c"], other) is not first  # another tokenizer object
    assert criterion(["ab"], tokenizer) is not first
    for i in range(STOP_STRING_CRITERIA_KEPT):
        criterion([f"x{i}"], tokenizer)
    assert len(model._patcher_state.stop_string_criteria) == STOP_STRING_CRITERIA_KEPT
    assert criterion(["ab", "c"], tokenizer) is not first  # dropped as the oldest


def test_stop_strings_without_a_tokenizer_go_to_hf():
    model = rm.build("tiny-llama")
    patch_model(model)
    reason, _ = call_reason(model, GenerationConfig(stop_strings=["x"], max_new_tokens=3),
                            {"input_ids": torch.ones(1, 3, dtype=torch.long)})  # fmt: skip
    assert reason == "stop_strings without a tokenizer"


@pytest.mark.gpu
def test_graph_path_with_stop_strings_matches_hf():
    """GPU, fp32: stop strings with EOS ids keep the call on the graph path, and its tokens equal HF's."""
    model = rm.build("tiny-llama", device="cuda")
    model.generation_config.eos_token_id = None
    tokenizer = char_tokenizer()
    ids = torch.randint(3, VOCAB, (2, 7), device="cuda", generator=torch.Generator("cuda").manual_seed(5))
    kwargs = {"attention_mask": torch.ones_like(ids), "max_new_tokens": 24, "do_sample": False, "pad_token_id": 0}
    with torch.no_grad():
        free = model.generate(ids, **kwargs)
    kwargs.update(stop_strings=[tokenizer.decode(free[0, 10:11]), tokenizer.decode(free[1, 14:16])],
                  tokenizer=tokenizer, eos_token_id=1)  # fmt: skip
    graph_path_equals_hf(model, ids, **kwargs)


class Boost:
    """A caller's own LogitsProcessor: adds 5 to the score of the token after the last one (mod the vocabulary)."""

    def __call__(self, input_ids, scores):
        return scores.scatter_add(1, (input_ids[:, -1:] + 1) % scores.shape[1], torch.full_like(scores[:, :1], 5.0))


@pytest.mark.parametrize("args", [{}, {"repetition_penalty": 1.2}], ids=["alone", "with-penalty"])
def test_callers_logits_processor_runs_as_hf_runs_it(args):
    """A LogitsProcessor passed to generate: the eager runner applies it after its own processors, on the
    sequences so far, and gives HF's greedy tokens; a processor of a type the config also makes (HF runs it in that
    one's place) goes to HF's loop with the reason."""
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    model = rm.build("tiny-llama")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, **args)
    extra = LogitsProcessorList([Boost()])
    with torch.no_grad():
        expected = model.generate(ids, attention_mask=mask, logits_processor=extra, **kwargs)
        plain = model.generate(ids, attention_mask=mask, **kwargs)
    assert not torch.equal(expected, plain)  # the processor changes the tokens
    patch_model(model)
    reason, prepared = call_reason(model, GenerationConfig(**kwargs), {"input_ids": ids, "attention_mask": mask,
                                                                       "logits_processor": extra})  # fmt: skip
    assert reason is None, reason
    got = DecodeRunner(model, EAGER).generate(**prepared)
    assert torch.equal(got, expected)
    clash = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5)])
    reason, _ = call_reason(model, GenerationConfig(max_new_tokens=3, repetition_penalty=1.2),
                            {"input_ids": ids, "logits_processor": clash})  # fmt: skip
    assert reason is not None and "RepetitionPenaltyLogitsProcessor" in reason, reason


@pytest.mark.gpu
def test_graph_path_with_callers_logits_processor_matches_hf():
    """GPU, fp32: the caller's processor runs between replays of the model's graph; tokens equal HF's."""
    from transformers import LogitsProcessorList

    model = rm.build("tiny-llama", device="cuda")
    model.generation_config.eos_token_id = None
    ids = torch.randint(3, VOCAB, (2, 7), device="cuda")
    graph_path_equals_hf(model, ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                         pad_token_id=0, logits_processor=LogitsProcessorList([Boost()]))  # fmt: skip
