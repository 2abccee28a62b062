"""The bubble benchmark runs at a tiny size and writes its results file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_bubbles_benchmark_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bubbles.py"), "--tiny",
                           "--schedules", "1f1b", "--out", str(tmp_path)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "bubbles.json").read_text())
    assert [r["microbatches"] for r in doc["results"]] == [2, 4, 8]
    for r in doc["results"]:
        assert len(r["measured_fraction"]) == len(r["predicted_fraction"]) == 2
        assert all(0.0 <= f < 1.0 for f in r["measured_fraction"] + r["predicted_fraction"])
        assert r["closed_form_fraction"] == pytest.approx(1 / (r["microbatches"] + 1))
