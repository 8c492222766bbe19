"""Decode speed, patched against unpatched, side by side: `patcher-tpot` or `python -m evals.tpot` (one process; one
a shard with --tp under torchrun).

TPOT (time per output token) excludes prefill: (time(generate N+1) - time(generate 1)) / N, after warm-up, with
the GPU synchronized, median over repeats. Each mode also reports TTFT (generate 1), on CUDA the prefill alone
(one forward over the prompt, the logits of its last position only, GPU time by CUDA events, median of 10: TTFT
without generate's host work), tokens/s, kernels per decode step and each kernel's share of the step's critical path
(torch.profiler; `--kernel-table` prints the costliest, and the prefill's kernels and idle GPU time likewise),
achieved bandwidth and TPOT over the roofline (bytes read per step / HBM read bandwidth measured in the same run),
and peak GPU memory.

Modes:
  hf-eager                 unpatched, HF generate with its dynamic cache
  hf-static-compiled       unpatched, generate(cache_implementation="static"): HF compiles the decode step
                           (torch.compile, CUDA graphs) by itself; HF's best mode
  patched-eager            patch_model(model), HF's generate loop and dynamic cache, our kernels in every layer
  patched                  patch_model(model) and plain generate: the default a user gets (the graph-captured
                           decode path when the model qualifies)
  patched-int4-unmerged    `patched` with a GPT-NeoX int4 model's five int4 kernels a layer instead of three
                           (DecodeOptions(merge_int4=False))
  patched-torch-next-token `patched` with the step's end as torch ops (argmax, token write, slot add, embedding
                           lookup) instead of the next_token kernel (DecodeOptions(fuse_next_token=False))
  patched-int4-meetings    `patched` with the int4 output projections' K slices summed in the op instead of in the
                           next op's prologue (DecodeOptions(defer_int4=False))
  patched-int4-qkv-meeting `patched` with LLaMA/Qwen2's int4 QKV K slices summed in the op instead of by the
                           attention (DecodeOptions(defer_qkv=False))
  patched-int4-norm-inside `patched` with each int4 op taking its add + norm as its prologue instead of a separate
                           norm kernel in front (DecodeOptions(int4_separate_norm_batch=9))
  patched-static-compiled  patch_model(model) + HF's static cache and auto-compile (torch.compile compatibility)

Generate arguments (--generate-args PRESET[,PRESET...]): each preset is one row a mode, batch and context, with its
arguments in the JSON (evals/presets.py says how each is built):
  greedy          do_sample=False (the rows without --generate-args)
  sampling        temperature 0.7, top_k 20, top_p 0.8
  qwen-instruct   Qwen2-1.5B-Instruct's generation config: sampling as above, repetition_penalty 1.1, two EOS ids
  llama-instruct  Llama-3.1-8B-Instruct's: temperature 0.6, top_p 0.9, three EOS ids
  streamer        greedy, a TextStreamer that decodes each token to text and writes nothing (one a row at batch > 1)
  min-new-tokens  greedy, min_new_tokens = the tokens asked for, with two EOS ids
  stop-strings    greedy, three stop_strings the text never holds, with the tokenizer
The EOS ids are the last ids of the vocabulary; a call whose output comes out shorter than asked makes its row an
error. Sampling calls are seeded. A random-weight model gets a tokenizer built offline with exactly its vocabulary
(id i decodes to " t{i}"); a model loaded with a tokenizer uses its own. With presets the default modes are
hf-static-compiled and patched (hf-eager, patched-eager and patched on a CPU), the kernel profile is off (--profile
turns it on), and each row adds "x_greedy" (TPOT over the greedy preset's, same mode, batch and context),
"x_hf_static" for the patched modes (over hf-static-compiled's with the same preset) and the decode path
patcher.decode.generate_path reports, with a warning line where `patched` did not take the graph path.

With no model argument it runs Pythia-2.8B-shaped random weights on a GPU, a tiny model on a CPU.

Tensor parallelism: `--tp N` under torchrun shards the model with transformers' tp_plan="auto" (--model or
--random-config); every rank runs every mode, the ranks start each timed generate together and rank 0's times are
reported; rank 0 prints and writes the JSON (with tp and the backend); bytes per step are one rank's:
  torchrun --nproc-per-node 2 -m evals.tpot --model PATH --tp 2 --json tpot.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import statistics
import sys

import torch
from tqdm import tqdm

from . import common, distributed, presets
from .kernel_profile import kernel_tables, prefill_profile, step_profile

GPU_MODES = ["hf-eager", "hf-static-compiled", "patched-eager", "patched", "patched-static-compiled"]  # the default
RUNNER_MODES = {  # patched with a runner of other settings, for comparisons
    "patched-int4-unmerged": {"merge_int4": False},
    "patched-torch-next-token": {"fuse_next_token": False},
    "patched-int4-meetings": {"defer_int4": False},
    "patched-int4-qkv-meeting": {"defer_qkv": False},
    "patched-int4-norm-inside": {"int4_separate_norm_batch": 9},  # above every batch size the step takes (1-8)
}
ALL_MODES = [*GPU_MODES, *RUNNER_MODES]
CPU_MODES = ["hf-eager", "patched-eager", "patched"]
PRESET_GPU_MODES = ["hf-static-compiled", "patched"]  # the default with --generate-args


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and GPTQ tensor once, but only one row of an untied
    input embedding."""
    params = {id(p): p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()}  # a rank's shards
    total = sum(p.numel() * p.element_size() for p in params.values())
    for module in model.modules():  # GPTQ and GGUF linears keep their tensors as buffers (g_idx is not read)
        if type(module).__name__ == "GPTQLinear":
            tensors = (module.qweight, module.qzeros, module.scales, module.bias)
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
        elif type(module).__name__ == "GGUFLinear":
            total += sum(t.numel() * t.element_size() for t in (module.qweight, module.bias) if t is not None)
    embedding = model.get_input_embeddings().weight
    embedding = embedding.to_local() if hasattr(embedding, "to_local") else embedding
    output = model.get_output_embeddings()
    if output is None or getattr(output, "weight", None) is not embedding:  # (a GGUF lm_head holds blocks)
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes(model, batch: int, context: float) -> float:
    """Bytes of K and V one decode step reads at `context` cached tokens."""
    from patcher.registry import REGISTRY

    config = model.config
    spec = REGISTRY[config.model_type].spec
    per_token = 2 * config.num_hidden_layers * spec.num_kv_heads(config) * spec.head_dim(config)
    return per_token * batch * context * model.dtype.itemsize / distributed.world_size()  # heads split over ranks


