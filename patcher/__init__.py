"""Fused CUDA kernels for HF Transformers decoder stacks (GPT-NeoX, LLaMA, Qwen2), swapped in with one call.

from patcher import patch_model, unpatch_model
report = patch_model(model)     # every decoder layer now runs fused kernels
print(report)                   # what was replaced, what was left as it was and why
unpatch_model(model)            # back to the original forwards, bit-identical outputs
"""

from .decode import DecodeOptions
from .gguf import load_gguf
from .gptq import load_gptq
from .ops import ExtensionError
from .patching import UnsupportedModelError, is_patched, patch_model, set_fast_generate, unpatch_model
from .report import ModuleRecord, PatchReport

__version__ = "0.1.0"

__all__ = [
    "DecodeOptions",
    "ExtensionError",
    "ModuleRecord",
    "PatchReport",
    "UnsupportedModelError",
    "is_patched",
    "load_gguf",
    "load_gptq",
    "patch_model",
    "set_fast_generate",
    "unpatch_model",
]
