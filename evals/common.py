"""What the evaluation tools share: loading a model (hub id, local folder, GGUF file, or random real-size weights),
the run's environment for the JSON, GPU timing, and the measured HBM read bandwidth."""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def prog(module: str) -> str:
    """The command as the user typed it, for usage lines and the JSON: a console script (`patcher-tpot`, installed
    with the package, runs from any folder) or `python -m evals.tpot` (from the repository root)."""
    script = Path(sys.argv[0]).name
    return script if script.startswith("patcher-") else f"python -m {module}"


def add_model_args(parser: argparse.ArgumentParser, default_random: str | None = None) -> None:
    group = parser.add_argument_group("model (one of)")
    group.add_argument("--model", help="hub id or local folder, loaded with AutoModelForCausalLM.from_pretrained")
    group.add_argument("--gguf-file", help="a GGUF file (transformers' own GGUF loading; needs the gguf package)")
    group.add_argument("--random-config", help="random weights at a known shape: " + ", ".join(_random_names()))
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default: fp16 on CUDA, fp32 on CPU")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--attn", default="sdpa", help="HF attention implementation (default sdpa)")
    group.add_argument("--gptq", help="a GPTQ 4-bit checkpoint folder (patcher.load_gptq)")
    parser.add_argument(
        "--int4-random",
        type=int,
        metavar="GROUP",
        help="with --random-config: random GPTQ int4 weights of this group size in every decoder linear",
    )
    parser.add_argument(
        "--keep-quantized",
        action="store_true",
        help="with --gguf-file: keep its quantized linears as stored (patcher.load_gguf) instead of dequantizing",
    )
    parser.add_argument(
        "--gguf-random",
        metavar="TYPE",
        help="with --random-config: random GGUF blocks of this type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) in every "
        "decoder linear, or of a mix's types (Q4_K_M: Q4_K, with Q6_K V and down projections in llama.cpp's layers)",
    )
    parser.add_argument(
        "--w4a16",
        action="store_true",
        help="with --keep-quantized or --gguf-random: activations stay 16-bit (default: quantized to Q8_1, W4A8)",
    )
    parser.add_argument(
        "--split-gpus",
        type=int,
        metavar="N",
        help="place the model over N GPUs with accelerate (dispatch_model): the decoder layers in N even runs, the "
        "embedding with the first, the final norm and the head with the last",
    )
    parser.set_defaults(default_random=default_random)


def _random_names():
    from patcher import random_models

    return list(random_models.CONFIGS)


def resolve(args) -> tuple[torch.device, torch.dtype]:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = DTYPES[args.dtype] if args.dtype else (torch.float16 if device.type == "cuda" else torch.float32)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda requested but CUDA is not available")
    return device, dtype


def random_name(args, device: torch.device) -> str:
    """The random-weight model to build: --random-config, the tool's default, else Pythia-2.8B's shape on a GPU and a
    tiny model on a CPU."""
    name = args.random_config or args.default_random
    if name is None:
        name = "pythia-2.8b" if device.type == "cuda" else "tiny-pythia"
    return name


def split_over_gpus(model, n: int):
    """model placed by accelerate's dispatch_model over cuda:0..n-1: the decoder layers in n even runs, the final
    norm and the output head on the last GPU, everything else on the first."""
    from accelerate import dispatch_model

    if n > torch.cuda.device_count():
        sys.exit(f"error: --split-gpus {n}: {torch.cuda.device_count()} CUDA devices visible")
    prefix = model.base_model_prefix
    head = next(name for name, module in model.named_children() if module is model.get_output_embeddings())
    device_map = {head: n - 1}
    for name, module in getattr(model, prefix).named_children():
        if isinstance(module, torch.nn.ModuleList):
            for i in range(len(module)):
                device_map[f"{prefix}.{name}.{i}"] = i * n // len(module)
        else:
            device_map[f"{prefix}.{name}"] = n - 1 if "norm" in name else 0
    return dispatch_model(model, device_map=device_map)


def load_model(args, device: torch.device, dtype: torch.dtype):
    """Returns (model, tokenizer or None, name), placed over GPUs where --split-gpus asks."""
    model, tokenizer, name = _load_model(args, device, dtype)
    if getattr(args, "split_gpus", None):
        if device.type != "cuda" or args.gptq or getattr(args, "keep_quantized", False):
            sys.exit("error: --split-gpus places a dense model that was loaded on a CUDA device")
        model = split_over_gpus(model, args.split_gpus)
        name += f" over {args.split_gpus} GPUs"
    return model, tokenizer, name


