"""The graph-captured decode path behind `model.generate` of a patched model."""

from .generate import fast_generate, generate_path
from .runner import DecodeRunner, Sampling

__all__ = ["DecodeRunner", "Sampling", "fast_generate", "generate_path"]
