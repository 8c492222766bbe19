"""Writes a GPTQ-format checkpoint from an HF model by round-to-nearest: `python -m patcher.gptq.pack SRC DST`.

For tests and benchmarks: every linear of every decoder layer is quantized to 4 bits per group of input rows
(`--group-size`, -1 for one group), symmetric (`--sym`, zero point 8) or asymmetric (min/max per group), as GPTQ's
own quantizer grids them, but without GPTQ's Hessian-based error correction. `--act-order` orders the input rows by
descending weight norm before grouping (projections that read the same input, q/k/v and gate/up, share one order),
which gives the non-trivial `g_idx` an act-order checkpoint has. The output is v1 ("gptq", as AutoGPTQ writes and
GPTQModel saves) or, with `--format gptq_v2`, v2: safetensors, config.json with `quantization_config`, and
quantize_config.json. Embeddings, norms and lm_head stay in fp16.

SRC is an HF model folder or a .gguf file (loaded through transformers' GGUF support).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from ..registry import REGISTRY
from . import format as fmt


def quantize(
    weight: torch.Tensor, group_size: int, sym: bool, order: torch.Tensor | None = None, version: int = 1
) -> dict[str, torch.Tensor]:
    """nn.Linear weight [N, K] -> GPTQ tensors (qweight, qzeros, scales fp16, g_idx) by round-to-nearest."""
    w = weight.detach().float().cpu()
    N, K = w.shape
    if order is None:
        order = torch.arange(K)
    G = fmt.groups_for(K, group_size)
    size = K if G == 1 else group_size
    g_idx = torch.empty(K, dtype=torch.int32)
    g_idx[order] = (torch.arange(K) // size).to(torch.int32)
    scales = torch.empty(G, N, dtype=torch.float16)
    zeros = torch.empty(G, N, dtype=torch.int64)
    for g in range(G):
        block = w[:, order[g * size : (g + 1) * size]]
        xmin = block.min(dim=1).values.clamp(max=0)
        xmax = block.max(dim=1).values.clamp(min=0)
        if sym:
            xmax = torch.maximum(xmin.abs(), xmax)
            xmin = torch.where(xmin < 0, -xmax, xmin)
        empty = (xmin == 0) & (xmax == 0)
        xmin, xmax = xmin.masked_fill(empty, -1.0), xmax.masked_fill(empty, 1.0)
        scale = ((xmax - xmin) / fmt.MAXQ).to(torch.float16)
        if sym:
            zero = torch.full((N,), (fmt.MAXQ + 1) // 2, dtype=torch.int64)
        else:
            zero = torch.round(-xmin / scale.float()).to(torch.int64)
        # v1 stores zero - 1 and cannot represent a zero point of 0 (it would read back as 16): use 1 there.
        zeros[g] = zero.clamp(1 if version == 1 else 0, fmt.MAXQ)
        scales[g] = scale
    gi = g_idx.long()
    q = torch.round(w / scales[gi].T.float() + zeros[gi].T).clamp(0, fmt.MAXQ).to(torch.int64)  # [N, K]
    stored = (zeros - 1) & fmt.MAXQ if version == 1 else zeros
    return {
        "qweight": fmt.pack_rows(q.T.contiguous()),
        "qzeros": fmt.pack_cols(stored),
        "scales": scales,
        "g_idx": g_idx,
    }


def input_order(weights: list[torch.Tensor]) -> torch.Tensor:
    """Act-order for round-to-nearest: input rows by descending squared norm over all projections reading them."""
    norms = sum(w.detach().float().pow(2).sum(dim=0) for w in weights)
    return torch.argsort(norms, descending=True, stable=True)


def load_source(src: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(src)
    gguf = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    folder = path.parent if gguf else path
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **gguf)
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, **gguf)
    except (OSError, ValueError):  # a model folder without tokenizer files, a GGUF file without a tokenizer
        tokenizer = None
    return model.eval(), tokenizer


def pack_model(
    model,
    dst: str | Path,
    group_size: int = 128,
    act_order: bool = False,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    tokenizer=None,
) -> Path:
    """Quantizes the decoder linears of an HF model (GPT-NeoX, LLaMA, Qwen2) and writes a GPTQ checkpoint."""
    if checkpoint_format not in fmt.FORMAT_VERSIONS:
        raise ValueError(f"checkpoint_format must be one of {list(fmt.FORMAT_VERSIONS)}, got {checkpoint_format!r}")
    entry = REGISTRY.get(model.config.model_type)
    if entry is None:
        raise ValueError(f"model type {model.config.model_type!r} is not supported ({', '.join(REGISTRY)})")
    spec, version = entry.spec, fmt.FORMAT_VERSIONS[checkpoint_format]
    base = getattr(model, spec.base_model)
    prefix = f"{spec.base_model}.{spec.layers}"
    groups = [
        (spec.attention, list(spec.qkv)),
        (spec.attention, [spec.out_proj]),
        (spec.mlp, list(spec.mlp_in)),
        (spec.mlp, [spec.mlp_out]),
    ]
    quantized: dict[str, dict[str, torch.Tensor]] = {}
    layers = getattr(base, spec.layers)
    for i, layer in enumerate(tqdm(layers, desc="quantizing layers", file=sys.stderr)):
        for parent, names in groups:
            linears = [getattr(getattr(layer, parent), name) for name in names]
            order = input_order([lin.weight for lin in linears]) if act_order else None
            for name, lin in zip(names, linears):
                tensors = quantize(lin.weight, group_size, sym, order, version)
                if lin.bias is not None:
                    tensors["bias"] = lin.bias.detach().to(torch.float16).cpu()
                quantized[f"{prefix}.{i}.{parent}.{name}"] = tensors

    state = {}
    for key, value in model.state_dict().items():
        module = key.rsplit(".", 1)[0]
        if module in quantized:
            continue
        if key == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied to the input embedding, as HF saves it
        state[key] = value.detach().to(torch.float16 if value.is_floating_point() else value.dtype).cpu().contiguous()
    for module, tensors in quantized.items():
        state.update({f"{module}.{name}": t.contiguous() for name, t in tensors.items()})

    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    quant = {
        "quant_method": "gptq",
        "bits": fmt.BITS,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": sym,
        "checkpoint_format": checkpoint_format,
        "pack_dtype": "int32",
        "static_groups": False,
    }
    config = model.config.to_dict()
    config["quantization_config"] = quant
    config["torch_dtype"] = config["dtype"] = "float16"
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (dst / "quantize_config.json").write_text(json.dumps(quant, indent=2) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(dst)
    return dst


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m patcher.gptq.pack", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("src", help="HF model folder, or a .gguf file")
    parser.add_argument("dst", help="output folder")
    parser.add_argument("--group-size", type=int, default=128, help="input rows per group (-1: one group)")
    parser.add_argument("--act-order", action="store_true", help="order input rows by weight norm (non-trivial g_idx)")
    parser.add_argument("--sym", action="store_true", help="symmetric quantization (zero point 8)")
    parser.add_argument("--format", default="gptq", choices=list(fmt.FORMAT_VERSIONS), help="v1 (default) or v2")
    args = parser.parse_args(argv)
    if args.group_size == 0 or args.group_size < -1:
        parser.error("--group-size must be positive or -1")
    dst = Path(args.dst)
    if dst.exists() and any(dst.iterdir()) and not (dst / "quantize_config.json").exists():
        parser.error(f"{dst} exists and is not a GPTQ checkpoint folder; refusing to write into it")
    model, tokenizer = load_source(args.src)
    out = pack_model(model, args.dst, args.group_size, args.act_order, args.sym, args.format, tokenizer)
    print(
        f"wrote {out} (GPTQ {args.format}, 4-bit, group size {args.group_size}, "
        f"{'act-order, ' if args.act_order else ''}{'sym' if args.sym else 'asym'})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
