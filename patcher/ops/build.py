"""Builds the CUDA kernels of `kernels/` on first use and loads them as the CUDA implementations of `patcher::`.

One shared library holds every kernel. It is built with torch's own extension builder (ninja, one nvcc process per
`.cu` file, in parallel) for the compute capability of the current GPU only, into a cache folder keyed by a hash of
the sources, the torch and CUDA versions and the GPU architecture, so a machine builds it once. The sources are
grouped by op family (`kernels/<family>/*.cu`) and include each other from the `kernels/` root. The `.cu` files
include no torch headers, which keeps the build short; only the `.cpp` glue files do.

The library is pure `TORCH_LIBRARY_IMPL` (no Python bindings), so it is loaded with `torch.ops.load_library`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import sys
import threading
import time
from pathlib import Path

import torch


class ExtensionError(RuntimeError):
    """The CUDA kernels could not be built or loaded; the message says why and what to do."""


_lock = threading.Lock()
_loaded = False


def kernels_dir() -> Path:
    """The folder with the CUDA sources: `kernels/` beside the package, or its copy inside an installed wheel."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_kernels", package.parent / "kernels"):
        if (candidate / "bindings.cpp").is_file():
            return candidate
    raise ExtensionError(f"the CUDA sources (kernels/**/*.cu) were not found next to {package}")


def cache_dir() -> Path:
    root = os.environ.get("PATCHER_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "patcher")
    return Path(root)


def pdl_disabled() -> bool:
    """Whether PATCHER_DISABLE_PDL=1 turns programmatic dependent launch off (every kernel then launches plainly)."""
    return os.environ.get("PATCHER_DISABLE_PDL") == "1"


def load(device: torch.device | None = None) -> None:
    """Builds (once per machine) and loads the CUDA kernels. Raises ExtensionError with the reason if it can't."""
    global _loaded
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if not torch.cuda.is_available():
            raise ExtensionError(
                "CUDA is not available: the fused kernels need an NVIDIA GPU (use backend='reference')"
            )
        from torch.utils import cpp_extension

        if cpp_extension.CUDA_HOME is None:
            raise ExtensionError(
                "nvcc was not found (CUDA_HOME is unset and no CUDA toolkit is on the PATH); install the CUDA toolkit "
                "matching torch's CUDA " + str(torch.version.cuda) + " or use backend='reference'"
            )
        src = kernels_dir()
        sources = sorted(src.rglob("*.cu")) + sorted(src.rglob("*.cpp"))
        stems = [s.stem for s in sources]  # torch names each object file after its source's file name alone
        if len(set(stems)) != len(stems):
            raise ExtensionError(f"two CUDA sources under {src} share a file name: {sorted(stems)}")
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"{major}.{minor}"
        digest = hashlib.sha256()
        for path in sorted(src.rglob("*")):
            if path.suffix in (".cu", ".cuh", ".cpp", ".h"):
                digest.update(path.relative_to(src).as_posix().encode() + path.read_bytes())
        digest.update(f"{torch.__version__}|{torch.version.cuda}|{arch}".encode())
        name = "patcher_kernels_" + digest.hexdigest()[:12]
        build_dir = cache_dir() / name
        build_dir.mkdir(parents=True, exist_ok=True)
        so = build_dir / f"{name}.so"
        fresh = not so.is_file()
        if fresh:
            print(
                f"patcher: building CUDA kernels for sm_{major}{minor} into {build_dir} (once per machine)...",
                file=sys.stderr,
                flush=True,
            )
        start = time.perf_counter()
        previous_arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST")
        os.environ["TORCH_CUDA_ARCH_LIST"] = arch  # only the GPU we run on: a short build
        try:
            library = cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                build_directory=str(build_dir),
                extra_cflags=["-O3"],
                extra_cuda_cflags=["-O3", "-lineinfo"],
                extra_include_paths=[str(src)],
                is_python_module=False,
                verbose=False,
            )
        except Exception as e:  # the compiler's own output is in the message
            raise ExtensionError(f"building the CUDA kernels failed in {build_dir}:\n{e}") from e
        finally:
            if previous_arch_list is None:
                os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
            else:
                os.environ["TORCH_CUDA_ARCH_LIST"] = previous_arch_list
        # The kernels read no environment: programmatic dependent launch is on unless PATCHER_DISABLE_PDL=1 (for
        # bisecting), read here once.
        ctypes.CDLL(library).patcher_set_pdl(ctypes.c_bool(not pdl_disabled()))
        if fresh:
            print(f"patcher: CUDA kernels built in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        _loaded = True
