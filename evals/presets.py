"""The generate() arguments applications pass, as presets of `evals.tpot --generate-args` (each a row of its table).

Each preset is a function of the run's Setup (vocabulary size, tokenizer, batch) and the number of tokens a call
asks for, returning generate() keyword arguments:

  greedy          do_sample=False
  sampling        do_sample, temperature 0.7, top_k 20, top_p 0.8
  qwen-instruct   Qwen2-1.5B-Instruct's generation_config: do_sample, temperature 0.7, top_p 0.8, top_k 20,
                  repetition_penalty 1.1, two EOS ids
  llama-instruct  Llama-3.1-8B-Instruct's generation_config: do_sample, temperature 0.6, top_p 0.9 (top_k stays
                  transformers' default, as for that model), three EOS ids
  streamer        greedy with a TextStreamer(skip_prompt=True) that decodes every token to text and writes nothing
                  (at batch > 1 one such streamer a row, as TextStreamer takes one row)
  min-new-tokens  greedy, min_new_tokens = the tokens the call asks for, with two EOS ids (the processor acts only
                  where there are EOS ids)
  stop-strings    greedy, three stop_strings the text never holds, with the tokenizer
  hidden-states   greedy with output_hidden_states and return_dict_in_generate: a call the decode graph does not
                  serve (it keeps no hidden states), so a patched model runs HF's static cache + compile
  static-cache    greedy with cache_implementation="static", as transformers' docs advise for speed: the caller's
                  choice of HF's compiled loop, which a patched model runs as the unpatched one does (the static cache
                  sized as hf-static-compiled's, so that each mode compiles once)

EOS ids: the last ids of the model's vocabulary (config.vocab_size), which a random-weight model makes no more often
than any other id. Every call's output is checked after the timing: one shorter than asked (every row stopped at an
EOS id or a stop string) makes the row an error instead of a timing. At batch > 1 a row that stops early while
others go on leaves the work per step unchanged (the whole batch is decoded each step); the row counts such rows in
"rows_stopped_early". Sampling calls are seeded (torch.manual_seed(SEED) before each generate), so a run reproduces.

The random-weight models have no tokenizer: offline_tokenizer builds one of exactly the model's vocabulary, id i
being the token "Ġt{i}" (byte-level, decoded as " t{i}"), so that TextStreamer and StopStringCriteria work on it as on
a real byte-level BPE tokenizer. A model loaded with its own tokenizer uses that one.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast, TextStreamer
from transformers.generation.streamers import BaseStreamer

SEED = 0
# Every token of the offline tokenizer decodes to " t" and digits, so these never occur in its text; each ends in
# " t", the start of a token, as StopStringCriteria needs (it rejects a stop string no token can complete).
OFFLINE_STOP_STRINGS = ("t t", "tt t", "5  t")
# For a model's own tokenizer: strings a trained model does not write.
STOP_STRINGS = ("<|stop-a|>", "<|stop-b|>", "\n\n###END###")


@dataclass
class Setup:
    """What the presets' arguments are built from, once a run."""

    vocab_size: int
    tokenizer: Any = None
    batch: int = 1
    offline: bool = True  # the tokenizer is offline_tokenizer's

    @property
    def stop_strings(self) -> list[str]:
        return list(OFFLINE_STOP_STRINGS if self.offline else STOP_STRINGS)


def last_ids(setup: Setup, count: int) -> list[int]:
    return list(range(setup.vocab_size - count, setup.vocab_size))


