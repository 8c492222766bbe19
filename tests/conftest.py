"""Shared fixtures and the tolerances every test uses (stated once, here).

Tolerances:
- Kernel against reference: a kernel's max error against a high-precision reference (the reference run on float64
  copies of the inputs; on fp32 copies for model logits) may be at most KERNEL_ERROR_FACTOR times the error
  PyTorch's own ops make at the same dtype (the reference run in that dtype), as flash-attention bounds its
  kernels. The floor FLOOR[dtype] x max|reference| only matters where PyTorch happens to be exact (pass-through
  elements, an RMSNorm whose reference normalizes in fp32 as HF does): about one unit in the last place.
- Patched model against unpatched, fp32 on the CPU: max |logit difference| <= FP32_LOGIT_ATOL.
- Patched model in fp16/bf16 against an fp32 run of the same weights: the same 2x rule as the kernels.
"""

from __future__ import annotations

import copy
import functools
import os
import warnings
from pathlib import Path

import pytest
import torch

KERNEL_ERROR_FACTOR = 2.0
FLOOR = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}
FP32_LOGIT_ATOL = 1e-5

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"

HAS_CUDA = torch.cuda.is_available()
# The dtypes the kernel and op tests run in.
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def kernels():
    """The CUDA extension's ops (build.load builds or loads the library once a process): GPU tests take it by name or
    through `pytest.mark.usefixtures("kernels")`."""
    from patcher.ops import KERNELS, build

    build.load()
    return KERNELS


@pytest.fixture(scope="module")
def kernels_built():
    """The CUDA kernels built and loaded where a GPU is, for the tests that run on the CPU and the GPU (nothing to do
    on the CPU)."""
    if HAS_CUDA:
        from patcher.ops import build

        build.load()


def pytest_report_header(config):
    return None if HAS_CUDA else "no CUDA device: the tests marked gpu are deselected"


def pytest_collection_modifyitems(config, items):
    """Without a CUDA device, tests marked `gpu` are deselected (reported as one count, not as thousands of skips)."""
    if HAS_CUDA:
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if gpu:
        config.hook.pytest_deselected(items=gpu)
        items[:] = [item for item in items if not item.get_closest_marker("gpu")]


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_within_torch_error(kernel: torch.Tensor, torch_low: torch.Tensor, ref32: torch.Tensor, what: str = ""):
    """The 2x rule: |kernel - ref| <= 2 |torch_low - ref| + floor, elementwise maxima (ref: the precise run)."""
    assert kernel.shape == ref32.shape, f"{what}: shape {tuple(kernel.shape)} != {tuple(ref32.shape)}"
    assert torch.isfinite(kernel).all(), f"{what}: non-finite values (an element left unwritten?)"
    scale = max(ref32.abs().max().item(), 1.0) if ref32.numel() else 1.0
    err_kernel, err_torch = max_err(kernel, ref32), max_err(torch_low, ref32)
    bound = KERNEL_ERROR_FACTOR * err_torch + FLOOR[kernel.dtype] * scale
    assert err_kernel <= bound, (
        f"{what}: kernel error {err_kernel:.3g} > bound {bound:.3g} (torch error {err_torch:.3g})"
    )


def smollm2_gguf() -> Path | None:
    """The trained SmolLM2-135M GGUF: $PATCHER_SMOLLM2_GGUF, or None (tests that need it skip)."""
    path = os.environ.get("PATCHER_SMOLLM2_GGUF")
    return Path(path) if path and Path(path).is_file() else None


@functools.cache
def _smollm2_parts():
    from patcher.gptq.pack import load_source  # (transformers' own GGUF load, in fp32, with the tokenizer)

    model, tokenizer = load_source(str(smollm2_gguf()))
    return model.config, model.generation_config, model.state_dict(), tokenizer


def smollm2_transformers(dtype: torch.dtype = torch.float32, device="cpu"):
    """transformers' own load of the trained SmolLM2 GGUF (every tensor dequantized), in eval mode, and its tokenizer.
    The file is read and dequantized once a test process; each call builds a fresh model from those fp32 weights cast
    to `dtype`, as transformers' loader does for any dtype (it dequantizes to fp32, then casts)."""
    from transformers import AutoModelForCausalLM

    config, generation_config, state, tokenizer = _smollm2_parts()
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state)
    model.generation_config = copy.deepcopy(generation_config)
    return model.to(device).eval(), tokenizer


