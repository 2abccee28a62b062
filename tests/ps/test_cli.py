"""Tests for bubbleguard.ps.cli: flags, bad input before Ray starts, and a real tiny run."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bubbleguard.ps.cli import add_ps_parser, config_from_args, run_ps_command


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bubbleguard")
    add_ps_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["ps", *argv])


def test_experiment_flags_map_onto_the_configuration() -> None:
    args = parse(
        "experiment", "--strategies", "checkpoint,chain,stateless", "--consistency", "bounded", "--staleness", "3",
        "--workers", "5", "--kills", "2", "--downtime", "4", "--seeds", "3", "--duration", "60", "--out", "x",
        "--replicate-every", "100", "--policy", "mean", "--lr", "0.01", "--batch-size", "16",
    )
    assert args.strategies == ("checkpoint", "chain", "stateless") and args.seeds == (0, 1, 2)
    config = config_from_args(args, strategy="chain", seed=2)
    config.validate()
    assert config.consistency.bound == 3 and config.training.num_workers == 5
    assert config.faults.kill_times(60.0) == (20.0, 40.0)
    assert config.chain.replicate_every == 100 and config.stateless.policy == "mean"
    assert (config.training.lr, config.training.batch_size, config.training.seed) == (0.01, 16, 2)
    assert parse("experiment", "--seeds", "4,7").seeds == (4, 7)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["experiment", "--strategies", "checkpoint,gossip"], "unknown strategy 'gossip'"),
        (["run", "--consistency", "bounded", "--staleness", "-2"], "staleness must be >= 0"),
        (["run", "--kills", "4", "--downtime", "10", "--duration", "30"], "do not fit in 30 s"),
        (["run", "--dataset", "npz:/no/such.npz"], "does not exist"),
        (["run", "--dataset", "imagenet"], "unknown data set"),
    ],
)
def test_bad_input_is_an_error_before_ray_starts(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert run_ps_command(parse(*argv)) == 2
    assert message in capsys.readouterr().err


def test_unknown_consistency_is_rejected_by_the_parser() -> None:
    with pytest.raises(SystemExit):
        parse("run", "--consistency", "causal")


def test_bad_input_exits_fast_without_starting_ray(tmp_path: Path) -> None:
    script = (
        "import argparse, sys\n"
        "from bubbleguard.ps.cli import add_ps_parser, run_ps_command\n"
        "p = argparse.ArgumentParser(); add_ps_parser(p.add_subparsers(dest='c'))\n"
        "rc = run_ps_command(p.parse_args(sys.argv[1:]))\n"
        "assert 'ray' not in sys.modules, 'Ray was imported'\n"
        "sys.exit(rc)\n"
    )
    start = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", script, "ps", "experiment", "--kills", "9", "--duration", "10"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 2, proc.stderr
    assert "do not fit" in proc.stderr and time.time() - start < 30


@pytest.mark.slow
@pytest.mark.usefixtures("ray_cluster")
def test_ps_run_trains_shows_progress_and_writes_results(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = parse(
        "run", "--strategy", "chain", "--workers", "2", "--duration", "3", "--kills", "1", "--downtime", "0.5",
        "--eval-every", "0.5", "--out", str(tmp_path),
    )
    assert run_ps_command(args) == 0
    out = capsys.readouterr().out
    assert "updates=" in out and "kill" in out and "recovered" in out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["strategy"] == "chain" and summary[0]["lost_updates"]["mean"] == 0
    assert (tmp_path / "runs.csv").exists() and (tmp_path / "events.csv").exists()
