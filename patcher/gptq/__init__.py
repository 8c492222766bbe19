"""GPTQ 4-bit checkpoints: the on-disk format, a GPTQ linear layer, `load_gptq`, and a round-to-nearest packer."""

from .format import dequantize
from .linear import GPTQLinear
from .load import load_gptq

__all__ = ["GPTQLinear", "dequantize", "load_gptq"]
