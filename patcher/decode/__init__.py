"""The graph-captured decode path behind `model.generate` of a patched model."""

from .generate import fast_generate, generate_path
from .options import DecodeOptions
from .runner import DecodeRunner, Sampling

__all__ = ["DecodeOptions", "DecodeRunner", "Sampling", "fast_generate", "generate_path"]
