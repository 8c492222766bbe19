"""What a model from `load_gguf` does where transformers needs float weights: saving and resizing the vocabulary.

`load_gguf` binds these functions over the model's own `save_pretrained` and `resize_token_embeddings` (instance
attributes, partials of the model, which pickle and copy.deepcopy carry). A GGUFLinear holds blocks (`qweight`),
which neither `from_pretrained` nor `resize_token_embeddings` can read, so each of them meets the weights that
transformers' own GGUF loading would hold: the blocks dequantized (bit-identical to `gguf.quants.dequantize`), in
the embedding's dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from .linear import GGUFLinear


def dense_weight(linear: GGUFLinear, dtype: torch.dtype, device: torch.device | None = None) -> torch.Tensor:
    """The linear's weight [out_features, in_features] dequantized to fp32 and cast once to dtype, on device."""
    return linear.dequantize().to(device=device, dtype=dtype)


def save_pretrained(self, save_directory, *args, state_dict: dict | None = None, **kwargs):
    """transformers' `save_pretrained`, writing each GGUF linear as the `weight` (and `bias`) a dense nn.Linear
    would hold, dequantized to the embedding's dtype on the CPU: the checkpoint loads with `from_pretrained` as the
    model transformers' GGUF loader builds. A `state_dict` passed in is written the same way."""
    state_dict = dict(self.state_dict() if state_dict is None else state_dict)  # (the caller's is not changed)
    dtype = self.get_input_embeddings().weight.dtype
    for name, module in self.named_modules():
        if isinstance(module, GGUFLinear) and f"{name}.qweight" in state_dict:
            del state_dict[f"{name}.qweight"]
            state_dict[f"{name}.weight"] = dense_weight(module, dtype, torch.device("cpu"))
    return type(self).save_pretrained(self, save_directory, *args, state_dict=state_dict, **kwargs)


def resize_token_embeddings(self, *args, **kwargs):
    """transformers' `resize_token_embeddings`, where the lm_head is kept as GGUF blocks: rows are added to float
    weights only, so the head first becomes an nn.Linear holding its dequantized weight (named in `gguf_report`),
    then transformers resizes the embedding and that head."""
    head = self.get_output_embeddings()
    if isinstance(head, GGUFLinear):
        embed = self.get_input_embeddings().weight
        bias = head.bias is not None
        dense = nn.Linear(head.in_features, head.out_features, bias, device=embed.device, dtype=embed.dtype)
        with torch.no_grad():
            dense.weight.copy_(dense_weight(head, embed.dtype, embed.device))
            if bias:
                dense.bias.copy_(head.bias)
        self.set_output_embeddings(dense)
        name = next(n for n, m in self.named_modules() if m is dense)
        self.gguf_report.quantized.pop(name, None)
        self.gguf_report.dequantized[name] = f"{head.kind}: dequantized by resize_token_embeddings"
    return type(self).resize_token_embeddings(self, *args, **kwargs)
