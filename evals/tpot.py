"""Decode speed, patched against unpatched, side by side in one process: `patcher-tpot` or `python -m evals.tpot`.

TPOT (time per output token) excludes prefill: (time(generate N+1) - time(generate 1)) / N, after warm-up, with
the GPU synchronized, median over repeats. Each mode also reports TTFT (generate 1), tokens/s, kernels per decode
step and each kernel's share of the step's critical path (torch.profiler; `--kernel-table` prints the costliest),
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

With no model argument it runs Pythia-2.8B-shaped random weights on a GPU, a tiny model on a CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import statistics
import sys

import torch
from tqdm import tqdm

from . import common

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


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter and GPTQ tensor once, but only one row of an untied
    input embedding."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    for module in model.modules():  # GPTQ int4 linears keep their tensors as buffers (g_idx is not read)
        if type(module).__name__ == "GPTQLinear":
            tensors = (module.qweight, module.qzeros, module.scales, module.bias)
            total += sum(t.numel() * t.element_size() for t in tensors if t is not None)
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        total -= embedding.numel() * embedding.element_size()
    return total


def kv_bytes(model, batch: int, context: float) -> float:
    """Bytes of K and V one decode step reads at `context` cached tokens."""
    from patcher.registry import REGISTRY

    config = model.config
    spec = REGISTRY[config.model_type].spec
    per_token = 2 * config.num_hidden_layers * spec.num_kv_heads(config) * spec.head_dim(config)
    return per_token * batch * context * model.dtype.itemsize


def profile_spans(fn) -> list[tuple[str, float, float]]:
    """(name, start us, end us) of each GPU kernel executed while fn() runs, in start order (torch.profiler / CUPTI;
    kernels inside CUDA graphs are recorded one by one too)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    spans = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type.name == "CUDA" and not e.name.startswith(("Memcpy", "Memset"))
    ]
    return sorted(spans, key=lambda s: s[1])


def by_place(spans: list[tuple[str, float, float]], skip: dict[str, int], places: dict[str, int]) -> list:
    """The spans with each run of a kernel in `places` (name -> runs per layer) renamed "name #i", i its place
    among that kernel's runs in a layer (1 = first), counting from its run after the first skip[name] (the
    prefill's)."""
    seen: dict[str, int] = {}
    out = []
    for name, start, end in spans:
        if name in places:
            k = seen.get(name, 0)
            seen[name] = k + 1
            if k >= skip.get(name, 0):
                name = f"{name} #{(k - skip.get(name, 0)) % places[name] + 1}"
        out.append((name, start, end))
    return out


def kernel_shares(spans: list[tuple[str, float, float]]) -> dict[str, list]:
    """(name, start us, end us) of each kernel run -> by name: [launches, total us, critical us].

    Under programmatic dependent launch a kernel starts while the one before it runs (its blocks wait on-chip), so
    durations overlap and add up to more than the step. A kernel's critical time is the part of its run that no
    kernel which ended before it covers. In a chain of dependent kernels that is the time from the previous kernel's
    end to its own, its share of the critical path; the shares add up to the time any kernel ran (gaps with none
    running are in no share)."""
    shares: dict[str, list] = {}
    covered: list[list[float]] = []  # disjoint [start, end] of the runs so far, in order
    for name, start, end in sorted(spans, key=lambda s: s[2]):
        # Every interval so far ends by `end`, so only the trailing ones that reach past `start` overlap this run.
        overlap, merged_start = 0.0, start
        while covered and covered[-1][1] > start:
            c_start, c_end = covered.pop()
            overlap += c_end - max(c_start, start)
            merged_start = min(merged_start, c_start)
        covered.append([merged_start, end])
        entry = shares.setdefault(name, [0, 0.0, 0.0])
        entry[0] += 1
        entry[1] += end - start
        entry[2] += end - start - overlap
    return shares


