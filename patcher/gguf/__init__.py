"""GGUF checkpoints kept quantized: the block formats (format.py), pure-torch reference matmuls (reference.py), a
GGUF linear layer and `load_gguf`."""

from .format import TYPES, dequantize
from .linear import GGUFLinear
from .load import GGUFReport, load_gguf

__all__ = ["TYPES", "GGUFLinear", "GGUFReport", "dequantize", "load_gguf"]