@contextlib.contextmanager
def mode_setup(model, mode: str):
    """Puts the model in the state a mode needs; undoes it afterwards."""
    import patcher

    patched = mode.startswith("patched")
    if patched:
        patcher.patch_model(model)
        patcher.set_fast_generate(model, mode == "patched" or mode in RUNNER_MODES)
        if mode in RUNNER_MODES:
            from patcher.decode import DecodeOptions, DecodeRunner

            model._patcher_state.runner = DecodeRunner(model, DecodeOptions(**RUNNER_MODES[mode]))
    if mode.endswith("compiled"):
        model.__dict__.pop("_compiled_call", None)  # HF caches its compiled forward on the model
        torch._dynamo.reset()
    try:
        yield
    finally:
        if patched:
            patcher.unpatch_model(model)
        if mode.endswith("compiled"):
            model.__dict__.pop("_compiled_call", None)
            torch._dynamo.reset()


def graph_expected(mode: str) -> bool:
    """Whether the mode's generate may take the graph-captured decode path (its fast generate is on)."""
    return mode == "patched" or mode in RUNNER_MODES


def measure_mode(model, mode, prompt, new_tokens, repeats, device, profile=True, preset=None, setup=None) -> dict:
    """One row: the model already in `mode`'s state (mode_setup); `preset` names the generate() arguments
    (presets.PRESETS, built from `setup`), None for plain greedy decoding."""
    base = {"attention_mask": torch.ones_like(prompt)}
    if mode.endswith("static-compiled"):
        base["cache_implementation"] = "static"
        base["max_cache_len"] = model._tpot_cache_len  # one size for every preset and point: HF compiles once
    outputs = []  # (tokens asked for, output), checked after the timing

    def generate(n):
        kwargs = {"do_sample": False} if preset is None else presets.arguments(preset, setup, n)
        if kwargs.get("do_sample"):
            torch.manual_seed(presets.SEED)
        call = {**base, **kwargs}
        if call.get("cache_implementation") == "static":  # one size for every call: HF compiles once
            call.setdefault("max_cache_len", model._tpot_cache_len)
        out = model.generate(prompt, max_new_tokens=n, **call)
        outputs.append((n, out if isinstance(out, torch.Tensor) else out.sequences))  # (return_dict_in_generate)
        return out

    row = {"mode": mode}
    if preset is not None:
        row.update(preset=preset, arguments=presets.describe(presets.arguments(preset, setup, new_tokens + 1)))

    def check_lengths():
        short = {(n, out.shape[1] - prompt.shape[1]) for n, out in outputs if out.shape[1] != prompt.shape[1] + n}
        if short:
            raise RuntimeError(
                "generation stopped early (every row hit an EOS id or a stop string), so the timing is not of the "
                f"tokens asked for: (asked, made) {sorted(short)}"
            )

    generate(new_tokens + 1)  # warm-up: compilation, graph capture, kernel build, autotuning
    generate(1)
    check_lengths()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t1s, tns = zip(*common.generation_pairs(generate, new_tokens, repeats, device, mode))
    check_lengths()
    tpots = [(tn - t1) / new_tokens for tn, t1 in zip(tns, t1s)]
    row.update(
        tpot_ms=statistics.median(tpots) * 1e3,
        tpot_ms_all=[t * 1e3 for t in tpots],
        ttft_ms=statistics.median(t1s) * 1e3,
    )
    row["tokens_per_s"] = prompt.shape[0] / (row["tpot_ms"] / 1e3)
    eos = presets.eos_ids(presets.arguments(preset, setup, 1)) if preset is not None else []
    if eos:  # rows that stopped before the last token while others went on (the batch is decoded whole anyway)
        made = outputs[-1][1][:, prompt.shape[1] : -1]
        row["rows_stopped_early"] = int(torch.isin(made, torch.tensor(eos, device=made.device)).any(dim=1).sum())
    if mode.startswith("patched"):
        from patcher.decode import generate_path

        path = generate_path(model)
        row["decode_path"] = path.get("path")
        row["decode_reason"] = path.get("reason")
    if device.type == "cuda":
        row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
        if preset is None:
            row["prefill_ms"] = prefill_ms(model, prompt)
        if profile:
            row.update(step_profile(generate, model.config.num_hidden_layers))
            row["gpu_busy"] = row["critical_us_per_step"] / 1e3 / row["tpot_ms"]
            if preset is None:
                row.update(prefill_profile(prefill_forward(model, prompt), model.config.num_hidden_layers))
    return row