def short_kernel_name(name: str, limit: int = 100) -> str:
    """A kernel's name without "void", namespaces of ours and the parameter list; template arguments kept (they
    tell our launches apart)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)::", "").replace("patcher::", "")
    depth = 0
    for i, c in enumerate(name):  # the parameter list starts at the first "(" outside template brackets
        depth += (c == "<") - (c == ">")
        if c == "(" and depth == 0:
            name = name[:i]
            break
    return name if len(name) <= limit else name[: limit - 3] + "..."


def short_place_name(name: str) -> str:
    """short_kernel_name, keeping by_place's " #i"."""
    base, mark, place = name.rpartition(" #")
    return short_kernel_name(base) + mark + place if mark and place.isdigit() else short_kernel_name(name)


def step_profile(generate, layers: int, steps: int = 8, top: int = 12) -> dict:
    """Kernels per decode step and where the step's GPU time goes: profile (1 token) and (steps + 1 tokens) and
    take the difference per step. Ranked by critical time (kernel_shares), which adds up to the time a kernel ran; the
    summed durations overlap under programmatic dependent launch. A kernel that runs several times in each of the
    `layers` layers (the int4 linears) is also split by its place in the layer ("kernel_places")."""
    one_spans, many_spans = profile_spans(lambda: generate(1)), profile_spans(lambda: generate(steps + 1))

    def per_step(one: dict, many: dict) -> dict:
        rows = {}
        for name, (count, us, critical) in many.items():
            c0, us0, critical0 = one.get(name, (0, 0.0, 0.0))
            if count > c0:
                rows[name] = [(count - c0) / steps, (us - us0) / steps, (critical - critical0) / steps]
        return rows

    def ranked(rows: dict, limit: int) -> list:
        order = sorted(rows.items(), key=lambda kv: -kv[1][2])[:limit]
        return [
            {"kernel": short_place_name(k), "launches": c, "us": us, "critical_us": cr, "critical_us_each": cr / c}
            for k, (c, us, cr) in order
        ]

    one = kernel_shares(one_spans)
    rows = per_step(one, kernel_shares(many_spans))
    places = {n: round(r[0] / layers) for n, r in rows.items() if r[0] > layers and r[0] % layers == 0}
    skip = {n: one[n][0] if n in one else 0 for n in places}
    by_layer = per_step(one, kernel_shares(by_place(many_spans, skip, places)))
    return {
        "kernels_per_step": sum(c for c, _, _ in rows.values()),
        "kernel_us_per_step": sum(us for _, us, _ in rows.values()),
        "critical_us_per_step": sum(critical for _, _, critical in rows.values()),
        "top_kernels": ranked(rows, top),
        "kernel_places": ranked({k: v for k, v in by_layer.items() if "#" in k}, 4 * top),
    }


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


