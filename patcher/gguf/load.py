"""`load_gguf`: an HF model from a GGUF file whose decoder linears and lm_head keep the file's blocks (GGUFLinear).

The config (and later the tokenizer) come from transformers' own reading of the file's metadata; the model is built
with its parameters on the meta device (accelerate's init_empty_weights), and each tensor of the file is then read
once: a decoder linear, or an lm_head not tied to the embedding (llama.cpp stores it as Q6_K in most files), whose
tensor has a supported block type (format.TYPES) becomes a GGUFLinear holding the blocks as the file stores them,
without being dequantized; every other tensor is dequantized and processed exactly
as transformers' GGUF loader does it (`gguf.quants.dequantize`, the architecture's tensor processor, the name map),
in the model's dtype. So loading costs the dequantization of the other tensors only, and its peak memory is about
the quantized model's.

transformers maps GGUF tensor names to its own (`get_gguf_hf_weights_map`) and may permute a tensor's rows
(LLaMA files store q and k with each head's rotary halves interleaved; `LlamaTensorProcessor` undoes that). Blocks
run along the input dimension, so a row permutation moves whole rows of blocks: the same processor is run on the
row indices, and the block rows are taken in the order it returns. A tensor the processor changes in any other
way, an unsupported type, or a shape that is not the module's is dequantized as transformers would, and
`model.gguf_report` says which and why. The model's `save_pretrained` and `resize_token_embeddings` are bound to
dense.py's, which meet float weights where transformers needs them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn
from tqdm import tqdm

from ..patching import UnsupportedModelError
from ..registry import REGISTRY
from . import dense
from . import format as fmt
from .linear import GGUFLinear


@dataclass
class GGUFReport:
    """What load_gguf kept quantized and what runs dequantized. Keys are the model's module names (or the GGUF
    tensor name where no module takes the tensor)."""

    file: str
    quantized: dict[str, str] = field(default_factory=dict)  # module -> block type
    dequantized: dict[str, str] = field(default_factory=dict)  # module -> why it was dequantized
    quantize_activations: bool = True

    def __str__(self) -> str:
        mode = "W4A8 (Q8_1 activations)" if self.quantize_activations else "W4A16"
        counts: dict[str, int] = {}
        for kind in self.quantized.values():
            counts[kind] = counts.get(kind, 0) + 1
        kept = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "none"
        lines = [f"GGUF {self.file}: {len(self.quantized)} linears kept quantized ({kept}), {mode}"]
        lines += [f"  dequantized {name}: {why}" for name, why in self.dequantized.items()]
        return "\n".join(lines)


def row_order(processor, gguf_name: str, rows: int, mapping: dict) -> np.ndarray | None:
    """The order in which transformers' tensor processor takes the rows of `gguf_name` (identity: None); raises
    ValueError where it does more than reorder rows."""
    index = np.arange(rows, dtype=np.int64).reshape(rows, 1)
    result = processor.process(weights=index, name=gguf_name, tensor_key_mapping=mapping, parsed_parameters={})
    order = None if result.weights is None else np.asarray(result.weights)
    if result.name != gguf_name or order is None or order.shape != (rows, 1):
        raise ValueError("transformers' GGUF tensor processor reshapes or renames it")
    order = order.reshape(rows)
    if not np.array_equal(np.sort(order), np.arange(rows)):
        raise ValueError("transformers' GGUF tensor processor changes it beyond a row order")
    return None if np.array_equal(order, np.arange(rows)) else order


def tensor_processor(reader, config):
    """transformers' tensor processor for the file's architecture (the one its loader uses), given the model's
    config (the processors read the HF config keys, e.g. num_attention_heads, num_key_value_heads)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    field_ = reader.fields["general.architecture"]
    architecture = bytes(field_.parts[field_.data[0]]).decode("utf-8")
    return TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())