def _load_model(args, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if args.gptq:
        from patcher import load_gptq

        model = load_gptq(args.gptq, dtype=dtype, device_map=device)
        return model, AutoTokenizer.from_pretrained(args.gptq), args.gptq
    chosen = [a for a in (args.model, args.gguf_file, args.random_config) if a]
    if len(chosen) > 1 and not (args.model and args.gguf_file):
        sys.exit("error: give one of --model, --gguf-file, --random-config")
    keep = getattr(args, "keep_quantized", False)
    gguf_random = getattr(args, "gguf_random", None)
    if keep and not args.gguf_file:
        sys.exit("error: --keep-quantized needs --gguf-file")
    if gguf_random and (args.gguf_file or args.model or getattr(args, "int4_random", None)):
        sys.exit("error: --gguf-random goes with --random-config (and without --int4-random)")
    if getattr(args, "w4a16", False) and not (keep or gguf_random):
        sys.exit("error: --w4a16 needs --keep-quantized or --gguf-random")
    if args.gguf_file:
        path = Path(args.gguf_file)
        if not path.is_file():
            sys.exit(f"error: GGUF file {path} not found")
        folder = args.model or str(path.parent)
        if keep:
            from patcher import load_gguf

            model = load_gguf(path, dtype=dtype, device_map=device, quantize_activations=not args.w4a16)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
            return model, tokenizer, f"{path.name} ({'W4A16' if args.w4a16 else 'W4A8'})"
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=path.name, dtype=dtype, attn_implementation=args.attn
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=path.name)
        return model.to(device).eval(), tokenizer, path.name
    if args.model:
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, attn_implementation=args.attn)
        return model.to(device).eval(), AutoTokenizer.from_pretrained(args.model), args.model
    from patcher import random_models

    name = random_name(args, device)
    model = random_models.build(name, dtype=dtype, device=device, attn_implementation=args.attn)
    if getattr(args, "int4_random", None):
        random_models.quantize_random(model, args.int4_random)
        name += f"-int4-g{args.int4_random}"
    if gguf_random:
        from patcher.gguf import format as gguf_format
        from patcher.gguf.random_weights import MIXES, quantize_random

        try:
            kind = gguf_random.upper() if gguf_random.upper() in MIXES else gguf_format.block_type(gguf_random).name
        except (KeyError, ValueError) as e:
            sys.exit(f"error: --gguf-random {gguf_random}: {e} (or a mix: {', '.join(MIXES)})")
        try:
            quantize_random(model, kind, quantize_activations=not args.w4a16)
        except ValueError as e:  # a row length that is not a whole number of the type's blocks
            sys.exit(f"error: --gguf-random {kind} on {name}: {e}")
        name += f"-{kind.lower()}-{'w4a16' if args.w4a16 else 'w4a8'}"
    return model, None, name


def environment(device: torch.device, tool: str = "") -> dict:
    import transformers

    import patcher

    env = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "patcher": patcher.__version__,
        "device": str(device),
        "command": " ".join([prog(tool), *sys.argv[1:]]) if tool else " ".join(sys.argv),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 1e9, 1),
            cuda=torch.version.cuda,
            sm_count=props.multi_processor_count,
        )
    else:
        env["cpu"] = platform.processor() or platform.machine()
    return env


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wall_time(fn, device: torch.device) -> float:
    """Seconds for fn(), synchronized before and after; in a tensor-parallel run every rank starts together and
    each gets rank 0's time (so that decisions taken from it agree)."""
    from . import distributed

    sync(device)
    distributed.barrier()
    start = time.perf_counter()
    fn()
    sync(device)
    return distributed.rank0_value(time.perf_counter() - start)


MAX_TIMING_TRIES = 5  # per repeat, for a (1 token, N + 1 tokens) pair whose difference is not positive


def generation_pairs(generate, new_tokens: int, repeats: int, device: torch.device, label: str) -> list[tuple]:
    """`repeats` pairs (seconds for generate(1), for generate(new_tokens + 1)), after the caller's warm-up; TPOT is
    (tn - t1) / new_tokens. A pair whose long run was not the slower one is noise (tiny models on a busy CPU): it is
    measured again, up to MAX_TIMING_TRIES times."""
    pairs = []
    for _ in range(repeats):
        for _attempt in range(MAX_TIMING_TRIES):
            t1 = wall_time(lambda: generate(1), device)
            tn = wall_time(lambda: generate(new_tokens + 1), device)
            if tn > t1:
                break
        else:
            raise RuntimeError(
                f"{label}: generating {new_tokens + 1} tokens was not slower than generating 1 in "
                f"{MAX_TIMING_TRIES} tries, so the difference is timing noise; use more --new-tokens"
            )
        pairs.append((t1, tn))
    return pairs


def gpu_time_ms(fn, reps: int = 50, warmup: int = 5, flush: bool = False) -> float:
    """Median GPU time of fn() in ms from CUDA events; `flush` evicts L2 before each run (cold weights)."""
    scratch = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if flush else None
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if scratch is not None:
            scratch.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def hbm_read_bandwidth_gbs(device: torch.device, gib: int = 4) -> float:
    """Measured HBM read bandwidth: a sum over `gib` GiB (bytes read / median time)."""
    data = torch.ones((gib << 30) // 4, dtype=torch.float32, device=device)
    ms = gpu_time_ms(data.sum, reps=10, warmup=2)
    return (gib << 30) / (ms * 1e-3) / 1e9


def write_json(path: str | None, payload: dict, announce: bool = True) -> None:
    """Writes the JSON (rank 0 only in a tensor-parallel run)."""
    from . import distributed

    if path and distributed.is_main():
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2, default=str) + "\n")
        if announce:
            print(f"wrote {path}")


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A plain text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for row in rows:
        cells.append([("-" if row.get(k) is None else format(row[k], f)) for k, _, f in columns])
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
