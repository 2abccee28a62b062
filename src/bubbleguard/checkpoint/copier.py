"""Snapshot copies as bubble work: one chunk per call, from inside a stage's waits.

:class:`SnapshotCopier` fits the pipeline runtime's ``IdleWork`` protocol (``run_one() -> bool``)
structurally, so this module does not import the pipeline. Call order on each rank::

    copier = SnapshotCopier(memory_tier)
    # after optimizer.step() k:
    copier.start(capture_state(stage, opt, sched, step=k, data_cursor=cursor))
    #   or, to leave the step boundary at once: copier.start(begin_capture(...).complete)
    # iteration k+1: the runtime calls copier.run_one() while it waits on a receive
    # just before optimizer.step() k+1:
    report = copier.finish()     # copies what is left (blocking), writes the record
    # report.blocking_s -> metrics (ckpt_blocking_s); copier.bandwidth_bytes_per_s -> planner

Given a callable, ``start`` only stores it: the first ``run_one`` (or ``finish``) calls it and
begins the snapshot, so that capture and ``MemoryTier.begin`` run in a bubble rather than at the
step boundary. Chunks are copied in id order; the ``run_one`` after the last chunk writes the
record, so when the bubbles hold the whole snapshot it is complete before ``finish``, which then
returns the report at once. One chunk is the most a copy can overrun the end of a wait, so
``chunk_bytes`` bounds the delay a copy can add (4 MiB at ~10 GB/s is ~0.4 ms).

A snapshot of CUDA tensors (``MemoryTier.copies_async``) goes differently, because its copies are
not CPU work: each ``run_one`` queues chunks on the tier's side stream for up to
:data:`QUEUE_SLICE_S` (the copy engine runs them alongside compute), then one ``run_one``
completes every chunk's checksum once the copies have landed, then one writes the record. The
runtime runs these units alongside compute on a GPU (see ``PipelineJob``), not only inside
waits.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bubbleguard.checkpoint.layout import ChunkLayout
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.shm import MemoryTier, SnapshotRecord

QUEUE_SLICE_S = 0.001
"""Device snapshots: how long one ``run_one`` keeps queuing chunks (launches cost the CPU a few
microseconds each; the copies themselves run on the copy engine)."""


@dataclass(frozen=True)
class CopyReport:
    """What one snapshot cost.

    Attributes:
        record: the memory tier's record of the finished snapshot.
        num_chunks_in_bubbles: chunks copied by ``run_one`` (inside waits).
        num_chunks_blocking: chunks ``finish`` had to copy.
        bubble_s: time spent in ``run_one`` on this snapshot (capture, begin, copies, record).
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
        self._deferred: Callable[[], StageState] | None = None
        self._report: CopyReport | None = None
        self._delivered = False
        self._in_bubbles = 0
        self._bubble_s = 0.0
        self._copied_bytes = 0
        self._copy_s = 0.0
        self._after: Any = None
        self._num_chunks = 0

    def start(self, state: StageState | Callable[[], StageState], *,
              after: Any = None) -> ChunkLayout | None:
        """Begin the snapshot (right after ``optimizer.step()``).

        Args:
            state: the state, or a callable that returns it (called by the first ``run_one``,
                or by ``finish`` if no bubble comes first).
            after: for CUDA state, the event recorded right after the step (see
                ``MemoryTier.begin``); None on the CPU.

        Returns:
            The layout, or None when the begin is deferred.
        """
        self._in_bubbles = 0
        self._bubble_s = 0.0
        self._report = None
        self._delivered = False
        self._after = after
        if callable(state):
            self._deferred = state
            self._pending = []
            return None
        self._deferred = None
        return self._begin(state)

    def _begin(self, state: StageState) -> ChunkLayout:
        layout = self.tier.begin(state, after=self._after)
        self._after = None
        self._num_chunks = layout.num_chunks
        self._pending = list(range(layout.num_chunks))
        self._pending.reverse()  # pop() from the end yields ids in ascending order
        return layout

    def has_work(self) -> bool:
        """Whether :meth:`run_one` would do something (begin, a chunk or the record)."""
        return (self._deferred is not None or bool(self._pending)
                or (self.tier.active_step is not None and self._report is None))

    def run_one(self) -> bool:
        """Do the next unit of the snapshot: begin, one chunk, or the record at the end.

        Returns:
            False when there is nothing (left) to do, or nothing *yet*: device copies still
            in flight (then :meth:`has_work` stays True).
        """
        t0 = time.perf_counter()
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._begin(deferred())
            self._bubble_s += time.perf_counter() - t0
            return True
        if self._pending and self.tier.copies_async:
            # Queued on the device's side stream, not copied here: as many chunks as fit in
            # QUEUE_SLICE_S, so the copy engine soon has the snapshot to work on while compute
            # goes on, and a pause never waits for the launches of a whole snapshot.
            while self._pending:
                self.tier.copy_chunk(self._pending.pop())
                self._in_bubbles += 1
                if time.perf_counter() - t0 >= QUEUE_SLICE_S:
                    break
            self._bubble_s += time.perf_counter() - t0
            return True
        if self._pending:
            n = self.tier.copy_chunk(self._pending.pop())
            dt = time.perf_counter() - t0
            self._bubble_s += dt
            self._in_bubbles += 1
            self._copied_bytes += n
            self._copy_s += dt
            return True
        if self.tier.copies_in_flight:  # device copies: every chunk's checksum, once landed
            if not self.tier.checksum_landed(wait=False):
                return False  # not landed yet; has_work() stays True
            self._bubble_s += time.perf_counter() - t0
            return True
        if self.tier.active_step is not None and self._report is None:
            record = self.tier.finish()  # every chunk is in: only the record is left
            self._bubble_s += time.perf_counter() - t0
            self._report = CopyReport(record, self._in_bubbles, 0, self._bubble_s, 0.0)
            return True
        return False

    def finish(self) -> CopyReport:
        """Copy the rest and write the record (before ``optimizer.step()``); blocking.

        If the bubbles already completed the snapshot, returns its report at once.

        Raises:
            RuntimeError: no snapshot was started.
        """
        if self._report is not None:
            return self._report
        t0 = time.perf_counter()
        if self._deferred is not None:  # no bubble came: capture and begin now
            deferred, self._deferred = self._deferred, None
            self._begin(deferred())
        self._pending = []
        blocking = self._num_chunks - self._in_bubbles  # copied (or queued) outside run_one
        record = self.tier.finish()
        self._report = CopyReport(
            record, self._in_bubbles, blocking, self._bubble_s, time.perf_counter() - t0
        )
        return self._report

    def queue_all(self) -> None:
        """Begin the snapshot if its begin was deferred and queue every chunk left (no wait).

        For device snapshots (``MemoryTier.copies_async``), at the step boundary: the copies are
        only queued; ``MemoryTier.guard_copies`` then orders the optimizer step after them on the
        device, and the checksums and the record follow in later ``run_one`` calls (or
        ``finish``). On the CPU this would copy the chunks, so it is not used there.
        """
        if self._deferred is not None:
            deferred, self._deferred = self._deferred, None
            self._begin(deferred())
        while self._pending:
            self.tier.copy_chunk(self._pending.pop())

    def take_report(self) -> CopyReport | None:
        """The report of the snapshot if it completed (in a bubble or by ``finish``) since the
        last call; None otherwise. Lets a caller act once per completed snapshot."""
        if self._report is None or self._delivered:
            return None
        self._delivered = True
        return self._report

    @property
    def bandwidth_bytes_per_s(self) -> float | None:
        """Measured copy bandwidth of ``run_one`` so far (copy + checksum), or None.

        CPU copies only: device copies run on the copy engine, not in ``run_one``.
        """
        return self._copied_bytes / self._copy_s if self._copy_s > 0 else None
