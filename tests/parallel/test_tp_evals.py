"""`--tp N` of evals.tpot and evals.perplexity: two gloo processes on the CPU under torch.distributed.run, rank 0
writing the JSON; the launch checks run in this process (they exit before any process group exists)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from launch import RANKS, torchrun

from evals import perplexity, tpot

PERPLEXITY_ARGS = ["--random-config", "tiny-llama", "--device", "cpu", "--max-tokens", "600", "--ctx", "128"]
PERPLEXITY_ARGS += ["--stride", "64"]


def launch(module: str, args: list[str]) -> subprocess.CompletedProcess:
    run = torchrun(["-m", module, *args], timeout=300)
    assert run.returncode == 0, f"{module} --tp {RANKS} failed:\n{run.stdout[-4000:]}\n{run.stderr[-8000:]}"
    return run


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    return str(path)


@pytest.mark.slow
def test_tpot_under_torchrun_rank0_writes_one_json(tmp_path):
    out = tmp_path / "tpot.json"
    args = ["--random-config", "tiny-llama", "--tp", str(RANKS), "--device", "cpu", "--modes", "hf-eager,patched-eager"]
    run = launch("evals.tpot", [*args, "--new-tokens", "4", "--repeats", "1", "--no-profile", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["complete"] and result["parallel"] == {"tp": RANKS, "backend": "gloo"}
    assert [r["mode"] for r in result["results"]] == ["hf-eager", "patched-eager"]
    for row in result["results"]:
        assert "error" not in row, row
        assert row["tpot_ms"] > 0 and len(row["tpot_ms_all"]) == 1
    assert run.stdout.count("hf-eager ") == 1, run.stdout  # one table, from rank 0
    assert run.stdout.count(f"wrote {out}") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tpot.json"]


@pytest.fixture
def one_thread():
    """The one-process run with one thread, as each rank has (OMP_NUM_THREADS=1): a tiny model's small matmuls
    run several times slower with threads on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_perplexity_under_torchrun_matches_one_process(tmp_path, text_file, one_thread):
    out = tmp_path / "tp.json"
    launch("evals.perplexity", [*PERPLEXITY_ARGS, "--tp", str(RANKS), "--text-file", text_file, "--json", str(out)])
    sharded = json.loads(out.read_text())
    whole_out = tmp_path / "whole.json"
    assert perplexity.main([*PERPLEXITY_ARGS, "--text-file", text_file, "--json", str(whole_out)]) == 0
    whole = json.loads(whole_out.read_text())

    assert sharded["parallel"] == {"tp": RANKS, "backend": "gloo"}
    assert whole["parallel"] == {"tp": 1, "backend": None}
    assert sharded["unpatch_restores_baseline"]
    assert sharded["results"]["unpatched"]["tokens_scored"] == whole["results"]["unpatched"]["tokens_scored"] > 500
    expected = whole["results"]["unpatched"]["perplexity"]
    for mode in ("unpatched", "patched"):
        got = sharded["results"][mode]["perplexity"]
        assert abs(got - expected) <= 1e-5 * expected, f"{mode}: {got} against one process's {expected}"
    assert abs(sharded["results"]["patched"]["delta_ppl_relative"]) <= 1e-5
    assert sharded["results"]["patched"]["first_window_top1_agreement"] == 1.0


@pytest.mark.parametrize("tool", [tpot, perplexity])
def test_tp_without_torchrun_names_the_command(tool, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        tool.main(["--random-config", "tiny-llama", "--device", "cpu", "--tp", "2"])
    message = str(exit_info.value)
    assert "torchrun --nproc-per-node 2 -m evals." in message and "--tp 2" in message, message


@pytest.mark.parametrize(
    "world, args, message",
    [
        ("2", ["--tp", "4"], "--tp 4 but torchrun started 2 processes"),
        ("2", [], "without --tp: pass --tp 2"),
        ("2", ["--tp", "2", "--int4-random", "32"], "--int4-random is not sharded"),
        (None, ["--tp", "0"], "--tp must be >= 1"),
    ],
)
def test_tp_launch_is_checked(world, args, message, monkeypatch):
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit) as exit_info:
        tpot.main(["--random-config", "tiny-llama", "--device", "cpu", "--no-profile", *args])
    assert message in str(exit_info.value)
