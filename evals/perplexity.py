"""Perplexity, patched against unpatched: `patcher-perplexity` or `python -m evals.perplexity` (one process; one a
shard with --tp under torchrun).

The strided sliding window of HF's perplexity guide: windows of --ctx tokens every --stride tokens, each scoring
only the tokens not scored before (the first ctx - stride tokens of a window are context). One run evaluates the
unpatched model, then the patched one, then unpatches and checks that the first window's logits are bit-identical
to the baseline. Per mode: perplexity, tokens scored, tokens/s, the absolute and relative change against
unpatched, and max |logit difference| and top-1 agreement on the first window. `--modes unpatched` or `--modes
patched` evaluates one model alone, with no comparison (a full WikiText-2 run takes about 45 minutes a model on two
CPU cores for SmolLM2-135M).

Data: WikiText-2 raw test through `datasets` (the rows joined with "\\n\\n", as the guide does), or --text-file.
A model without a tokenizer (--random-config) reads the text as UTF-8 bytes.

Tensor parallelism: `--tp N` under torchrun shards the model with transformers' tp_plan="auto" (--model or
--random-config) and evaluates it on every rank; rank 0 prints and writes the JSON (with tp and the backend):
  torchrun --nproc-per-node 2 -m evals.perplexity --model PATH --tp 2 --json ppl.json
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import common, distributed


def load_text(args) -> tuple[str, str]:
    if args.text_file:
        path = Path(args.text_file)
        if not path.is_file():
            sys.exit(f"error: --text-file {path} not found")
        return path.read_text(encoding="utf-8"), args.text_file
    try:
        from datasets import load_dataset

        rows = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")["text"]
    except Exception as e:  # noqa: BLE001  (no network, no datasets package, a hub error: all mean --text-file)
        sys.exit(
            f"error: could not load WikiText-2 through datasets ({type(e).__name__}: {e}); "
            "pass --text-file PATH (a UTF-8 text, e.g. WikiText-2's raw test split)"
        )
    return "\n\n".join(rows), "wikitext-2-raw-v1 test (datasets)"


def encode(text: str, tokenizer, vocab_size: int) -> torch.Tensor:
    if tokenizer is not None:
        return tokenizer(text, return_tensors="pt").input_ids[0]
    if vocab_size < 256:
        sys.exit("error: a model without a tokenizer reads bytes and needs a vocabulary of at least 256")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def windows(n_tokens: int, ctx: int, stride: int):
    """(begin, end, scored) per window, as in HF's guide: `scored` trailing tokens of [begin, end) are new."""
    prev_end = 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + ctx, n_tokens)
        yield begin, end, end - prev_end
        prev_end = end
        if end == n_tokens:
            break


def evaluate(model, ids: torch.Tensor, ctx: int, stride: int, device, desc: str) -> dict:
    nll_sum, n_scored = 0.0, 0
    spans = list(windows(len(ids), ctx, stride))
    start = time.perf_counter()
    with torch.no_grad():
        bar = tqdm(spans, desc=desc, file=sys.stderr, leave=False, disable=not distributed.is_main())
        for begin, end, scored in bar:
            input_ids = ids[begin:end].unsqueeze(0).to(device)
            labels = input_ids.clone()
            labels[:, :-scored] = -100
            loss = model(input_ids, labels=labels).loss
            n_loss = int((labels != -100).sum().item()) - 1  # HF shifts labels inside: one fewer scored token
            nll_sum += loss.item() * n_loss
            n_scored += n_loss
    common.sync(device)
    seconds = time.perf_counter() - start
    return {
        "perplexity": math.exp(nll_sum / n_scored),
        "tokens_scored": n_scored,
        "tokens_processed": sum(end - begin for begin, end, _ in spans),
        "seconds": seconds,
        "tokens_per_s": sum(end - begin for begin, end, _ in spans) / seconds,
    }


