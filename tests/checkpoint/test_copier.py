"""Tests for checkpoint/copier.py: chunks copied as idle work, the rest at finish."""

from __future__ import annotations

from pathlib import Path

from bubbleguard.checkpoint.copier import SnapshotCopier
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from tests.checkpoint.ckpt_testlib import assert_same_state, trained_state


def test_run_one_copies_chunks_in_order_and_finish_does_the_rest(tmp_path: Path) -> None:
    *_, state = trained_state(2)
    tier = MemoryTier("c", 0, root=tmp_path, chunk_bytes=1024)
    copier = SnapshotCopier(tier)
    layout = copier.start(state)
    assert copier.run_one() and copier.run_one()
    assert tier.pending_chunks() == list(range(2, layout.num_chunks))
    report = copier.finish()
    assert (report.num_chunks_in_bubbles, report.num_chunks_blocking) == (2, layout.num_chunks - 2)
    assert report.record.step == 2 and report.blocking_s > 0
    assert copier.bandwidth_bytes_per_s is not None and copier.bandwidth_bytes_per_s > 0
    assert not copier.run_one()  # nothing until the next start
    assert_same_state(tier.read(2), state)


def test_everything_in_bubbles_leaves_nothing_blocking(tmp_path: Path) -> None:
    *_, state = trained_state(1)
    copier = SnapshotCopier(MemoryTier("c", 0, root=tmp_path, chunk_bytes=1024))
    layout = copier.start(state)
    while copier.run_one():
        pass
    report = copier.finish()
    assert report.num_chunks_in_bubbles == layout.num_chunks and report.num_chunks_blocking == 0



def test_deferred_start_captures_in_the_first_bubble_and_the_record_follows_the_last_chunk(
        tmp_path: Path) -> None:
    *_, state = trained_state(2)
    tier = MemoryTier("c", 0, root=tmp_path, chunk_bytes=1024)
    copier = SnapshotCopier(tier)
    calls: list[int] = []

    def capture() -> StageState:
        calls.append(1)
        return state

    assert not copier.has_work()
    assert copier.start(capture) is None and calls == [] and tier.active_step is None
    # has_work() says whether run_one() has something to do; the runtime asks it at every wait.
    assert copier.has_work()
    assert copier.run_one() and calls == [1] and tier.active_step == 2  # capture + begin
    num_chunks = len(tier.pending_chunks())
    assert num_chunks > 1 and tier.pending_chunks() == list(range(num_chunks))
    for _ in range(num_chunks):
        assert copier.has_work()
        assert copier.run_one() and tier.steps() == []
    assert copier.take_report() is None  # all copied, no record yet
    assert copier.has_work()
    assert copier.run_one() and tier.steps() == [2]  # the record, still inside the bubble
    assert not copier.has_work()
    assert not copier.run_one()
    report = copier.take_report()
    assert report is not None and report.num_chunks_in_bubbles == num_chunks
    assert copier.take_report() is None and copier.finish() is report  # nothing left to block
    assert_same_state(tier.read(2), state)


def test_without_bubbles_finish_captures_begins_and_copies_everything(tmp_path: Path) -> None:
    *_, state = trained_state(2)
    copier = SnapshotCopier(MemoryTier("c", 0, root=tmp_path, chunk_bytes=1024))
    copier.start(lambda: state)
    report = copier.finish()
    assert report.num_chunks_in_bubbles == 0
    assert report.num_chunks_blocking == report.record.layout.num_chunks > 1
    assert copier.take_report() is report and copier.take_report() is None
