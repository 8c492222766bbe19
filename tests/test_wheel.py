"""What a wheel of the project holds, by pyproject.toml's setuptools tables: every Python package, and every CUDA
source the extension is built from on the user's machine (kernels/ ships as the data package patcher._kernels; a
folder missing there is a build that fails on the first CUDA op of an installed copy, not in this repository)."""

from __future__ import annotations

import fnmatch

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
CUDA_SOURCES = {".cu", ".cuh", ".h", ".cpp"}  # what patcher/ops/build.py compiles and hashes


def test_every_python_package_ships():
    packages = set(SETUPTOOLS["packages"])
    found = [
        ".".join(init.parent.relative_to(REPO).parts)
        for top in ("patcher", "evals")
        for init in sorted((REPO / top).rglob("__init__.py"))
    ]
    assert found and not [name for name in found if name not in packages], f"missing: {set(found) - packages}"


def test_every_cuda_source_ships():
    packages, data = set(SETUPTOOLS["packages"]), SETUPTOOLS["package-data"]
    root = REPO / SETUPTOOLS["package-dir"]["patcher._kernels"]
    sources = [path for path in sorted(root.rglob("*")) if path.suffix in CUDA_SOURCES]
    missing = []
    for path in sources:
        package = ".".join(("patcher._kernels", *path.parent.relative_to(root).parts))
        if package not in packages or not any(fnmatch.fnmatch(path.name, p) for p in data.get(package, [])):
            missing.append(str(path.relative_to(REPO)))
    assert sources and not missing, f"not in the wheel: {missing}"