def prefill_forward(model, prompt):
    """One forward over `prompt` as generate's prefill runs it (logits of the last position only, where the model
    takes logits_to_keep), as a function of no arguments."""
    kwargs = {"attention_mask": torch.ones_like(prompt), "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1

    def forward():
        with torch.inference_mode():
            return model(prompt, **kwargs)

    return forward


def prefill_ms(model, prompt) -> float:
    """The GPU time of prefill_forward, median of 10 after 2 warm-ups, in ms."""
    return common.gpu_time_ms(prefill_forward(model, prompt), reps=10, warmup=2)


def run(model, args, device, prompt_len, batch, bandwidth, modes, on_row, progress=None, setup=None) -> None:
    """Measures each mode (and each preset of --generate-args in it) at one prompt length and batch size and hands
    its row to `on_row` at once; a measurement that raises gives a row with its `error` instead. A mode is set up
    once for all its presets (hf-static-compiled compiles once: the presets change no shape)."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    context = prompt_len + (args.new_tokens + 1) / 2  # mean cached length over the timed steps
    step_bytes = weight_bytes(model) + kv_bytes(model, batch, context)
    names = args.generate_args or [None]
    if setup is not None:
        setup.batch = batch
    profile = not args.no_profile and (args.profile or not args.generate_args)

    def finish(row):
        row.update(context=prompt_len, batch=batch, bytes_per_step=step_bytes)
        if bandwidth:
            row["roofline_ms"] = step_bytes / (bandwidth * 1e9) * 1e3
            if "tpot_ms" in row:
                row["achieved_gbs"] = step_bytes / (row["tpot_ms"] / 1e3) / 1e9
                row["tpot_over_roofline"] = row["tpot_ms"] / row["roofline_ms"]
        on_row(row)
        if progress:
            progress.update(1)

    def failed(mode, preset, e):
        return {"mode": mode, **({"preset": preset} if preset else {}), "error": f"{type(e).__name__}: {e}"}

    for mode in modes:
        pending = list(names)
        try:
            with mode_setup(model, mode):
                while pending:
                    preset = pending.pop(0)
                    if progress:
                        progress.set_postfix_str(f"context {prompt_len}, batch {batch}, {mode} {preset or ''}")
                    try:
                        row = measure_mode(model, mode, prompt, args.new_tokens, args.repeats, device, profile=profile,
                                           preset=preset, setup=setup)  # fmt: skip
                    except Exception as e:  # noqa: BLE001 - one failing (a compile error, OOM) must not lose the others
                        row = failed(mode, preset, e)
                    finish(row)
        except Exception as e:  # the mode's setup failed: its rows say so
            if not pending:
                raise  # undoing a mode failed after its rows: the next modes would measure a broken model
            for preset in pending:
                finish(failed(mode, preset, e))


def plot(rows: list[dict], path: str, title: str, x: str = "context") -> None:
    """TPOT of each mode (and preset) and the roofline against `x`: "context" (--sweep-context) or "batch"
    (--sweep-batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, preset in dict.fromkeys((r["mode"], r.get("preset")) for r in rows):
        pts = sorted((r[x], r["tpot_ms"]) for r in rows if (r["mode"], r.get("preset")) == (mode, preset))
        ax.plot(*zip(*pts), marker="o", label=f"{mode} {preset}" if preset else mode)
    roof = sorted({(r[x], r["roofline_ms"]) for r in rows if "roofline_ms" in r})
    if roof:
        ax.plot(*zip(*roof), linestyle="--", color="black", label="roofline (bytes / measured HBM bandwidth)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)" if x == "context" else "batch size (rows decoded at once)")
    ax.set_ylabel("TPOT (ms per token)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    print(f"wrote {path}")


COLUMNS = [
    ("mode", "mode", ""),
    ("context", "context", "d"),
    ("tpot_ms", "TPOT ms", ".3f"),
    ("ttft_ms", "TTFT ms", ".1f"),
    ("prefill_ms", "prefill ms", ".1f"),
    ("tokens_per_s", "tok/s", ".0f"),
    ("achieved_gbs", "GB/s", ".0f"),
    ("tpot_over_roofline", "x roofline", ".2f"),
    ("kernels_per_step", "kernels/step", ".0f"),
    ("gpu_busy", "GPU busy", ".0%"),
    ("peak_memory_gb", "peak GB", ".1f"),
]
PRESET_COLUMNS = [  # with --generate-args: after the mode, and after tok/s
    [("preset", "preset", "")],
    [("x_greedy", "x greedy", ".2f"), ("x_hf_static", "x hf-static", ".2f"), ("decode_path", "path", "")],
]


def label(row: dict) -> str:
    preset = f" {row['preset']}" if row.get("preset") else ""
    return f"{row['mode']}{preset} at context {row['context']}, batch {row['batch']}"


def off_graph(row: dict) -> str | None:
    """The warning line for a preset row whose generate left the graph path in a mode that takes it, or None."""
    if row.get("preset") and graph_expected(row["mode"]) and row.get("decode_path") not in (None, "graph"):
        return f"warning: {label(row)} ran on the {row['decode_path']} path: {row.get('decode_reason')}"
    return None


def table_columns(args) -> list:
    columns = list(COLUMNS)
    if args.generate_args:
        if args.no_profile or not args.profile:  # no profile, no kernel columns
            columns = [c for c in columns if c[0] not in ("kernels_per_step", "gpu_busy")]
        at = [k for k, _, _ in columns].index("tokens_per_s") + 1
        columns = [columns[0], *PRESET_COLUMNS[0], *columns[1:at], *PRESET_COLUMNS[1], *columns[at:]]
    if args.sweep_batch:
        at = [k for k, _, _ in columns].index("context") + 1
        columns.insert(at, ("batch", "batch", "d"))
    return columns


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=common.prog("evals.tpot"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_model_args(parser)
    distributed.add_tp_arg(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(ALL_MODES)}")
    parser.add_argument("--sweep-context", default=None, help="prompt lengths, e.g. 128,512,1024,2048,4096")
    parser.add_argument("--sweep-batch", default=None, help="batch sizes instead of --batch, e.g. 1,2,4,8")
    parser.add_argument("--plot", default=None, help="PNG path for the sweep plot (default: beside --json)")
    parser.add_argument(
        "--generate-args",
        type=presets.parse,
        default=None,
        metavar="PRESET[,PRESET...]",
        help=f"generate() argument presets, each a row: {','.join(presets.PRESETS)}",
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel profile (torch.profiler)")
    parser.add_argument("--profile", action="store_true", help="measure the kernel profile with --generate-args too")
    parser.add_argument(
        "--kernel-table",
        action="store_true",
        help="print each mode's costliest kernels per decode step and per prefill",
    )
    parser.add_argument("--json", default=None, help="write every figure and the run's settings here")
    args = parser.parse_args(argv)

    distributed.check(args, "evals.tpot", argv)
    device, dtype = common.resolve(args)
    gpu_modes = PRESET_GPU_MODES if args.generate_args else GPU_MODES
    modes = args.modes.split(",") if args.modes else (gpu_modes if device.type == "cuda" else CPU_MODES)
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")
    if device.type != "cuda" and any(m.endswith("compiled") for m in modes):
        parser.error("the compiled modes need a CUDA GPU")
    if args.profile and args.no_profile:
        parser.error("give one of --profile and --no-profile")
    if args.sweep_context and args.sweep_batch:
        parser.error("--sweep-context and --sweep-batch each make their own plot: give one of them")
    contexts = [int(c) for c in args.sweep_context.split(",")] if args.sweep_context else [args.prompt_len]
    batches = [int(b) for b in args.sweep_batch.split(",")] if args.sweep_batch else [args.batch]
    if min(batches) < 1:
        parser.error(f"batch sizes must be >= 1, got {batches}")
    if (args.sweep_context or args.sweep_batch) and importlib.util.find_spec("matplotlib") is None:
        parser.error("the sweeps are plotted with matplotlib: pip install 'fused-patcher[plots]'")

    distributed.setup(args)
    model, tokenizer, name, device = distributed.load_model(args, device, dtype)
    main_rank = distributed.is_main()
    say = print if main_rank else (lambda *a, **k: None)  # rank 0 reports
    model.generation_config.eos_token_id = None  # always generate exactly the requested number of tokens
    model.generation_config.pad_token_id = 0
    longest = max(contexts) + args.new_tokens + 1
    model._tpot_cache_len = longest  # one static-cache size for every point: HF compiles once
    if getattr(model.config, "max_position_embeddings", longest) < longest:
        model.config.max_position_embeddings = longest  # rope has no length limit; random weights anyway

    setup = None
    if args.generate_args:
        setup = presets.Setup(vocab_size=model.config.vocab_size, tokenizer=tokenizer, offline=tokenizer is None)
        if tokenizer is None and presets.NEEDS_TOKENIZER & set(args.generate_args):
            setup.tokenizer = presets.offline_tokenizer(setup.vocab_size)
    bandwidth = common.hbm_read_bandwidth_gbs(device) if device.type == "cuda" else None
    say(
        f"{name}, {str(dtype).replace('torch.', '')}, batch {','.join(map(str, batches))}, {args.new_tokens} new tokens"
        + (f", measured HBM read bandwidth {bandwidth:.0f} GB/s" if bandwidth else ""),
        file=sys.stderr,
    )
    payload = {
        "tool": "evals.tpot",
        "model": name,
        "dtype": str(dtype).replace("torch.", ""),
        "settings": {k: v for k, v in vars(args).items() if k != "default_random"},
        "hbm_read_bandwidth_gbs": bandwidth,
        "weight_bytes": weight_bytes(model),
        "environment": common.environment(device, "evals.tpot"),
        "parallel": distributed.describe(),
        "complete": False,
        "results": [],
    }
    rows = payload["results"]

    def on_row(row):
        # Each mode's figures reach stderr and the JSON as soon as they are measured, so a run that is stopped
        # (a time limit, a mode that hangs) keeps what it has.
        rows.append(row)
        presets.add_ratios(rows)
        if not main_rank:
            return
        figures = f"{row['tpot_ms']:.3f} ms" if "tpot_ms" in row else f"failed: {row['error']}"
        figures += "".join(f", {k} {row[k]:.2f}" for k in ("x_greedy", "x_hf_static") if k in row)
        tqdm.write(f"tpot: {label(row)}: {figures}", file=sys.stderr)
        if off_graph(row):
            tqdm.write(off_graph(row), file=sys.stderr)
        common.write_json(args.json, payload, announce=False)

    total = len(batches) * len(contexts) * len(modes) * len(args.generate_args or [None])
    with tqdm(total=total, desc="tpot", file=sys.stderr, disable=not main_rank) as progress:
        for batch in batches:
            for context in contexts:
                run(model, args, device, context, batch, bandwidth, modes, on_row, progress, setup)

    say(common.table(rows, table_columns(args)))
    for row in rows:
        if off_graph(row):
            say(off_graph(row))
    failed = [r for r in rows if "error" in r]
    for row in failed:
        say(f"{label(row)} failed: {row['error']}")
    if args.kernel_table:
        for row in rows:
            for block in kernel_tables(row, label(row)):
                say(block)
    if bandwidth:
        roof = rows[0]["roofline_ms"]
        say(
            f"roofline at context {rows[0]['context']}: {rows[0]['bytes_per_step'] / 1e9:.3f} GB per step / "
            f"{bandwidth:.0f} GB/s = {roof:.3f} ms"
        )
    payload["complete"] = True
    common.write_json(args.json, payload)
    if (args.sweep_context or args.sweep_batch) and main_rank:
        path = args.plot or (args.json.rsplit(".", 1)[0] + ".png" if args.json else "tpot_sweep.png")
        measured = [r for r in rows if "tpot_ms" in r]
        if args.sweep_context:
            plot(measured, path, f"{name} {payload['dtype']}, batch {args.batch}: TPOT vs context")
        else:
            plot(measured, path, f"{name} {payload['dtype']}, context {args.prompt_len}: TPOT vs batch", x="batch")
    distributed.finish()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
