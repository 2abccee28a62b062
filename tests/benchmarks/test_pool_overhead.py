"""Pooling overhead runs: the same arithmetic as one run over all rounds, and only like runs."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.benchmarks import benchlib

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
# Two 20-round runs of Dec 5 with the same configuration, and one without persists.
RUN_A = RESULTS / "overhead_none_bubble_r20_new1.json"
RUN_B = RESULTS / "overhead_none_bubble_r20_new2.json"
NO_PERSIST = RESULTS / "overhead_none_bubble_r20_no_persist_before.json"


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def _with_code(doc: dict[str, Any], commit: str, modified: bool = False) -> dict[str, Any]:
    return {**doc, "code": {"commit": commit, "modified": modified}}


def test_pooled_overhead_is_the_ratio_of_all_rounds_step_means() -> None:
    pool = benchlib.load("pool_overhead")
    a, b = _load(RUN_A), _load(RUN_B)
    doc = pool.pool({"a": a, "b": b}, assume_same_code=True)
    assert doc["rounds"] == 40 and [r["rounds"] for r in doc["runs"]] == [20, 20]

    def times(mode: str) -> list[float]:
        return [t for d in (a, b) for blk in d["blocks"]
                if blk["round"] >= 0 and blk["mode"] == mode for t in blk["step_times_s"]]

    expected = statistics.fmean(times("bubble")) / statistics.fmean(times("none")) - 1
    assert doc["bubble_overhead"] == pytest.approx(expected, rel=1e-12)
    low, high = doc["bubble_overhead_ci95"]
    assert low < doc["bubble_overhead"] < high
    # Every round of both runs is there, in order: a's rounds, then b's.
    per_round = doc["modes"]["bubble"]["overhead"]["per_round"]
    assert per_round == (a["modes"]["bubble"]["overhead"]["per_round"]
                         + b["modes"]["bubble"]["overhead"]["per_round"])
    assert doc["modes"]["bubble"]["persisted_blocks"]["of"] == 40


def test_a_run_pooled_with_itself_keeps_its_estimate() -> None:
    pool = benchlib.load("pool_overhead")
    a = _with_code(_load(RUN_A), "c0ffee")
    doc = pool.pool({"a": a, "again": copy.deepcopy(a)})
    assert doc["bubble_overhead"] == pytest.approx(a["modes"]["bubble"]["overhead"]["pooled_mean"],
                                                   rel=1e-12)
    assert doc["assumed_same_code"] is False


def test_runs_of_other_code_or_settings_are_refused() -> None:
    pool = benchlib.load("pool_overhead")
    a, b = _load(RUN_A), _load(RUN_B)
    with pytest.raises(pool.PoolError, match="does not record the commit"):
        pool.pool({"a": a, "b": b})
    with pytest.raises(pool.PoolError, match="different commits"):
        pool.pool({"a": _with_code(a, "c0ffee"), "b": _with_code(b, "beef")})
    with pytest.raises(pool.PoolError, match="b ran from a modified checkout"):
        pool.pool({"a": _with_code(a, "c0ffee"), "b": _with_code(b, "c0ffee", modified=True)})
    # Settings are checked even when the code is taken as the same: persists every 10 vs none.
    with pytest.raises(pool.PoolError, match="nop was run with another configuration"):
        pool.pool({"a": a, "nop": _load(NO_PERSIST)}, assume_same_code=True)
    with pytest.raises(pool.PoolError, match="at least two runs"):
        pool.pool({"a": a})


def test_cli_writes_the_pooled_file_and_names_a_missing_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pool = benchlib.load("pool_overhead")
    out = tmp_path / "pooled.json"
    pool.main([str(RUN_A), str(RUN_B), "--assume-same-code", "--out", str(out)])
    printed = capsys.readouterr().out
    doc = _load(out)
    assert doc["benchmark"] == "overhead-pooled" and doc["rounds"] == 40
    assert f"pooled, 40 rounds: bubble overhead {doc['bubble_overhead']:+.2%}" in printed
    err = benchlib.usage_error("pool_overhead", [str(RUN_A), str(tmp_path / "gone.json"),
                                                 "--out", str(out)], capsys)
    assert f"no such result file: {tmp_path / 'gone.json'}" in err
    err = benchlib.usage_error("pool_overhead", [str(RUN_A), str(RUN_B), "--out", str(out)],
                               capsys)
    assert "does not record the commit" in err
