"""`load_gptq`: an HF model whose decoder linears are GPTQ int4 layers, read straight from a GPTQ checkpoint.

transformers 5 loads GPTQ checkpoints only through optimum + gptqmodel (whose newest release needs a newer torch
than many installs have), and auto-gptq no longer imports. So the patcher reads the format itself: the model is
built on the meta device from its config, every decoder linear with a `qweight` in the checkpoint becomes a
GPTQLinear, and all tensors are assigned from the safetensors files. Both on-disk layouts are read: v1 ("gptq",
AutoGPTQ and GPTQModel's default save) and v2 ("gptq_v2"). 4-bit only.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..patching import UnsupportedModelError
from ..registry import REGISTRY
from . import format as fmt
from .linear import GPTQLinear


def quantization_settings(path: Path, config) -> dict:
    """The GPTQ settings of a checkpoint, from config.json's quantization_config or quantize_config.json."""
    settings = getattr(config, "quantization_config", None)
    if settings is not None and not isinstance(settings, dict):
        settings = settings.to_dict()
    if settings is None and (path / "quantize_config.json").is_file():
        settings = json.loads((path / "quantize_config.json").read_text())
    if settings is None:
        raise ValueError(f"{path} has no quantization_config in config.json and no quantize_config.json")
    method = settings.get("quant_method", "gptq")
    if method != "gptq":
        raise ValueError(f"{path}: quant_method {method!r} is not GPTQ")
    if settings.get("bits") != fmt.BITS:
        raise ValueError(f"{path}: only 4-bit GPTQ is supported, got bits={settings.get('bits')}")
    checkpoint_format = settings.get("checkpoint_format", "gptq")
    if checkpoint_format not in fmt.FORMAT_VERSIONS:
        raise ValueError(f"{path}: checkpoint_format {checkpoint_format!r} is not supported (gptq = v1, gptq_v2)")
    return settings


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    tensors = {}
    for name in files:
        tensors.update(load_file(path / name))
    return tensors


def load_gptq(path: str | Path, dtype: torch.dtype = torch.float16, device_map: str | torch.device | None = None):
    """Loads a GPTQ 4-bit checkpoint (local folder) as an HF *ForCausalLM with GPTQLinear layers, in eval mode.

    dtype: the activations' and the unquantized weights' dtype (the scales stay fp16, as stored). device_map: one
    device ("cuda", "cpu", torch.device); the model is not patched (call patch_model afterwards).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
    if isinstance(device_map, dict):
        raise NotImplementedError("load_gptq places the model on one device; pass a device, not a device map")
    device = torch.device(device_map) if device_map is not None else torch.device("cpu")
    config = AutoConfig.from_pretrained(path)
    settings = quantization_settings(path, config)
    entry = REGISTRY.get(config.model_type)
    if entry is None:
        raise UnsupportedModelError(f"GPTQ model type {config.model_type!r} is not supported ({', '.join(REGISTRY)})")
    spec, version = entry.spec, fmt.FORMAT_VERSIONS[settings.get("checkpoint_format", "gptq")]
    group_size = int(settings.get("group_size", -1))
    tensors = read_tensors(path)
    for pattern, replacement in spec.checkpoint_renames:
        tensors = {re.sub(pattern, replacement, key): value for key, value in tensors.items()}

    build_config = copy.deepcopy(config)
    if hasattr(build_config, "quantization_config"):
        del build_config.quantization_config  # from_config must not look for a quantizer
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config, dtype=dtype)
    quantized = {key[: -len(".qweight")] for key in tensors if key.endswith(".qweight")}
    replaced = set()
    for name, module in list(model.named_modules()):
        if name not in quantized:
            continue
        if not isinstance(module, torch.nn.Linear):
            raise TypeError(f"{path}: {name} has GPTQ tensors but is a {type(module).__name__}, not a linear layer")
        parent_name, _, child = name.rpartition(".")
        layer = GPTQLinear(
            module.in_features,
            module.out_features,
            group_size,
            f"{name}.bias" in tensors,
            version,
            scales_dtype=tensors[f"{name}.scales"].dtype,
            device="meta",
        )
        setattr(model.get_submodule(parent_name), child, layer)
        replaced.add(name)
    if quantized - replaced:
        raise ValueError(
            f"{path}: GPTQ tensors for modules the model does not have: {sorted(quantized - replaced)[:4]}"
        )

    state = {}
    for key, value in tensors.items():
        module = key.rsplit(".", 1)[0]
        keep = module in quantized  # qweight/qzeros/g_idx stay int32, scales and bias as stored
        state[key] = value if keep or not value.is_floating_point() else value.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [k for k in missing if k != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(f"{path}: missing tensors {missing[:6]}, unexpected tensors {unexpected[:6]}")
    base = getattr(model, spec.base_model)
    base.rotary_emb = type(base.rotary_emb)(config=model.config)  # its inv_freq buffers were never materialized
    still_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.device.type == "meta"]
    if still_meta:
        raise ValueError(f"{path}: tensors left unloaded: {still_meta[:6]}")
    model.config.quantization_config = settings
    return model.to(device).eval()
