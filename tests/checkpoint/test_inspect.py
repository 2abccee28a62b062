"""Tests for checkpoint/inspect.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbleguard.checkpoint.inspect import describe_checkpoints
from bubbleguard.checkpoint.state import capture_state
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier, shm_job_dir
from tests.checkpoint.ckpt_testlib import train_step, trained_state


def test_durable_root(tmp_path: Path) -> None:
    model, opt, sched, s1 = trained_state(1)
    tier = DurableTier(tmp_path)
    tier.save(s1)
    train_step(model, opt, sched, 2)
    tier.write(capture_state(model, opt, sched, step=2))
    records = describe_checkpoints(tmp_path)
    assert [(r.tier, r.step, r.valid, r.num_ranks) for r in records] == [
        ("durable", 1, True, 1),
        ("durable", 2, False, None),
    ]
    assert records[0].size_bytes > s1.num_bytes // 2 and records[0].reason is None
    assert "no commit marker" in (records[1].reason or "")


def test_memory_job_dir(tmp_path: Path) -> None:
    model, opt, sched, s1 = trained_state(1, blocks=[0, 1])
    r0 = MemoryTier("j", 0, num_ranks=2, root=tmp_path, chunk_bytes=1024)
    r1 = MemoryTier("j", 1, num_ranks=2, root=tmp_path, chunk_bytes=1024)
    *_, other = trained_state(1, blocks=[2, 3])
    r0.write(s1)
    r1.write(other)
    r0.commit(1)
    train_step(model, opt, sched, 2)
    r0.write(capture_state(model, opt, sched, step=2))  # rank 1 never finished step 2
    with open(r0.rank_dir / "slot0.bin", "r+b") as f:  # corrupt rank 0's step 1
        f.write(b"\xff" * 8)
    records = describe_checkpoints(shm_job_dir("j", tmp_path))
    assert [(r.tier, r.step, r.valid, r.num_ranks, r.committed) for r in records] == [
        ("memory", 1, False, 2, True),
        ("memory", 2, False, 2, False),
    ]
    assert "chunk 0" in (
        records[0].reason or ""
    ) and "rank 1 has no complete snapshot of step 2" in (records[1].reason or "")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        describe_checkpoints(tmp_path / "nope")
    assert describe_checkpoints(tmp_path) == []
