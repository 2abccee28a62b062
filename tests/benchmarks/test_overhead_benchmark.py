"""The overhead benchmark runs at a tiny size and writes its results file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODES = ["none", "sync", "background", "dcp-async", "bubble"]


@pytest.mark.timeout(240)
def test_overhead_benchmark_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--tiny",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["benchmark"] == "overhead" and doc["config"]["stages"] == 2
    assert doc["config"]["ckpt_every"] == 1 and doc["config"]["threads_per_rank"] == 1
    assert list(doc["modes"]) == MODES
    steps = doc["config"]["steps"] - doc["config"]["warmup_steps"]
    for mode, m in doc["modes"].items():
        assert m["num_steps"] == steps * doc["config"]["rounds"], mode
        assert m["step_time_s"]["p25"] <= m["step_time_s"]["median"] <= m["step_time_s"]["p75"]
        assert m["overhead"]["min"] <= m["overhead"]["median"] <= m["overhead"]["max"]
        assert sorted(m["ckpt_blocking_s"]["median"]) == ["0", "1"]
    assert doc["modes"]["none"]["overhead"]["per_round"] == [0.0] * doc["config"]["rounds"]
    assert doc["modes"]["none"]["ckpt_blocking_s"]["median"] == {"0": 0.0, "1": 0.0}
    assert all(doc["modes"][m]["ckpt_blocking_s"]["mean"]["0"] > 0 for m in MODES[1:])
    # every round ran every mode once, in a rotated order
    assert [sorted(r["order"]) for r in doc["rounds"]] == [sorted(MODES)] * len(doc["rounds"])
    assert doc["losses_identical_across_modes"] is True
    bw = doc["copy_bandwidth"]
    assert bw["state_bytes"] > 0
    for key in ("snapshot_bytes_per_s", "plain_copy_bytes_per_s", "memcpy_bytes_per_s",
                "separate_checksum_bytes_per_s"):
        assert bw[key] > 0, key
    assert set(doc["goals"]) >= {"bubble_overhead_le_1pct", "bubble_5x_below_dcp_async",
                                 "bandwidth_ge_80pct"}
    assert "mode" in proc.stdout and "copy bandwidth" in proc.stdout
