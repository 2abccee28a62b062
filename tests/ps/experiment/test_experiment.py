"""The experiment runner end to end on a tiny size: every file the issue asks for, with the
exact summary fields."""

from __future__ import annotations

import csv
import json
from dataclasses import replace
from pathlib import Path

import pytest

from bubbleguard.ps.config import ExperimentConfig, FaultPlan
from bubbleguard.ps.experiment.experiment import SUMMARY_FIELDS, run_experiment
from bubbleguard.ps.experiment.runner import SAMPLE_COLUMNS
from tests.ps.conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_experiment_writes_csv_summary_comparison_and_plots(tmp_path: Path) -> None:
    base = replace(
        small_config("stateless", num_workers=2),
        duration_s=6.0,  # a replacement took up to 3 s past the outage on a loaded machine
        faults=FaultPlan(num_kills=1, downtime_s=1.0, kill_at_s=(1.5,)),
    )
    config = ExperimentConfig(base=base, strategies=("stateless",), seeds=(0,), out_dir=str(tmp_path))
    result = run_experiment(config)

    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["strategy"] for r in summary] == ["baseline", "stateless"]
    for record in summary:
        assert tuple(record) == SUMMARY_FIELDS
        assert set(record["final_accuracy"]) == {"mean", "sd", "n"}
    stateless = summary[1]
    assert stateless["lost_updates"]["mean"] == 0
    assert stateless["recovery_s"]["mean"] >= 1.0
    assert 0 < stateless["worker_busy_during_outage"]["mean"] <= 1
    assert summary[0]["worker_busy_during_outage"]["n"] == 0  # the baseline has no outage

    with (tmp_path / "runs.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert tuple(rows[0]) == SAMPLE_COLUMNS
    assert {r["strategy"] for r in rows} == {"baseline", "stateless"}
    assert {r["server_state"] for r in rows if r["strategy"] == "stateless"} >= {"up", "down"}
    events = (tmp_path / "events.csv").read_text()
    assert "kill" in events and "recovered" in events

    comparison = json.loads((tmp_path / "comparison.json").read_text())
    assert comparison["equal_updates"] == min(r.metrics.updates_applied for r in result.runs) > 0
    for name in ("baseline", "stateless"):
        assert comparison["strategies"][name]["updates_per_s"]["mean"] > 0
    for plot in ("accuracy_vs_time.png", "accuracy_vs_updates.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_invalid_experiments_fail_before_any_run(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="distinct"):
        ExperimentConfig(base=small_config("chain"), strategies=("chain",), seeds=(1, 1), out_dir=str(tmp_path)).run_configs()
    with pytest.raises(ValueError, match="unknown strategy"):
        ExperimentConfig(base=small_config("chain"), strategies=("paxos",), seeds=(0,), out_dir=str(tmp_path)).run_configs()
