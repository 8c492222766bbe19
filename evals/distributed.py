"""Tensor-parallel runs of the evaluation tools (`--tp N` under torchrun): the process group, the sharded model,
rank 0 as the one that reports, and timings that every rank takes together.

Every rank runs the same measurements (the row-wise layers' all-reduces need all of them); only rank 0 prints and
writes the JSON. The model is loaded by transformers' own tensor parallelism (`tp_plan="auto"`, the config's
plan), so the device is the one transformers picks: each rank's GPU (LOCAL_RANK) where there is an accelerator,
the CPU (gloo) where there is none.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
import tempfile
import uuid
from pathlib import Path

import torch
import torch.distributed as dist


def add_tp_arg(parser) -> None:
    parser.add_argument(
        "--tp",
        type=int,
        default=None,
        metavar="N",
        help="tensor parallelism over N processes: run under `torchrun --nproc-per-node N` (the model loaded with "
        "transformers' tp_plan='auto'; rank 0 reports)",
    )


def initialized() -> bool:
    """Whether this process is in a process group (torchrun with --tp, after setup)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def is_main() -> bool:
    return not initialized() or dist.get_rank() == 0


def active() -> bool:
    """Whether this run is tensor-parallel over more than one process (collectives and barriers are needed)."""
    return world_size() > 1


def torchrun_command(tool: str, tp: int, argv: list[str] | None) -> str:
    rest = " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))
    return f"torchrun --nproc-per-node {tp} -m {tool} {rest}"


def check(args, tool: str, argv: list[str] | None = None) -> None:
    """Exits with a clear message where --tp and the launch disagree, or --tp meets a loader it does not shard;
    `argv` is the tool's arguments (None: the command line's), for the torchrun command the message gives."""
    launched = os.environ.get("WORLD_SIZE")
    if args.tp is None:
        if launched and int(launched) > 1:
            sys.exit(
                f"error: launched as {launched} processes (WORLD_SIZE) without --tp: pass --tp {launched} to run "
                "tensor-parallel, or run one process"
            )
        return
    if args.tp < 1:
        sys.exit(f"error: --tp must be >= 1, got {args.tp}")
    if not launched:
        if args.tp == 1:
            return
        sys.exit(
            f"error: --tp {args.tp} runs one process per shard under torch.distributed; launch it as\n"
            f"  {torchrun_command(tool, args.tp, argv)}\n"
            "(across machines: torchrun --nnodes M --nproc-per-node G --rdzv-backend c10d "
            "--rdzv-endpoint HOST:PORT ... on each, M x G = --tp)"
        )
    if int(launched) != args.tp:
        sys.exit(f"error: --tp {args.tp} but torchrun started {launched} processes (WORLD_SIZE); they must be equal")
    unsupported = [
        flag
        for flag, value in (
            ("--gguf-file", args.gguf_file),
            ("--gptq", args.gptq),
            ("--int4-random", getattr(args, "int4_random", None)),
            ("--gguf-random", getattr(args, "gguf_random", None)),
        )
        if value
    ]
    if unsupported:
        sys.exit(
            f"error: --tp loads the model with transformers' tp_plan='auto' (--model or --random-config); "
            f"{', '.join(unsupported)} is not sharded that way"
        )


def setup(args) -> None:
    """Initializes the process group for --tp under torchrun (NCCL with a GPU, gloo without), unless it is."""
    if args.tp is None or not os.environ.get("WORLD_SIZE"):
        return
    accelerator = torch.cuda.is_available()
    if args.device and torch.device(args.device).type != ("cuda" if accelerator else "cpu"):
        sys.exit(
            f"error: with --tp the device is the one transformers' tensor parallelism picks "
            f"({'cuda' if accelerator else 'cpu'} here); --device {args.device} does not match it"
        )
    if accelerator:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        dist.init_process_group("nccl" if accelerator else "gloo")


def describe() -> dict:
    """What the JSON records about the run's parallelism."""
    if initialized():
        return {"tp": world_size(), "backend": dist.get_backend()}
    return {"tp": 1, "backend": None}


def load_sharded(path: str, dtype: torch.dtype, attn: str | None = None, plan: str | dict = "auto"):
    """The model at `path`, this rank's shards of it by transformers' tensor-parallel `plan` ("auto": the config's);
    `attn`: the attention implementation (None: transformers' default)."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": dtype} if attn is None else {"dtype": dtype, "attn_implementation": attn}
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:  # transformers before the DistributedConfig API
        return AutoModelForCausalLM.from_pretrained(path, tp_plan=plan, **kwargs)
    return AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan=plan), **kwargs)


def load_model(args, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer or None, name, device): common.load_model's, sharded by tp_plan when --tp is active."""
    from . import common

    if args.tp is None or not initialized():
        model, tokenizer, name = common.load_model(args, device, dtype)
        return model, tokenizer, name, device
    from transformers import AutoTokenizer

    if args.model and args.random_config:
        sys.exit("error: give one of --model, --random-config")
    if args.model:
        model = load_sharded(args.model, dtype, args.attn).eval()
        return model, AutoTokenizer.from_pretrained(args.model), args.model, model.device
    name = common.random_name(args, device)
    model = _random_sharded(name, dtype, device, args.attn).eval()
    return model, None, name, model.device


def _random_sharded(name: str, dtype: torch.dtype, device: torch.device, attn: str):
    """Random weights sharded by the config's plan: the first process of each machine builds the whole model (the
    same seed as a one-process run on that device) and saves it to a temporary folder, every rank loads its shards
    from there, and the folder is removed once all have."""
    from patcher import random_models

    folder = [str(Path(tempfile.gettempdir()) / f"patcher-tp-{uuid.uuid4().hex}") if is_main() else None]
    dist.broadcast_object_list(folder, src=0)
    path = Path(f"{folder[0]}-{socket.gethostname()}")
    local_first = int(os.environ.get("LOCAL_RANK", "0")) == 0
    try:
        if local_first:
            whole = random_models.build(name, dtype=dtype, device=device, attn_implementation=attn)
            whole.save_pretrained(path)
            del whole
        barrier()
        model = load_sharded(str(path), dtype, attn)
        barrier()
    finally:
        if local_first:
            shutil.rmtree(path, ignore_errors=True)
    return model


def barrier() -> None:
    if active():
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[torch.cuda.current_device()])
        else:
            dist.barrier()


def rank0_value(value: float) -> float:
    """Rank 0's value on every rank, so that decisions taken from a timing are the same on all of them."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def finish() -> None:
    if initialized():
        barrier()
        dist.destroy_process_group()
