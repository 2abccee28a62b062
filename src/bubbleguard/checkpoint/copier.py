"""Snapshot copies as bubble work: one chunk per call, from inside a stage's waits.

:class:`SnapshotCopier` fits the pipeline runtime's ``IdleWork`` protocol (``run_one() -> bool``)
structurally, so this module does not import the pipeline. Call order on each rank::

    copier = SnapshotCopier(memory_tier)
    # after optimizer.step() k:
    copier.start(capture_state(stage, opt, sched, step=k, data_cursor=cursor))
    # iteration k+1: the runtime calls copier.run_one() while it waits on a receive
    # just before optimizer.step() k+1:
    report = copier.finish()     # copies what is left (blocking), writes the record
    # report.blocking_s -> metrics (ckpt_blocking_s); copier.bandwidth_bytes_per_s -> planner

Chunks are copied in id order. One chunk is the most a copy can overrun the end of a wait, so
``chunk_bytes`` bounds the delay a copy can add (4 MiB at ~15 GB/s is ~0.3 ms).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from bubbleguard.checkpoint.layout import ChunkLayout
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.shm import MemoryTier, SnapshotRecord


@dataclass(frozen=True)
class CopyReport:
    """What one snapshot cost.

    Attributes:
        record: the memory tier's record of the finished snapshot.
        num_chunks_in_bubbles: chunks copied by ``run_one`` (inside waits).
        num_chunks_blocking: chunks ``finish`` had to copy.
        bubble_s: time spent copying inside waits.
        blocking_s: time ``finish`` took (copies, checksums, record): checkpoint overhead.
    """

    record: SnapshotRecord
    num_chunks_in_bubbles: int
    num_chunks_blocking: int
    bubble_s: float
    blocking_s: float


class SnapshotCopier:
    """Drives a :class:`MemoryTier` snapshot one chunk per ``run_one`` call."""

    def __init__(self, tier: MemoryTier) -> None:
        self.tier = tier
        self._pending: list[int] = []
        self._in_bubbles = 0
        self._bubble_s = 0.0
        self._copied_bytes = 0
        self._copy_s = 0.0

    def start(self, state: StageState) -> ChunkLayout:
        """Begin the snapshot of ``state.step`` (right after ``optimizer.step()``)."""
        layout = self.tier.begin(state)
        self._pending = list(range(layout.num_chunks))
        self._pending.reverse()  # pop() from the end yields ids in ascending order
        self._in_bubbles = 0
        self._bubble_s = 0.0
        return layout

    def run_one(self) -> bool:
        """Copy the next chunk; False when there is nothing (left) to copy."""
        if not self._pending:
            return False
        chunk_id = self._pending.pop()
        t0 = time.perf_counter()
        n = self.tier.copy_chunk(chunk_id)
        dt = time.perf_counter() - t0
        self._bubble_s += dt
        self._in_bubbles += 1
        self._copied_bytes += n
        self._copy_s += dt
        return True

    def finish(self) -> CopyReport:
        """Copy the rest and write the record (before ``optimizer.step()``); blocking."""
        blocking = len(self._pending)
        self._pending = []
        t0 = time.perf_counter()
        record = self.tier.finish()
        return CopyReport(
            record, self._in_bubbles, blocking, self._bubble_s, time.perf_counter() - t0
        )

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Measured copy bandwidth of ``run_one`` so far (copy + checksum), or None."""
        return self._copied_bytes / self._copy_s if self._copy_s > 0 else None
