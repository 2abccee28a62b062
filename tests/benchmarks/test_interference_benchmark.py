"""The interference benchmark runs at a tiny size and writes its results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.benchmarks import benchlib

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(240)
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores, one per process")
def test_interference_benchmark_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "interference.py"), "--tiny",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "interference.json").read_text())
    assert doc["benchmark"] == "interference" and doc["config"]["repeats"] == 1
    kinds = doc["kinds"]
    assert list(kinds) == ["idle", "snapshot", "plain_copy", "persist"]
    assert kinds["idle"]["slowdown"] == 0.0
    for row in kinds.values():
        assert row["iterations"] >= 1 and row["mean_iteration_s"] > 0
    # The worker did its work while the trainer was timed, and it was counted.
    for kind in ("snapshot", "plain_copy"):
        assert kinds[kind]["copied_bytes_per_s"] > 0
        assert kinds[kind]["lost_ms_per_gb"] is not None
    assert kinds["persist"]["persists"] >= 1
    assert kinds["persist"]["lost_ms_per_persist"] is not None
    assert "per GB" in proc.stdout and "per persist" in proc.stdout


@pytest.mark.timeout(240)
def test_interference_benchmark_same_core_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "interference.py"), "--tiny",
                           "--same-core", "--gap-ms", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "interference_same_core.json").read_text())
    assert doc["config"]["same_core"] is True and doc["config"]["gap_s"] == 0.005
    kinds = doc["kinds"]
    assert list(kinds) == ["idle", "snapshot", "plain_copy", "persist"]
    # The trainer copied its own state in its pauses (whole snapshots only), and B persisted in
    # them on the same core.
    state_bytes = doc["config"]["state_bytes"]
    for kind in ("snapshot", "plain_copy"):
        copied = kinds[kind]["copied_bytes"]
        assert copied >= state_bytes and copied % state_bytes == 0
    assert kinds["persist"]["persists"] >= 1
    assert "in a 5 ms pause" in proc.stdout


def test_interference_benchmark_rejects_a_pause_that_is_not_positive(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = benchlib.usage_error("interference", ["--tiny", "--same-core", "--gap-ms", "0",
                                                "--out", str(tmp_path)], capsys)
    assert "--gap-ms must be > 0, got 0" in err
    assert not list(tmp_path.iterdir())
