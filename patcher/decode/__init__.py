"""The graph-captured decode path behind `model.generate` of a patched model."""

from .generate import decode_memory, fast_generate, generate_path, release_decode_memory
from .options import DecodeOptions
from .runner import DecodeRunner, Sampling

__all__ = [
    "DecodeOptions",
    "DecodeRunner",
    "Sampling",
    "decode_memory",
    "fast_generate",
    "generate_path",
    "release_decode_memory",
]
