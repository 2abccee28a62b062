"""Stop, kill and resume real training runs; the resumed losses equal the uninterrupted run's.

Every run goes through torchrun's machinery (``run_local``) with real gloo ranks, real shared
memory and real DCP files. Deterministic settings make "equal" mean bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from bubbleguard.cli.main import main
from bubbleguard.elastic.launcher import LaunchError
from bubbleguard.train import TrainConfig, run_local
from tests.checkpoint.ckpt_testlib import read_only_dir

pytestmark = pytest.mark.timeout(240)

BASE = TrainConfig(model="gpt", stages=2, microbatches=2, batch_size=8, steps=8,
                   model_options={"d_model": 32, "num_heads": 2}, progress=False)


def _losses(metrics: Path) -> dict[int, float]:
    """Loss per step; a step run again after a restart keeps its last value."""
    out = {}
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        out[rec["step"]] = rec["loss"]
    return out


def _resumed_from(metrics: Path) -> list[dict[str, object]]:
    return [json.loads(line)["resumed_from"] for line in metrics.read_text().splitlines()
            if "resumed_from" in json.loads(line)]


def _run(tmp: Path, name: str, **changes: object) -> tuple[Path, dict]:
    metrics = tmp / f"{name}.jsonl"
    cfg = dataclasses.replace(BASE, metrics=str(metrics), run_dir=str(tmp / f"run-{name}"),
                              **changes)  # type: ignore[arg-type]
    result = run_local(cfg)
    return metrics, {"loss": result.final_loss}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """Losses of the uninterrupted 8-step run without checkpoints."""
    tmp = tmp_path_factory.mktemp("reference")
    metrics, _ = _run(tmp, "ref")
    return _losses(metrics)


def test_stopped_and_resumed_run_is_bit_identical(tmp_path: Path,
                                                  reference: dict[int, float]) -> None:
    ckpt = str(tmp_path / "ckpt")
    first, _ = _run(tmp_path, "a", steps=4, ckpt="bubble", ckpt_dir=ckpt, persist_every=2)
    second, _ = _run(tmp_path, "b", ckpt="bubble", ckpt_dir=ckpt, persist_every=2, resume=True)
    assert _resumed_from(second) == [{"step": 4, "tier": "durable"}]
    losses = {**_losses(first), **_losses(second)}
    assert losses == reference  # exact float equality: bit-identical


@pytest.mark.parametrize("fault,resumed_step", [("1:6:before", 4), ("0:6:after", 5)])
def test_killed_rank_is_restarted_and_resumes_from_shared_memory(
        tmp_path: Path, reference: dict[int, float], fault: str, resumed_step: int) -> None:
    # Killed before step 6: neither rank finished the snapshot of step 5 (it completes just
    # before optimizer step 6), so 4 is the newest step both hold. Killed after step 6: the
    # snapshot of 6 is unfinished, 5 is complete on both. No durable checkpoint exists
    # (--persist-every 0), so the step can only come from the memory tier.
    metrics, _ = _run(tmp_path, "f", ckpt="bubble", ckpt_dir=str(tmp_path / "ckpt"),
                      persist_every=0, fault=fault, max_restarts=1)
    assert _resumed_from(metrics) == [{"step": resumed_step, "tier": "memory"}]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps.count(resumed_step + 1) == 2 and steps.count(resumed_step) == 1
    assert _losses(metrics) == reference


def test_checkpoint_loads_into_a_different_number_of_stages(
        tmp_path: Path, reference: dict[int, float]) -> None:
    ckpt = str(tmp_path / "ckpt")
    first, _ = _run(tmp_path, "a", steps=4, ckpt="bubble", ckpt_dir=ckpt, persist_every=4)
    second, _ = _run(tmp_path, "b", stages=4, ckpt="bubble", ckpt_dir=ckpt, resume=True)
    assert _resumed_from(second) == [{"step": 4, "tier": "durable"}]
    losses = {**_losses(first), **_losses(second)}
    assert losses.keys() == reference.keys()
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=1e-6, abs=1e-7)


def test_checkpoint_of_another_model_names_the_parameters(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    _run(tmp_path, "a", steps=2, ckpt="bubble", ckpt_dir=ckpt)
    # Rank 1 (the last stage) needs blocks 4 and 5, which the 4-layer checkpoint lacks. Its
    # error is named first, whichever rank's process torchrun noticed ending first.
    with pytest.raises(LaunchError, match=r"^training failed: rank 1: StateMismatchError: "
                                          r"checkpoint of step 2 .*'blocks\.4\."):
        _run(tmp_path, "b", steps=4, ckpt="bubble", ckpt_dir=ckpt, resume=True,
             model_options={"d_model": 32, "num_heads": 2, "num_layers": 6})


def test_resume_without_a_checkpoint_directory_is_refused(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["train", "--ckpt", "bubble", "--ckpt-dir", str(missing), "--resume"]) == 2
    assert f"--resume: checkpoint directory {missing} does not exist" in capsys.readouterr().err


def test_read_only_checkpoint_directory_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    with read_only_dir(tmp_path / "ro") as ro:
        assert main(["train", "--ckpt", "bubble", "--ckpt-dir", str(ro)]) == 2
        assert f"checkpoint directory {ro} is not writable" in capsys.readouterr().err