def load_gguf(
    path: str | Path,
    dtype: torch.dtype = torch.float16,
    device_map: str | torch.device | None = None,
    quantize_activations: bool = True,
):
    """Loads a GGUF file as an HF *ForCausalLM in eval mode, with GGUFLinear decoder linears (and lm_head, untied);
    `model.gguf_report` (a GGUFReport) names the linears kept quantized and those dequantized.

    dtype: the activations' and the dequantized tensors' dtype. device_map: one device ("cuda", "cpu",
    torch.device). quantize_activations: W4A8 (activations quantized to Q8_1 blocks) or W4A16. The model is not
    patched (call patch_model afterwards).
    """
    from accelerate import init_empty_weights
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    if isinstance(device_map, dict):
        raise NotImplementedError("load_gguf places the model on one device; pass a device, not a device map")
    device = torch.device(device_map) if device_map is not None else torch.device("cpu")
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    entry = REGISTRY.get(config.model_type)
    if entry is None:
        raise UnsupportedModelError(f"GGUF model type {config.model_type!r} is not supported ({', '.join(REGISTRY)})")
    with init_empty_weights(include_buffers=False):  # (parameters on the meta device, buffers such as RoPE's real)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    reader = GGUFReader(str(path))
    processor = tensor_processor(reader, model.config)
    mapping = get_gguf_hf_weights_map(model, processor)
    prefix = f"{entry.spec.base_model}.{entry.spec.layers}."
    report = GGUFReport(str(path.name), quantize_activations=quantize_activations)
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()  # kept as blocks too where untied (the embedding's rows are looked up)
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    kept: dict[str, tuple[torch.Tensor, str]] = {}  # module name -> (blocks in the model's row order, block type)
    parsed = {"config": processor.config, "tensors": {}}  # (some processors store tensors here themselves)
    state = parsed["tensors"]
    for tensor in tqdm(reader.tensors, desc=f"reading {path.name}", leave=False):
        hf_name = mapping.get(tensor.name)
        module_name = hf_name[: -len(".weight")] if hf_name and hf_name.endswith(".weight") else None
        module = modules.get(module_name) if module_name else None
        kind = tensor.tensor_type.name
        decoder = module_name is not None and module_name.startswith(prefix)
        if isinstance(module, nn.Linear) and (decoder or (module is head and not tied)):
            reason, order = _keep_reason(tensor, module), None
            if reason is None:
                try:
                    order = row_order(processor, tensor.name, module.out_features, mapping)
                except ValueError as e:
                    reason = str(e)
            if reason is None:
                data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
                kept[module_name] = (data if order is None else data[torch.from_numpy(order)].contiguous(), kind)
                continue
            report.dequantized[module_name] = f"{kind}: {reason}"
        elif kind not in ("F32", "F16", "BF16"):
            report.dequantized[module_name or hf_name or tensor.name] = f"{kind}: {_other_reason(model, module, tied)}"
        _dequantize_into(state, tensor, processor, mapping, parsed, dtype)
    for module_name, (data, kind) in kept.items():
        bias = state.pop(f"{module_name}.bias", None)
        parent, _, child = module_name.rpartition(".")  # (the lm_head's parent: the model itself, "")
        setattr(model.get_submodule(parent), child, GGUFLinear.from_blocks(data, kind, bias, quantize_activations))
        report.quantized[module_name] = kind
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    empty = [name for name, t in model.named_parameters() if t.is_meta]
    if empty:
        raise ValueError(f"{path.name} holds no tensor for {len(empty)} parameters of the model: {empty[:4]}")
    model.gguf_report = report
    for method in (dense.save_pretrained, dense.resize_token_embeddings):  # (they need float weights)
        # A partial, not a bound method: pickle writes a bound method as its name, which torch.load would look up
        # on the class (transformers' own, writing the blocks); a partial keeps the function and the model.
        model.__dict__[method.__name__] = functools.partial(method, model)
    return model.to(device).eval()


def _dequantize_into(state: dict, tensor, processor, mapping: dict, parsed: dict, dtype: torch.dtype) -> None:
    """One GGUF tensor as transformers' GGUF loader reads it (load_gguf_checkpoint): dequantized to fp32, processed
    by the architecture's tensor processor, under its HF name, cast to `dtype`; into `state` (nothing where the
    processor or the name map drops it)."""
    from gguf.quants import dequantize

    result = processor.process(
        weights=dequantize(tensor.data, tensor.tensor_type),
        name=tensor.name,
        tensor_key_mapping=mapping,
        parsed_parameters=parsed,
    )
    if result.weights is None or result.name not in mapping:
        return
    state[mapping[result.name]] = torch.from_numpy(np.copy(result.weights)).to(dtype)


def _other_reason(model, module, tied: bool) -> str:
    """Why a quantized tensor that is not a decoder linear is dequantized."""
    if module is not None and module is model.get_input_embeddings():
        return "the embedding, looked up by rows" + (" (the lm_head shares it)" if tied else "")
    return "the lm_head, tied to the embedding" if module is model.get_output_embeddings() else "not a decoder linear"


def _keep_reason(tensor, module: nn.Linear) -> str | None:
    """Why the GGUF tensor can't be kept as blocks in place of `module`, or None."""
    kind = tensor.tensor_type.name
    if kind not in fmt.TYPES:
        return f"not supported quantized (supported: {', '.join(fmt.TYPES)})"
    t = fmt.TYPES[kind]
    if module.in_features % t.block_size:
        return f"{module.in_features} inputs are not whole {t.block_size}-value blocks"
    rows, width = tensor.data.shape if tensor.data.ndim == 2 else (None, None)
    if rows != module.out_features or width != fmt.bytes_per_row(kind, module.in_features):
        shape = f"[{module.out_features}, {module.in_features}]"
        return f"blocks of shape {tuple(tensor.data.shape)} do not hold a {shape} weight"
    if tensor.data.dtype != np.uint8 or width % t.type_size:
        return f"data of dtype {tensor.data.dtype} is not {t.name} blocks"
    return None
