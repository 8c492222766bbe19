"""K slices of the int4 decode step against the split rule, interleaved in one process: `python -m evals.splits`.

The int4 ops split K into slices so that their blocks fill the GPU (patcher/ops/int4.py: splits_for). Choices one
slice apart change the step by well under 1%, less than TPOT moves between processes (a process's memory placement
and clocks), so `evals.tpot` runs in separate processes cannot tell them apart. Here one process builds the model
once, then times each configuration in turn, round after round: every round a fresh DecodeRunner (new buffers, new
CUDA graph) per configuration, TPOT as evals.tpot defines it ((time(generate N+1) - time(generate 1)) / N, median over
repeats). The first configuration is the split rule's; each round's difference against it is what to read.

A configuration is `rule` or role=slices pairs, e.g. `qkv=5,out=8` (roles: qkv, out, mlp_in, mlp_out, qkv_mlp,
out_pair, as DecodeOptions.int4_splits takes them), and may also set the other fields of DecodeOptions (RUNNER_OPTIONS:
on/off as 1/0, e.g. `defer_int4=0`, `merge_int4=0`, `parallel_branch=0`, or a number, e.g.
`int4_separate_norm_batch=2`), e.g. `defer_qkv=0` or `qkv=5,defer_qkv=0`. The tokens of each configuration are
compared with the rule's: other K slices round other fp32 partial sums, so logits may move in their last bits, and
with random weights (flat distributions) a greedy token may flip and the rest of the sequence with it; a mismatch
says to check the logits, not that the step is wrong.

    python -m evals.splits --random-config llama-3.1-8b --int4-random 128 --configs qkv=5,out=8 defer_qkv=0 --rounds 4
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys

import torch
from tqdm import tqdm

from patcher.decode import DecodeOptions

from . import common

RULE = "rule"
# The DecodeOptions fields a configuration may set (name -> type): on/off as 1/0, or a whole number.
RUNNER_OPTIONS = {
    f.name: {"bool": bool, "int": int}[f.type]
    for f in dataclasses.fields(DecodeOptions)
    if f.name not in ("int4_splits", "use_graphs")
}


def parse_config(text: str) -> tuple[dict[str, int], dict]:
    """(K slices by role, other DecodeOptions fields): `rule` -> ({}, {}); `qkv=4,defer_qkv=0` -> ({"qkv": 4},
    {"defer_qkv": False})."""
    if text == RULE:
        return {}, {}
    splits, options = {}, {}
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not value.isdigit():
            raise ValueError(
                f"configuration {text!r}: expected role=slices pairs like qkv=4,out=7 and runner options like "
                f"defer_qkv=0 ({', '.join(RUNNER_OPTIONS)}), or {RULE!r}"
            )
        if RUNNER_OPTIONS.get(key) is bool:
            if value not in ("0", "1"):
                raise ValueError(f"configuration {text!r}: {key} takes 0 or 1, got {value}")
            options[key] = value == "1"
        elif key in RUNNER_OPTIONS:
            if int(value) < 1:
                raise ValueError(f"configuration {text!r}: {key} takes a whole number >= 1, got {value}")
            options[key] = int(value)
        else:
            splits[key] = int(value)
    return splits, options


def time_config(
    model, splits: dict, prompt, new_tokens: int, repeats: int, device, options: dict | None = None
) -> tuple[float, torch.Tensor, dict]:
    """(TPOT ms, the tokens, the K slices of the first layer's int4 linears by role) with a fresh runner, built with
    `options` (RUNNER_OPTIONS)."""
    from patcher.decode import DecodeRunner, Sampling
    from patcher.decode.int4_plan import layer_roles

    runner = DecodeRunner(model, DecodeOptions(int4_splits=splits, **(options or {})))
    mask = torch.ones_like(prompt)

    def generate(n):
        return runner.generate(prompt, mask, n, Sampling(), eos=[], pad_token_id=0)

    tokens = generate(new_tokens + 1)  # warm-up: buffers, graph capture
    generate(1)
    pairs = common.generation_pairs(generate, new_tokens, repeats, device, "evals.splits")
    tpots = [(tn - t1) / new_tokens * 1e3 for t1, tn in pairs]
    state = runner.states[prompt.shape[0]]
    roles = layer_roles(runner.decode_step.layers[0])
    used = {role: state.int4_splits[id(lin)] for role, lin in roles.items() if lin is not None}
    return statistics.median(tpots), tokens, used


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=common.prog("evals.splits"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_model_args(parser)
    parser.add_argument("--configs", nargs="+", required=True, help=f"configurations to time against {RULE!r}")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7, help="TPOT pairs a configuration and round (median)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--json", help="write every figure and the run's settings here")
    args = parser.parse_args(argv)
    try:
        configs = [RULE] + [c for c in args.configs if c != RULE]
        parsed = {c: parse_config(c) for c in configs}
    except ValueError as e:
        parser.error(str(e))
    if min(args.rounds, args.repeats, args.batch, args.new_tokens) < 1:
        parser.error("--rounds, --repeats, --batch and --new-tokens must be >= 1")

    import patcher

    device, dtype = common.resolve(args)
    model, _, name = common.load_model(args, device, dtype)
    patcher.patch_model(model)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (args.batch, args.prompt_len), generator=g).to(device)

    rows = {c: {"config": c, "tpot_ms_rounds": [], "diff_ms_rounds": []} for c in configs}
    first_tokens = None
    with tqdm(total=args.rounds * len(configs), desc="splits", file=sys.stderr) as progress:
        for _ in range(args.rounds):
            for c in configs:
                try:
                    slices, options = parsed[c]
                    tpot, tokens, used = time_config(
                        model, slices, prompt, args.new_tokens, args.repeats, device, options
                    )
                except ValueError as e:  # a role this model lacks, slices the kernels cannot take, a bad option
                    parser.error(f"configuration {c!r}: {e}")
                first_tokens = tokens if first_tokens is None else first_tokens
                row = rows[c]
                row["splits"], row["options"] = used, parsed[c][1]
                row["tpot_ms_rounds"].append(tpot)
                row["diff_ms_rounds"].append(tpot - rows[RULE]["tpot_ms_rounds"][-1])
                row["tokens_match_rule"] = row.get("tokens_match_rule", True) and torch.equal(tokens, first_tokens)
                progress.update(1)
    for row in rows.values():
        row["tpot_ms"] = statistics.median(row["tpot_ms_rounds"])
        row["diff_ms"] = statistics.median(row["diff_ms_rounds"])
        row["slices"] = " ".join(f"{r}={s}" for r, s in row["splits"].items())
        row["diffs"] = " ".join(f"{d * 1e3:+.1f}" for d in row["diff_ms_rounds"])
    print(f"{name}, {str(dtype).replace('torch.', '')}, batch {args.batch}, context {args.prompt_len}, {device}")
    columns = [
        ("config", "config", "s"),
        ("slices", "K slices (layer 0)", "s"),
        ("tpot_ms", "TPOT ms (median of rounds)", ".4f"),
        ("diff_ms", "vs rule ms (median)", "+.4f"),
        ("diffs", "each round, us", "s"),
        ("tokens_match_rule", "tokens as rule", ""),
    ]
    print(common.table(list(rows.values()), columns))
    payload = {
        "tool": "evals.splits",
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "settings": {k: v for k, v in vars(args).items() if k != "default_random"},
        "environment": common.environment(device, "evals.splits"),
        "results": [{k: v for k, v in row.items() if k not in ("slices", "diffs")} for row in rows.values()],
    }
    common.write_json(args.json, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