def measure_mode(model, mode, prompt, new_tokens, repeats, device, profile=True) -> dict:
    gen_kwargs = {"do_sample": False, "attention_mask": torch.ones_like(prompt)}
    if mode.endswith("static-compiled"):
        gen_kwargs["cache_implementation"] = "static"
        gen_kwargs["max_cache_len"] = model._tpot_cache_len

    def generate(n):
        return model.generate(prompt, max_new_tokens=n, **gen_kwargs)

    with mode_setup(model, mode):
        out = generate(new_tokens + 1)  # warm-up: compilation, graph capture, kernel build, autotuning
        assert out.shape[1] == prompt.shape[1] + new_tokens + 1, "generation stopped early"
        generate(1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        t1s, tns = zip(*common.generation_pairs(generate, new_tokens, repeats, device, mode))
        tpots = [(tn - t1) / new_tokens for tn, t1 in zip(tns, t1s)]
        row = {
            "mode": mode,
            "tpot_ms": statistics.median(tpots) * 1e3,
            "tpot_ms_all": [t * 1e3 for t in tpots],
            "ttft_ms": statistics.median(t1s) * 1e3,
        }
        row["tokens_per_s"] = prompt.shape[0] / (row["tpot_ms"] / 1e3)
        if mode.startswith("patched"):
            from patcher.decode import generate_path

            path = generate_path(model)
            row["decode_path"] = path.get("path")
        if device.type == "cuda":
            row["peak_memory_gb"] = torch.cuda.max_memory_allocated(device) / 1e9
            if profile:
                row.update(step_profile(generate, model.config.num_hidden_layers))
                row["gpu_busy"] = row["critical_us_per_step"] / 1e3 / row["tpot_ms"]
    return row


def run(model, args, device, prompt_len, batch, bandwidth, modes, on_row, progress=None) -> None:
    """Measures each mode at one prompt length and batch size and hands its row to `on_row` at once; a mode that
    raises gives a row with its `error` instead."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (batch, prompt_len), generator=g).to(device)
    context = prompt_len + (args.new_tokens + 1) / 2  # mean cached length over the timed steps
    step_bytes = weight_bytes(model) + kv_bytes(model, batch, context)
    for mode in modes:
        if progress:
            progress.set_postfix_str(f"context {prompt_len}, batch {batch}, {mode}")
        try:
            row = measure_mode(model, mode, prompt, args.new_tokens, args.repeats, device, profile=not args.no_profile)
        except Exception as e:  # noqa: BLE001 - one mode failing (a compile error, OOM) must not lose the others
            row = {"mode": mode, "error": f"{type(e).__name__}: {e}"}
        row.update(context=prompt_len, batch=batch, bytes_per_step=step_bytes)
        if bandwidth:
            row["roofline_ms"] = step_bytes / (bandwidth * 1e9) * 1e3
            if "tpot_ms" in row:
                row["achieved_gbs"] = step_bytes / (row["tpot_ms"] / 1e3) / 1e9
                row["tpot_over_roofline"] = row["tpot_ms"] / row["roofline_ms"]
        on_row(row)
        if progress:
            progress.update(1)


def plot(rows: list[dict], path: str, title: str, x: str = "context") -> None:
    """TPOT of each mode and the roofline against `x`: "context" (--sweep-context) or "batch" (--sweep-batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        pts = sorted((r[x], r["tpot_ms"]) for r in rows if r["mode"] == mode)
        ax.plot(*zip(*pts), marker="o", label=mode)
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
    ("tokens_per_s", "tok/s", ".0f"),
    ("achieved_gbs", "GB/s", ".0f"),
    ("tpot_over_roofline", "x roofline", ".2f"),
    ("kernels_per_step", "kernels/step", ".0f"),
    ("gpu_busy", "GPU busy", ".0%"),
    ("peak_memory_gb", "peak GB", ".1f"),
]


KERNEL_COLUMNS = [
    ("kernel", "kernel", ""),
    ("launches", "launches/step", ".1f"),
    ("critical_us", "critical us/step", ".1f"),
    ("critical_us_each", "critical us/launch", ".2f"),
    ("us", "duration us/step", ".1f"),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog=common.prog("evals.tpot"), description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    common.add_model_args(parser)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", default=None, help=f"comma-separated subset of {','.join(ALL_MODES)}")
    parser.add_argument("--sweep-context", default=None, help="prompt lengths, e.g. 128,512,1024,2048,4096")
    parser.add_argument("--sweep-batch", default=None, help="batch sizes instead of --batch, e.g. 1,2,4,8")
    parser.add_argument("--plot", default=None, help="PNG path for the sweep plot (default: beside --json)")
    parser.add_argument("--no-profile", action="store_true", help="skip the kernel profile (torch.profiler)")
    parser.add_argument(
        "--kernel-table", action="store_true", help="print each mode's costliest kernels per decode step"
    )
    parser.add_argument("--json", default=None, help="write every figure and the run's settings here")
    args = parser.parse_args(argv)

    device, dtype = common.resolve(args)
    modes = args.modes.split(",") if args.modes else (GPU_MODES if device.type == "cuda" else CPU_MODES)
    unknown = set(modes) - set(ALL_MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {ALL_MODES}")
    if device.type != "cuda" and any(m.endswith("compiled") for m in modes):
        parser.error("the compiled modes need a CUDA GPU")
    if args.sweep_context and args.sweep_batch:
        parser.error("--sweep-context and --sweep-batch each make their own plot: give one of them")
    contexts = [int(c) for c in args.sweep_context.split(",")] if args.sweep_context else [args.prompt_len]
    batches = [int(b) for b in args.sweep_batch.split(",")] if args.sweep_batch else [args.batch]
    if min(batches) < 1:
        parser.error(f"batch sizes must be >= 1, got {batches}")
    if (args.sweep_context or args.sweep_batch) and importlib.util.find_spec("matplotlib") is None:
        parser.error("the sweeps are plotted with matplotlib: pip install 'fused-patcher[plots]'")

    model, _, name = common.load_model(args, device, dtype)
    model.generation_config.eos_token_id = None  # always generate exactly the requested number of tokens
    model.generation_config.pad_token_id = 0
    longest = max(contexts) + args.new_tokens + 1
    model._tpot_cache_len = longest  # one static-cache size for every point: HF compiles once
    if getattr(model.config, "max_position_embeddings", longest) < longest:
        model.config.max_position_embeddings = longest  # rope has no length limit; random weights anyway

    bandwidth = common.hbm_read_bandwidth_gbs(device) if device.type == "cuda" else None
    print(
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
        "complete": False,
        "results": [],
    }
    rows = payload["results"]

    def on_row(row):
        # Each mode's figures reach stderr and the JSON as soon as they are measured, so a run that is stopped
        # (a time limit, a mode that hangs) keeps what it has.
        rows.append(row)
        figures = f"{row['tpot_ms']:.3f} ms" if "tpot_ms" in row else f"failed: {row['error']}"
        where = f"context {row['context']}, batch {row['batch']}"
        tqdm.write(f"tpot: {row['mode']} at {where}: {figures}", file=sys.stderr)
        common.write_json(args.json, payload, announce=False)

    with tqdm(total=len(batches) * len(contexts) * len(modes), desc="tpot", file=sys.stderr) as progress:
        for batch in batches:
            for context in contexts:
                run(model, args, device, context, batch, bandwidth, modes, on_row, progress)

    columns = [*COLUMNS[:2], ("batch", "batch", "d"), *COLUMNS[2:]] if args.sweep_batch else COLUMNS
    print(common.table(rows, columns))
    failed = [r for r in rows if "error" in r]
    for row in failed:
        print(f"{row['mode']} at context {row['context']} failed: {row['error']}")
    if args.kernel_table:
        for row in rows:
            if row.get("top_kernels"):
                print(
                    f"\n{row['mode']}, context {row['context']}: a kernel running {row['critical_us_per_step']:.0f} us "
                    f"of {row['tpot_ms'] * 1e3:.0f} us per step ({100 * row['gpu_busy']:.0f}%); durations sum to "
                    f"{row['kernel_us_per_step']:.0f} us (they overlap under programmatic dependent launch)"
                )
                print(common.table(row["top_kernels"], KERNEL_COLUMNS))
                if row.get("kernel_places"):
                    print("\nthe kernels that run several times a layer, by their place in it (#1 first):")
                    print(common.table(row["kernel_places"], KERNEL_COLUMNS))
    if bandwidth:
        roof = rows[0]["roofline_ms"]
        print(
            f"roofline at context {rows[0]['context']}: {rows[0]['bytes_per_step'] / 1e9:.3f} GB per step / "
            f"{bandwidth:.0f} GB/s = {roof:.3f} ms"
        )
    payload["complete"] = True
    common.write_json(args.json, payload)
    if args.sweep_context or args.sweep_batch:
        path = args.plot or (args.json.rsplit(".", 1)[0] + ".png" if args.json else "tpot_sweep.png")
        measured = [r for r in rows if "tpot_ms" in r]
        if args.sweep_context:
            plot(measured, path, f"{name} {payload['dtype']}, batch {args.batch}: TPOT vs context")
        else:
            plot(measured, path, f"{name} {payload['dtype']}, context {args.prompt_len}: TPOT vs batch", x="batch")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
