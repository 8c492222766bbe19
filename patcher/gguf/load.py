"""`load_gguf`: an HF model from a GGUF file whose decoder linears keep the file's blocks (GGUFLinear).

The model, its config and every tensor are first built by transformers' own GGUF loader
(`from_pretrained(folder, gguf_file=name)`, which dequantizes everything); then each decoder linear whose GGUF
tensor has a supported block type (format.TYPES) is replaced by a GGUFLinear holding that tensor's blocks as the
file stores them. So the peak memory of loading is that of the dequantized model.

transformers maps GGUF tensor names to its own (`get_gguf_hf_weights_map`) and may permute a tensor's rows
(LLaMA files store q and k with each head's rotary halves interleaved; `LlamaTensorProcessor` undoes that). Blocks
run along the input dimension, so a row permutation moves whole rows of blocks: the same processor is run on the
row indices, and the block rows are taken in the order it returns. A tensor the processor changes in any other
way, an unsupported type, or a shape that is not the module's stays as transformers dequantized it, and
`model.gguf_report` says which and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..patching import UnsupportedModelError
from ..registry import REGISTRY
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
    """Loads a GGUF file as an HF *ForCausalLM in eval mode, with GGUFLinear decoder linears; `model.gguf_report`
    (a GGUFReport) names the linears kept quantized and those dequantized.

    dtype: the activations' and the dequantized tensors' dtype. device_map: one device ("cuda", "cpu",
    torch.device). quantize_activations: W4A8 (activations quantized to Q8_1 blocks) or W4A16. The model is not
    patched (call patch_model afterwards).
    """
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import get_gguf_hf_weights_map

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} is not a file")
    if isinstance(device_map, dict):
        raise NotImplementedError("load_gguf places the model on one device; pass a device, not a device map")
    device = torch.device(device_map) if device_map is not None else torch.device("cpu")
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    entry = REGISTRY.get(model.config.model_type)
    if entry is None:
        raise UnsupportedModelError(
            f"GGUF model type {model.config.model_type!r} is not supported ({', '.join(REGISTRY)})"
        )
    reader = GGUFReader(str(path))
    processor = tensor_processor(reader, model.config)
    mapping = get_gguf_hf_weights_map(model, processor)
    prefix = f"{entry.spec.base_model}.{entry.spec.layers}."
    report = GGUFReport(str(path.name), quantize_activations=quantize_activations)
    modules = dict(model.named_modules())
    for tensor in reader.tensors:
        hf_name = mapping.get(tensor.name)
        module_name = hf_name[: -len(".weight")] if hf_name and hf_name.endswith(".weight") else None
        module = modules.get(module_name) if module_name else None
        kind = tensor.tensor_type.name
        if module_name is None or not module_name.startswith(prefix) or not isinstance(module, nn.Linear):
            if kind not in ("F32", "F16", "BF16"):
                report.dequantized[module_name or hf_name or tensor.name] = f"{kind}: not a decoder linear"
            continue
        reason = _keep_reason(tensor, module)
        order = None
        if reason is None:
            try:
                order = row_order(processor, tensor.name, module.out_features, mapping)
            except ValueError as e:
                reason = str(e)
        if reason is not None:
            report.dequantized[module_name] = f"{kind}: {reason}"
            continue
        data = torch.from_numpy(np.array(tensor.data, dtype=np.uint8, copy=True))
        if order is not None:
            data = data[torch.from_numpy(order)].contiguous()
        bias = None if module.bias is None else module.bias.detach()
        layer = GGUFLinear.from_blocks(data, kind, bias, quantize_activations)
        parent, _, child = module_name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        report.quantized[module_name] = kind
    model.gguf_report = report
    return model.to(device).eval()


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
