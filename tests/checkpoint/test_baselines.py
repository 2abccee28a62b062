"""The baseline modes write checkpoints that hold exactly the training state of their step.

One reference run (``--ckpt bubble``, durable every 2 steps) gives the state after steps 2, 4 and
6 and the losses of an uninterrupted run; training is deterministic and no mode perturbs it, so
each baseline's checkpoint of step k must equal the reference's bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from bubbleguard.checkpoint.baselines import TorchSaveFiles, make_baseline
from bubbleguard.checkpoint.checkpointer import CheckpointConfig, Checkpointer
from bubbleguard.checkpoint.errors import CorruptSnapshotError
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split
from bubbleguard.train import TrainConfig, run_local
from tests.checkpoint.ckpt_testlib import assert_same_tensors

MODEL = {"d_model": 32, "num_layers": 2}


def _train(tmp: Path, name: str, mode: str, steps: int, **kw: Any) -> list[dict[str, Any]]:
    """A 2-stage run; returns its metrics lines."""
    metrics = tmp / f"{name}.jsonl"
    cfg = TrainConfig(stages=2, microbatches=2, batch_size=4, steps=steps, model_options=MODEL,
                      run_dir=str(tmp / f"run-{name}"), metrics=str(metrics), progress=False,
                      ckpt=mode, ckpt_dir=str(tmp / name), **kw)
    saved = dict(os.environ)
    try:
        run_local(cfg)
    finally:
        # launch_local sets OMP_NUM_THREADS (and more) in this process; later tests that spawn
        # children and compare their floats with this process's would see other thread counts.
        os.environ.clear()
        os.environ.update(saved)
    return [json.loads(line) for line in metrics.read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("baselines")
    # Every due persist is needed as a reference: short steps outrun the helper.
    _train(tmp, "reference", "bubble", 6, persist_every=2, persist_when_busy="wait")
    _train(tmp, "sync", "sync", 4, keep_last=2)
    _train(tmp, "background", "background", 4, persist_every=2)
    _train(tmp, "dcp-async", "dcp-async", 4, ckpt_every=2)
    return tmp


def _reference(runs: Path, step: int, rank: int) -> StageState:
    return DurableTier(runs / "reference").read(step, rank=rank)


def _assert_equal_stage_states(got: StageState, want: StageState) -> None:
    """``got`` (one stage's part) equals the same tensors and metadata of ``want``."""
    assert got.step == want.step
    assert got.tensors and set(got.tensors) <= set(want.tensors)
    assert_same_tensors(dict(got.tensors), {k: want.tensors[k] for k in got.tensors})
    assert_same_tensors(dict(got.local_tensors), dict(want.local_tensors))
    assert _seeded(got.metadata) == _seeded(want.metadata)


def _seeded(metadata: Any) -> dict[str, Any]:
    """Metadata without the Python and NumPy RNG states: ``bubbleguard train`` seeds only torch,
    so those two differ between separate runs (a resume restores them, which is what counts)."""
    return {k: v for k, v in metadata.items()
            if k not in ("python_random", "numpy_random", "optimizer")}


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_files_hold_the_state_of_their_step(runs: Path) -> None:
    for rank in (0, 1):
        files = TorchSaveFiles(str(runs / "sync"), rank, 2, create=False)
        assert files.steps() == [4, 3]  # keep_last=2
        _assert_equal_stage_states(files.read(4), _reference(runs, 4, rank))
    # the two stages hold disjoint whole-model FQNs that together make the whole model
    parts = [set(TorchSaveFiles(str(runs / "sync"), r, 2, create=False).read(4).tensors)
             for r in (0, 1)]
    assert not parts[0] & parts[1]
    assert parts[0] | parts[1] == set(_reference(runs, 4, 0).tensors)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode,steps", [("background", [2, 4]), ("dcp-async", [2, 4])])
def test_durable_checkpoints_of_background_and_dcp_async_hold_their_step(
        runs: Path, mode: str, steps: list[int]) -> None:
    durable = DurableTier(runs / mode)
    assert [i.step for i in durable.checkpoints() if i.committed] == steps
    for step in steps:
        for rank in (0, 1):
            got, want = durable.read(step, rank=rank), _reference(runs, step, rank)
            assert_same_tensors(dict(got.tensors), dict(want.tensors))
            assert_same_tensors(dict(got.local_tensors), dict(want.local_tensors))
            assert _seeded(got.metadata) == _seeded(want.metadata)
            assert got.metadata["optimizer"] == want.metadata["optimizer"]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_sync_resume_skips_a_corrupt_newest_file_and_continues_identically(
        runs: Path, capfd: pytest.CaptureFixture[str]) -> None:
    # Rank 1's step-4 file is damaged: step 3 is the newest step both ranks hold intact.
    shutil.copytree(runs / "sync", runs / "sync-resumed")
    damaged = TorchSaveFiles(str(runs / "sync-resumed"), 1, 2, create=False).path(4)
    damaged.write_bytes(damaged.read_bytes()[:1000])
    reference = [r["loss"] for r in
                 (json.loads(line) for line in (runs / "reference.jsonl").read_text().splitlines())]
    lines = _train(runs, "sync-resumed", "sync", 6, keep_last=2, resume=True)
    assert f"sync checkpoint {damaged} is unreadable" in capfd.readouterr().err  # rank 1 says so
    assert [r["step"] for r in lines[-3:]] == [4, 5, 6]
    assert lines[-3]["resumed_from"] == {"step": 3, "tier": "torchsave"}
    assert [r["loss"] for r in lines[-3:]] == reference[3:]


def test_torchsave_files_refuse_urls_and_unusable_directories(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--ckpt-dir must be a local path, got 's3://b/run'"):
        TorchSaveFiles("s3://b/run", 0, 1)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(NotADirectoryError, match="cannot create the sync checkpoint directory "
                                                 f"{blocker}/torchsave"):
        TorchSaveFiles(str(blocker), 0, 1)


def test_torchsave_files_of_another_layout_or_format_are_not_used(tmp_path: Path) -> None:
    state = StageState(step=7, tensors={"w": torch.arange(4.0)},
                       local_tensors={"rng.torch": torch.get_rng_state()}, metadata={"step": 7})
    TorchSaveFiles(str(tmp_path), 0, 2).write(state)
    assert TorchSaveFiles(str(tmp_path), 0, 1, create=False).steps() == []  # 1 rank != 2
    files = TorchSaveFiles(str(tmp_path), 0, 2, create=False)
    back = files.read(7)
    assert_same_tensors(dict(back.tensors), dict(state.tensors))
    assert back.metadata == {"step": 7}
    torch.save({"format": "something-else", "step": 8}, files.path(8))
    with pytest.raises(CorruptSnapshotError, match="step-00000008.pt is unreadable"):
        files.read(8)
    with pytest.raises(FileNotFoundError, match=r"this rank holds \[8, 7\]"):
        files.read(9)


def test_keep_last_keeps_at_least_two_files(tmp_path: Path) -> None:
    files = TorchSaveFiles(str(tmp_path), 0, 1, keep_last=1)
    for step in range(1, 5):
        files.write(StageState(step=step, tensors={"w": torch.full((2,), float(step))}))
    assert files.steps() == [4, 3]


def test_make_baseline_names_the_baselines(tmp_path: Path) -> None:
    model = build_model("gpt", seed=0, **MODEL)
    stage = split(model, 1, 0)
    job = PipelineJob(stage, torch.optim.AdamW(stage.parameters()), lm_loss)
    ckpt = Checkpointer(job, CheckpointConfig(mode="bubble", ckpt_dir=str(tmp_path / "c"),
                                              shm_root=str(tmp_path)))
    try:
        with pytest.raises(ValueError, match="no baseline named 'bubble'; the baselines are "
                                             "sync, background, dcp-async"):
            make_baseline(ckpt)
    finally:
        ckpt.close()
