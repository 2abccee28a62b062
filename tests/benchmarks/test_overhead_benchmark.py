"""The overhead benchmark runs at a tiny size and writes its results file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.benchmarks import benchlib

ROOT = Path(__file__).resolve().parents[2]
MODES = ["none", "sync", "background", "dcp-async", "bubble"]
THREAD_COUNTERS = ["cpu_s", "run_delay_s", "minor_faults", "preempted"]


@pytest.mark.timeout(240)
def test_overhead_benchmark_tiny(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "overhead.py"), "--tiny",
                           "--batch-size", "12", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "overhead.json").read_text())
    cfg = doc["config"]
    assert doc["benchmark"] == "overhead" and cfg["stages"] == 2
    assert cfg["batch_size"] == 12  # --batch-size, over the tiny size's 8
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True,
                          text=True)
    if head.returncode == 0:  # a git checkout: the results name the commit they were run from
        assert doc["code"]["commit"] == head.stdout.strip()
        assert isinstance(doc["code"]["modified"], bool)
    assert cfg["ckpt_every"] == 1 and cfg["threads_per_rank"] == 1
    assert cfg["persist_every"] == cfg["block_steps"] == 10
    assert list(doc["modes"]) == MODES
    # Switching checkpoint modes every 10 steps leaves training exactly as without checkpoints.
    assert doc["losses_equal_plain_run"] is True
    for mode, m in doc["modes"].items():
        blocks_per_round = {"none": 6, "bubble": 3}.get(mode, 1)
        assert m["num_steps"] == cfg["measured_steps_per_block"] * cfg["rounds"] * blocks_per_round
        assert m["ckpt_bubble_s"]["0"] >= 0
        assert m["step_time_s"]["p25"] <= m["step_time_s"]["median"] <= m["step_time_s"]["p75"]
        ov = m["overhead"]
        assert ov["min"] <= ov["median_of_rounds"] <= ov["max"]
        assert ov["ci95"][0] <= ov["pooled_mean"] <= ov["ci95"][1]
        assert sorted(m["ckpt_blocking_s"]) == ["0", "1"]
    # Where each mode's extra time sits in its block: per measured step, over none's.
    for mode, m in doc["modes"].items():
        if mode == "none":
            assert "excess_by_position" not in m
            continue
        excess = m["excess_by_position"]
        keys = ["step_s"] + ([f"{k}_{r}" for r in ("0", "1") for k in ("cpu_s", "run_delay_s")]
                             if os.path.exists("/proc/thread-self/schedstat") else [])
        assert sorted(excess) == sorted(keys)
        assert all(len(v) == cfg["measured_steps_per_block"] for v in excess.values())
        pooled = m["step_time_s"]["mean"] - doc["modes"]["none"]["step_time_s"]["mean"]
        assert sum(excess["step_s"]) / len(excess["step_s"]) == pytest.approx(pooled, abs=1e-9)
    assert doc["modes"]["none"]["overhead"]["per_round"] == [0.0] * cfg["rounds"]
    assert doc["modes"]["none"]["ckpt_blocking_s"] == {"0": 0.0, "1": 0.0}
    # Only bubble works inside the waits; a chunk can outlast a wait, never the work itself.
    for mode, m in doc["modes"].items():
        for rank in ("0", "1"):
            if mode == "bubble":
                assert 0 < m["ckpt_overrun_s"][rank] <= m["ckpt_bubble_s"][rank]
            else:
                assert m["ckpt_overrun_s"][rank] == m["ckpt_bubble_s"][rank] == 0.0
    assert all(doc["modes"][m]["ckpt_blocking_s"]["0"] > 0 for m in MODES[1:])
    # Every checkpointing block's persist was in durable storage, on both ranks, at its end.
    for mode in MODES[1:]:
        blocks_per_round = 3 if mode == "bubble" else 1
        n = cfg["rounds"] * blocks_per_round
        assert doc["modes"][mode]["persisted_blocks"] == {"of": n, "0": n, "1": n}, mode
    assert "persisted_blocks" not in doc["modes"]["none"]
    # Every measured step carries the training threads' scheduler counters (Linux), per rank.
    if os.path.exists("/proc/thread-self/schedstat"):
        for b in doc["blocks"]:
            for rank in ("0", "1"):
                counters = b["thread"][rank]
                assert sorted(counters) == sorted(THREAD_COUNTERS)
                assert all(len(v) == cfg["measured_steps_per_block"] for v in counters.values())
                assert all(t > 0 for t in counters["cpu_s"])
                assert all(t >= 0 for t in counters["run_delay_s"])
    assert all(b["durable_step"] == {"0": None, "1": None}
               for b in doc["blocks"] if b["mode"] == "none")
    # background and bubble persist every 10th snapshot, the block's first; sync and
    # dcp-async write every snapshot durably, so the block's last is the newest.
    for b in doc["blocks"]:
        newest = {"background": b["first_step"], "bubble": b["first_step"],
                  "sync": b["first_step"] + 9, "dcp-async": b["first_step"] + 9}.get(b["mode"])
        assert b["durable_step"] == {"0": newest, "1": newest}, b
    # A warm-up round of every mode, then "none, bubble, none, baseline" for every baseline.
    blocks = doc["blocks"]
    assert [b["mode"] for b in blocks if b["round"] == -1] == MODES
    assert [b["mode"] for b in blocks if b["round"] == 0] == [
        "none", "bubble", "none", "sync", "none", "bubble", "none", "background",
        "none", "bubble", "none", "dcp-async"]
    assert [b["first_step"] % 10 for b in blocks] == [0] * len(blocks)
    assert [b["first_step"] for b in blocks] == list(range(10, 10 * len(blocks) + 1, 10))
    bw = doc["copy_bandwidth"]
    assert bw["snapshot_bytes_per_s"] > 0 and bw["plain_copy_bytes_per_s"] > 0
    assert doc["goals"]["bubble_overhead_le_1pct"] == "undecided"  # one round, no interval


def test_the_one_percent_goal_is_decided_by_the_interval() -> None:
    overhead = benchlib.load("overhead")
    assert overhead.at_most(0.01, [0.002, 0.0099]) == "met"
    assert overhead.at_most(0.01, [0.0159, 0.022]) == "not met"
    assert overhead.at_most(0.01, [-0.005, 0.024]) == "undecided"  # a point estimate of +0.9%
    assert overhead.at_most(0.01, None) == "undecided"


@pytest.mark.timeout(300)
@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="needs /proc")
def test_overhead_benchmark_ablations_beside_a_busy_process(tmp_path: Path) -> None:
    """bubble-snapshots is bubble without persists, bubble-dcp-save bubble whose persists are
    all dcp.saves, both measured in the same run: the first writes nothing durable, the second
    replays nothing, and bubble is reported against each. The run shares the cores with a busy
    loop (--busy 1), which exists while the job runs and is gone after it."""
    assert _running_busy_loops() == []
    log = tmp_path / "log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "overhead.py"),
                                 "--tiny", "--modes", "none,bubble,bubble-snapshots,bubble-dcp-save",
                                 "--busy", "1", "--out", str(tmp_path)],
                                stdout=out, stderr=subprocess.STDOUT)
        seen = set()
        while proc.poll() is None:
            seen.update(_running_busy_loops())
            time.sleep(0.2)
    stdout = log.read_text()
    assert proc.returncode == 0, stdout[-2000:]
    assert len(seen) == 1 and _running_busy_loops() == []
    doc = json.loads((tmp_path / "overhead.json").read_text())
    assert doc["config"]["busy_processes"] == 1
    assert list(doc["modes"]) == ["none", "bubble", "bubble-snapshots", "bubble-dcp-save"]
    assert doc["losses_equal_plain_run"] is True
    assert [b["mode"] for b in doc["blocks"] if b["round"] == 0] == [
        "none", "bubble", "none", "bubble-snapshots", "none", "bubble", "none", "bubble-dcp-save"]
    for b in doc["blocks"]:
        newest = b["first_step"] if b["mode"] in ("bubble", "bubble-dcp-save") else None
        assert b["durable_step"] == {"0": newest, "1": newest}, b
        # Each block's persist finished within it (the flush at its end waits for it).
        steps = [newest] if newest is not None else []
        assert [[p[0] for p in b["persists"][r]] for r in "01"] == [steps, steps], b
    snapshots = doc["modes"]["bubble-snapshots"]
    assert snapshots["ckpt_bubble_s"]["0"] > 0 and snapshots["ckpt_blocking_s"]["0"] > 0
    # bubble's first persist (in the warm-up round) is a dcp.save and the measured ones replay
    # it; the ablation's never do.
    for rank in "01":
        bubble = doc["modes"]["bubble"]["persist_cpu_s"][rank]
        assert (bubble["count"], bubble["replayed"], bubble["median_dcp_save_s"]) == (2, 2, None)
        assert bubble["median_replayed_s"] > 0
        saving = doc["modes"]["bubble-dcp-save"]["persist_cpu_s"][rank]
        assert (saving["count"], saving["replayed"], saving["median_replayed_s"]) == (1, 0, None)
        assert saving["median_dcp_save_s"] > 0
    measured = [b for b in doc["blocks"] if b["round"] >= 0]

    def mean_step(mode: str) -> float:
        times = [t for b in measured if b["mode"] == mode for t in b["step_times_s"]]
        return sum(times) / len(times)

    cost = doc["modes"]["bubble"]["persist_cost"]
    assert cost["pooled_mean"] == pytest.approx(mean_step("bubble") / mean_step("bubble-snapshots")
                                                - 1)
    assert cost["ci95"] is None  # one round: nothing to resample
    replay = doc["modes"]["bubble"]["vs_dcp_save"]
    assert replay["pooled_mean"] == pytest.approx(mean_step("bubble")
                                                  / mean_step("bubble-dcp-save") - 1)
    assert "persist_cost" not in snapshots and "vs_dcp_save" not in snapshots
    assert "persists: bubble over bubble-snapshots" in stdout
    assert "replayed persists: bubble over bubble-dcp-save" in stdout
    assert "bubble rank 0: 2 persists, 2 replayed" in stdout


def test_overhead_benchmark_rejects_unknown_mode(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    err = benchlib.usage_error("overhead", ["--tiny", "--modes", "none,bubbel", "--out",
                                            str(tmp_path)], capsys)
    assert "unknown mode(s) bubbel" in err and "bubble-dcp-save" in err
    assert not (tmp_path / "overhead.json").exists()


def _running_busy_loops() -> list[str]:
    """Pids of processes whose command line is the benchmark's ``--busy`` loop."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"overhead.py --busy" in cmdline.read_bytes():
                found.append(cmdline.parent.name)
        except OSError:
            pass  # the process ended while we looked
    return found


def test_overhead_benchmark_rejects_negative_busy(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    err = benchlib.usage_error("overhead", ["--tiny", "--busy", "-1", "--out", str(tmp_path)],
                               capsys)
    assert "--busy must be >= 0, got -1" in err
    assert not (tmp_path / "overhead.json").exists()


@pytest.mark.parametrize(("batch_size", "message"), [
    ("10", "--batch-size 10 does not split into 1 replica(s) x 4 microbatches; use a multiple of 4"),
    ("0", "--batch-size must be >= 1, got 0"),
])
def test_overhead_benchmark_rejects_a_batch_size_the_run_cannot_use(
        tmp_path: Path, batch_size: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = benchlib.usage_error("overhead", ["--tiny", "--batch-size", batch_size, "--out",
                                            str(tmp_path)], capsys)
    assert message in err
    assert not (tmp_path / "overhead.json").exists()
