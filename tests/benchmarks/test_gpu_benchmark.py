"""The GPU benchmark runs at a tiny size and writes its results file (needs a CUDA device)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.benchmarks import benchlib

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_refuses_to_run_without_a_device(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    err = benchlib.usage_error("gpu", ["--tiny", "--out", str(tmp_path)], capsys)
    assert "needs a CUDA device" in err
    assert not (tmp_path / "gpu.json").exists()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("device", [
    "cpu",  # the harness alone: CI has no GPU
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA device")),
])
def test_gpu_benchmark_tiny(tmp_path: Path, device: str) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--tiny",
                           "--device", device, "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "gpu.json").read_text())
    assert doc["benchmark"] == "gpu" and doc["config"]["stages"] == 1
    assert (doc["device"] == "cpu") == (device == "cpu")
    assert list(doc["modes"]) == ["none", "sync", "background", "dcp-async", "bubble"]
    for mode, m in doc["modes"].items():
        blocks_per_round = {"none": 6, "bubble": 3}.get(mode, 1)
        assert m["num_steps"] == blocks_per_round * 9
        if mode != "none":  # every block's persist landed
            assert m["persisted_blocks"] == {"of": blocks_per_round, "0": blocks_per_round}
    bw = doc["copy_bandwidth"]
    assert bw["snapshot_bytes_per_s"] > 0 and bw["pinned_copy_bytes_per_s"] > 0
