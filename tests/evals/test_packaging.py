"""The packaging contract of the evaluation tools: console scripts that resolve to a main(argv) taking --help, and
matplotlib imported only where a sweep is plotted (it is an optional extra)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from conftest import REPO

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_console_scripts_run_the_tools_main():
    scripts = PROJECT["scripts"]
    assert set(scripts) == {"patcher-tpot", "patcher-perplexity", "patcher-ops"}
    for name, target in scripts.items():
        module, _, function = target.partition(":")
        main = getattr(importlib.import_module(module), function)
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0, name


def test_matplotlib_is_optional():
    assert not any(dep.startswith("matplotlib") for dep in PROJECT["dependencies"])
    assert PROJECT["optional-dependencies"]["plots"] == ["matplotlib"]
    code = "import sys, evals.tpot, evals.perplexity, evals.ops, evals.splits; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
