"""The build's environment switches, read in Python (patcher/ops/build.py); no compiler needed."""

from __future__ import annotations

import pytest

from patcher.ops import build


@pytest.mark.parametrize(
    "value, mask",
    [(None, 0), ("", 0), ("gemv", 1), ("int4,norm", 6), (" norm , elementwise ", 12), ("all", 15)],
)
def test_late_trigger_mask(monkeypatch, value, mask):
    if value is None:
        monkeypatch.delenv("PATCHER_LATE_TRIGGER", raising=False)
    else:
        monkeypatch.setenv("PATCHER_LATE_TRIGGER", value)
    assert build.late_trigger_mask() == mask


def test_late_trigger_mask_rejects_unknown_kind(monkeypatch):
    monkeypatch.setenv("PATCHER_LATE_TRIGGER", "gemv,attention")
    with pytest.raises(ValueError, match="unknown kind 'attention'"):
        build.late_trigger_mask()


def test_trigger_kinds_match_the_kernels():
    """TRIGGER_KINDS mirrors common.cuh's TriggerKind, whose bits the kernels test."""
    import re

    header = (build.kernels_dir() / "common" / "common.cuh").read_text()
    kinds = {name.lower(): int(bit) for name, bit in re.findall(r"kTrigger(\w+) = (\d+),", header)}
    assert kinds == build.TRIGGER_KINDS