def wikitext_path() -> Path | None:
    path = Path(os.environ.get("PATCHER_WIKITEXT", SHARED / "data" / "wikitext-2-raw-test.txt"))
    return path if path.is_file() else None


@pytest.fixture(autouse=True)
def _quiet_transformers():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*attention mask.*")
        yield


def poison_cuda_cache(device="cuda") -> None:
    """Fill the caching allocator's free memory with NaN, so an output element a kernel forgets to write is NaN."""
    if HAS_CUDA:
        torch.full((64 << 20,), float("nan"), dtype=torch.float16, device=device)


def check_op(op_name, args, exact_outputs=()):
    """A `patcher::` op on CUDA against its reference in the working dtype and on float64 copies (floating tensors;
    other arguments, lists of int4 tensors too, as given): the 2x rule for every output, bit equality for
    `exact_outputs`. Returns (kernel outputs, reference outputs), as tuples."""
    from patcher.ops import KERNELS, reference

    poison_cuda_cache()
    got = getattr(KERNELS, op_name)(*args)
    low = getattr(reference, op_name)(*args)
    args64 = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    ref64 = getattr(reference, op_name)(*args64)
    got, low, ref64 = ((t,) if isinstance(t, torch.Tensor) else t for t in (got, low, ref64))
    for i, (g, lo, r) in enumerate(zip(got, low, ref64)):
        assert g.is_contiguous() and g.device.type == "cuda" and g.dtype == lo.dtype
        assert_within_torch_error(g, lo, r, f"{op_name} output {i}")
        if i in exact_outputs:
            assert torch.equal(g, lo), f"{op_name} output {i} differs from PyTorch's rounding"
    return got, low


NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "dual_layer_norm", "add_layer_norm", "add_dual_layer_norm")


def norm_args(op: str, x, d, d2, w, b, w2, b2) -> tuple:
    """A norm op's arguments from the parts the norm tests make: x, the deltas, both norms' weights and biases."""
    return {
        "rms_norm": (x, w, 1e-6),
        "add_rms_norm": (x, d, w, 1e-6),
        "layer_norm": (x, w, b, 1e-5),
        "dual_layer_norm": (x, w, b, w2, b2, 1e-5),
        "add_layer_norm": (x, d, d2, w, b, 1e-5),
        "add_dual_layer_norm": (x, d, d2, w, b, w2, b2, 1e-5),
    }[op]


# The attention heads of the four model shapes, for the ops that make q and the current token's K/V from a QKV
# projection's output or accumulator: q heads, kv heads, head_dim, rotary dims, interleaved.
QKV_HEADS = {
    "pythia-2.8b": (32, 32, 80, 20, True),  # partial rotary: partner dims 10 apart, across a lane's 8
    "llama-3.1-8b": (32, 8, 128, 128, False),
    "qwen2-1.5b": (12, 2, 128, 128, False),
    "smollm2": (9, 3, 64, 64, False),
}


# The norm prologues of the decode GEMVs (norm_gemv, norm_gemv_rope_cache, int4_gemv, int4_qkv_rope_cache).
PROLOGUES = ["none", "rms", "add_rms", "layer", "add2_dual_layer"]


def prologue_args(kind, batch, k, dtype):
    """x [batch, k] and the prologue arguments (delta, delta2, weight, bias, weight2, bias2, eps, rms) of `kind`."""
    x = torch.randn(batch, k, device="cuda").to(dtype)
    d, d2 = (torch.randn(batch, k, device="cuda").to(dtype) for _ in range(2))
    w, b, w2, b2 = ((torch.randn(k, device="cuda") * 0.3 + 1).to(dtype) for _ in range(4))
    none = (None, None, None, None, None, None, 0.0, False)
    return x, {
        "none": none,
        "rms": (None, None, w, None, None, None, 1e-6, True),
        "add_rms": (d, None, w, None, None, None, 1e-6, True),
        "layer": (None, None, w, b, None, None, 1e-5, False),
        "add2_dual_layer": (d, d2, w, b, w2, b2, 1e-5, False),
    }[kind]


def rope_tables(shape, dtype):
    """Random cos/sin tables [*shape, rotary] (shape's last entry: rotary // 2 angles), as HF's rotary embedding lays
    them out (the angles twice), with large angles so that every rotation is exercised."""
    angles = torch.randn(*shape, device="cuda") * 3
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)