def first_window_logits(model, ids, ctx, device) -> torch.Tensor:
    with torch.no_grad():
        return model(ids[:ctx].unsqueeze(0).to(device)).logits[0]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=common.prog("evals.perplexity"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_model_args(parser)
    distributed.add_tp_arg(parser)
    parser.add_argument("--text-file", help="evaluate this text instead of WikiText-2 from datasets")
    parser.add_argument("--ctx", type=int, default=None, help="window length (default 2048 or the model's maximum)")
    parser.add_argument("--stride", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=None, help="only the first N tokens (quick runs)")
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "kernels", "reference"],
        help="patch_model backend for the patched run",
    )
    parser.add_argument(
        "--modes",
        default="unpatched,patched",
        help="comma-separated: unpatched, patched or both (default); with one, no comparison and no unpatch check",
    )
    parser.add_argument("--json", default=None, help="write every figure and the run's settings here")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or set(modes) - {"unpatched", "patched"} or len(set(modes)) != len(modes):
        parser.error(f"--modes takes unpatched, patched or both, comma-separated, got {args.modes!r}")
    both = len(modes) == 2

    import patcher

    distributed.check(args, "evals.perplexity", argv)
    distributed.setup(args)
    device, dtype = common.resolve(args)
    model, tokenizer, name, device = distributed.load_model(args, device, dtype)
    say = print if distributed.is_main() else (lambda *a, **k: None)  # rank 0 reports
    text, source = load_text(args)
    ids = encode(text, tokenizer, model.config.vocab_size)
    total_tokens = len(ids)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    ctx = args.ctx or min(2048, getattr(model.config, "max_position_embeddings", 2048))
    if args.stride <= 0 or args.stride > ctx:
        parser.error(f"--stride must be in 1..ctx ({ctx})")
    say(
        f"{name}, {str(dtype).replace('torch.', '')}, {source}: {total_tokens} tokens"
        + (f" (first {len(ids)})" if args.max_tokens else "")
        + f", ctx {ctx}, stride {args.stride}",
        file=sys.stderr,
    )

    results, report = {}, None
    if "unpatched" in modes:
        base_logits = first_window_logits(model, ids, ctx, device) if both else None
        results["unpatched"] = evaluate(model, ids, ctx, args.stride, device, "unpatched")
    if "patched" in modes:
        report = patcher.patch_model(model, backend=args.backend)
        say(report, file=sys.stderr)
        patched_logits = first_window_logits(model, ids, ctx, device) if both else None
        results["patched"] = evaluate(model, ids, ctx, args.stride, device, "patched")

    unpatch_identical = None  # not checked with one mode
    if both:
        patcher.unpatch_model(model)
        restored_logits = first_window_logits(model, ids, ctx, device)
        base = results["unpatched"]["perplexity"]
        for mode, logits in (("unpatched", base_logits), ("patched", patched_logits)):
            r = results[mode]
            r["delta_ppl"] = r["perplexity"] - base
            r["delta_ppl_relative"] = r["delta_ppl"] / base
            r["first_window_max_abs_logit_diff"] = (logits.float() - base_logits.float()).abs().max().item()
            r["first_window_top1_agreement"] = (logits.argmax(-1) == base_logits.argmax(-1)).float().mean().item()
        unpatch_identical = bool(torch.equal(restored_logits, base_logits))

    columns = [
        ("mode", "mode", ""),
        ("perplexity", "perplexity", ".4f"),
        ("delta_ppl", "delta", "+.5f"),
        ("delta_ppl_relative", "delta rel", "+.4%"),
        ("tokens_scored", "tokens", "d"),
        ("tokens_per_s", "tok/s", ".0f"),
        ("first_window_max_abs_logit_diff", "max|dlogit| win1", ".3g"),
        ("first_window_top1_agreement", "top-1 agree win1", ".4f"),
    ]
    rows = [{"mode": m, **r} for m, r in results.items()]
    say(common.table(rows, [c for c in columns if c[0] in rows[0]]))  # the comparisons only with both modes
    if both:
        say(f"unpatch restores the baseline (first window logits bit-identical): {unpatch_identical}")
    common.write_json(
        args.json,
        {
            "tool": "evals.perplexity",
            "model": name,
            "dtype": str(dtype).replace("torch.", ""),
            "data": source,
            "text_tokens": total_tokens,
            "settings": {
                "ctx": ctx,
                "stride": args.stride,
                "max_tokens": args.max_tokens,
                "backend": args.backend,
                "modes": modes,
            },
            "environment": common.environment(device, "evals.perplexity"),
            "parallel": distributed.describe(),
            "patch_report": None if report is None else report.to_dict(),
            "results": results,
            "unpatch_restores_baseline": unpatch_identical,
        },
    )
    distributed.finish()
    return 1 if unpatch_identical is False else 0


if __name__ == "__main__":
    sys.exit(main())
