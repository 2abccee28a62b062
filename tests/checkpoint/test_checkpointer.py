"""The Checkpointer in one process, without torch.distributed: snapshot, persist, resume."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bubbleguard.checkpoint.checkpointer import BubbleStrategy, CheckpointConfig, Checkpointer
from bubbleguard.checkpoint.layout import DEFAULT_CHUNK_BYTES
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split
from tests.checkpoint.ckpt_testlib import Cursor, train_job


def _job() -> PipelineJob:
    stage = split(build_model("mlp", seed=1), 1, 0)
    return PipelineJob(stage, torch.optim.AdamW(stage.parameters(), lr=1e-2), lm_loss,
                       num_microbatches=2)


def test_single_process_resume_continues_bit_identically(tmp_path: Path) -> None:
    reference = train_job(_job(), Cursor(), 0, 6)
    (tmp_path / "shm").mkdir()
    config = CheckpointConfig(mode="bubble", ckpt_dir=str(tmp_path / "ckpt"), persist_every=2,
                              shm_root=str(tmp_path / "shm"))
    job, cursor = _job(), Cursor()
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    assert ckpt.resume(cursor.load_state_dict).step == 0
    first = train_job(job, cursor, 0, 4)
    ckpt.close()
    # The newest step is durable, so the job's shared memory is gone, commit marker included.
    assert [p.name for p in (tmp_path / "shm").glob("*/*")] == []

    job, cursor = _job(), Cursor()
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    info = ckpt.resume(cursor.load_state_dict)
    assert (info.step, info.tier) == (4, "durable")
    assert cursor.index == 4
    second = train_job(job, cursor, 4, 6)
    ckpt.close()
    assert first + second == reference


def test_bad_configurations_name_the_problem() -> None:
    with pytest.raises(ValueError, match="unknown checkpoint mode 'fast'"):
        CheckpointConfig(mode="fast", ckpt_dir="x")
    with pytest.raises(ValueError, match="needs --ckpt-dir"):
        CheckpointConfig(mode="bubble")
    with pytest.raises(ValueError, match="--ckpt-every must be >= 1"):
        CheckpointConfig(ckpt_dir="x", every=0)
    with pytest.raises(ValueError, match="chunk_bytes must be a positive multiple of 64, got 100"):
        CheckpointConfig(ckpt_dir="x", chunk_bytes=100)
    with pytest.raises(ValueError, match="--persist-when-busy must be 'skip' or 'wait', got 'queue'"):
        CheckpointConfig(ckpt_dir="x", persist_when_busy="queue")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("mode", "durable_step"), [
    ("bubble", 2),      # the persist of step 2 was due (every 2), snapshot 3 is in memory
    ("background", 2),  # the same, from its threads
    ("dcp-async", 3),   # every snapshot is a durable save
])
def test_flush_finishes_the_snapshot_and_the_due_persist(tmp_path: Path, mode: str,
                                                         durable_step: int) -> None:
    from bubbleguard.checkpoint.tiers.durable import DurableTier

    reference = train_job(_job(), Cursor(), 0, 5)
    (tmp_path / "shm").mkdir()
    config = CheckpointConfig(mode=mode, ckpt_dir=str(tmp_path / "ckpt"), persist_every=2,
                              shm_root=str(tmp_path / "shm"))
    job, cursor = _job(), Cursor()
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    losses = train_job(job, cursor, 0, 3)
    ckpt.flush()
    assert DurableTier(tmp_path / "ckpt").latest() == durable_step
    if mode == "bubble":
        assert ckpt.memory is not None and ckpt.memory.chunk_bytes == DEFAULT_CHUNK_BYTES  # CPU
        # Three slots: the newest snapshot, the one before, and one more.
        assert ckpt.memory is not None and ckpt.memory.valid_steps() == [3, 2, 1]
    losses += train_job(job, cursor, 3, 5)  # training goes on after a flush, unchanged
    ckpt.close()
    assert losses == reference


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuse_layout", [True, False])
def test_bubble_persists_replay_the_first_one_unless_told_not_to(tmp_path: Path,
                                                                 reuse_layout: bool) -> None:
    from bubbleguard.checkpoint.tiers.durable import DurableTier

    (tmp_path / "shm").mkdir()
    config = CheckpointConfig(mode="bubble", ckpt_dir=str(tmp_path / "ckpt"), persist_every=1,
                              keep_last=5, shm_root=str(tmp_path / "shm"),
                              reuse_layout=reuse_layout)
    job, cursor = _job(), Cursor()
    ckpt = Checkpointer(job, config, data_state=cursor.state_dict)
    # The helper is up before training starts, so the first persist need not wait for it.
    assert isinstance(ckpt.strategy, BubbleStrategy) and ckpt.strategy.persister.ready
    for stop in (1, 2, 3):
        train_job(job, cursor, stop - 1, stop)
        ckpt.flush()  # this step's persist is written before the next one is due
    results = ckpt.persist_results()
    assert results is not None
    assert [(r.step, r.persisted, r.replayed) for r in results] == [
        (1, True, False), (2, True, reuse_layout), (3, True, reuse_layout)]
    durable, memory = DurableTier(tmp_path / "ckpt"), ckpt.memory
    assert memory is not None
    for step in (1, 2, 3):  # the helper wrote exactly the snapshot, either way
        snapshot = memory.read(step)
        written = durable.read(step)
        for name, t in snapshot.tensors.items():
            assert torch.equal(written.tensors[name], t), (step, name)
    ckpt.close()