class QuietTextStreamer(TextStreamer):
    """TextStreamer's decoding of each token to text, without writing it anywhere: the streamer's cost in a benchmark.
    It only counts the characters it would have printed."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, skip_prompt=True, **kwargs)
        self.chars = 0

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        self.chars += len(text)


class RowStreamers(BaseStreamer):
    """One QuietTextStreamer a batch row (TextStreamer takes a single row): the prompt [B, T] first, then [B] tokens a
    step, as generate() feeds a streamer."""

    def __init__(self, tokenizer, batch: int):
        self.rows = [QuietTextStreamer(tokenizer) for _ in range(batch)]

    def put(self, value: torch.Tensor) -> None:
        for i, row in enumerate(self.rows):
            row.put(value[i] if value.dim() == 2 else value[i : i + 1])

    def end(self) -> None:
        for row in self.rows:
            row.end()


def streamer_for(setup: Setup) -> BaseStreamer:
    return QuietTextStreamer(setup.tokenizer) if setup.batch == 1 else RowStreamers(setup.tokenizer, setup.batch)


SAMPLING = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}

PRESETS: dict[str, Callable[[Setup, int], dict]] = {
    "greedy": lambda setup, n: {"do_sample": False},
    "sampling": lambda setup, n: dict(SAMPLING),
    "qwen-instruct": lambda setup, n: {**SAMPLING, "repetition_penalty": 1.1, "eos_token_id": last_ids(setup, 2)},
    "llama-instruct": lambda setup, n: {
        "do_sample": True,
        "temperature": 0.6,
        "top_p": 0.9,
        "eos_token_id": last_ids(setup, 3),
    },
    "streamer": lambda setup, n: {"do_sample": False, "streamer": streamer_for(setup)},
    "min-new-tokens": lambda setup, n: {"do_sample": False, "min_new_tokens": n, "eos_token_id": last_ids(setup, 2)},
    "stop-strings": lambda setup, n: {
        "do_sample": False,
        "stop_strings": setup.stop_strings,
        "tokenizer": setup.tokenizer,
    },
    "hidden-states": lambda setup, n: {
        "do_sample": False,
        "output_hidden_states": True,
        "return_dict_in_generate": True,
    },
    "static-cache": lambda setup, n: {"do_sample": False, "cache_implementation": "static"},
}
NEEDS_TOKENIZER = {"streamer", "stop-strings"}


def parse(text: str) -> list[str]:
    """--generate-args: comma-separated preset names, each once, in the order given."""
    names = list(dict.fromkeys(name.strip() for name in text.split(",") if name.strip()))
    unknown = [name for name in names if name not in PRESETS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown preset(s) {', '.join(map(repr, unknown)) or repr(text)}; choose from {', '.join(PRESETS)}"
        )
    return names


def arguments(name: str, setup: Setup, new_tokens: int) -> dict:
    """The generate() keyword arguments of preset `name` for a call asking for `new_tokens` tokens."""
    return PRESETS[name](setup, new_tokens)


def describe(kwargs: dict) -> dict:
    """The arguments as the JSON records them: objects by their class name."""
    plain = (bool, int, float, str, type(None))
    return {
        k: v if isinstance(v, plain) else list(v) if isinstance(v, (list, tuple)) else type(v).__name__
        for k, v in kwargs.items()
    }


def eos_ids(kwargs: dict) -> list[int]:
    eos = kwargs.get("eos_token_id")
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def offline_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer of exactly `vocab_size` tokens, built without files or network: id i is "Ġt{i}" and
    decodes to " t{i}"; text of such words encodes back to the ids. Builds in a fraction of a second for 150k ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"\u0120t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="\u0120t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r" ?[^ ]+"), behavior="isolated"),  # each word with the space before it
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer)


def add_ratios(rows: list[dict]) -> None:
    """Adds to each measured preset row "x_greedy" (its TPOT over the greedy preset's at the same mode, batch and
    context) and, to the patched modes' rows, "x_hf_static" (over hf-static-compiled's with the same preset, batch
    and context), where those rows were measured."""
    tpot = {(r["mode"], r.get("preset"), r["batch"], r["context"]): r["tpot_ms"] for r in rows if "tpot_ms" in r}
    for row in rows:
        if "tpot_ms" not in row or "preset" not in row:
            continue
        where = (row["batch"], row["context"])
        greedy = tpot.get((row["mode"], "greedy", *where))
        if greedy:
            row["x_greedy"] = row["tpot_ms"] / greedy
        static = tpot.get(("hf-static-compiled", row["preset"], *where))
        if static and row["mode"].startswith("patched"):
            row["x_hf_static"] = row["tpot_ms"] / static
