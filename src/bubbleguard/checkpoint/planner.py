"""Checkpoint planner (pure): which snapshot chunk goes into which idle window of an iteration.

Input, per stage: the idle windows ("bubbles") of one iteration in time order -- the pipeline
layer converts its measured bubble map into :class:`IdleWindow` -- the chunk sizes in bytes (from
``ChunkLayout.chunk_sizes()``), the measured copy bandwidth and a safety margin. Output: a frozen
:class:`CheckpointPlan`.

Rule: a window of ``duration_s`` can hold ``duration_s * (1 - safety_margin) * bandwidth`` bytes.
Chunks are taken in id order; each goes into the earliest window that still has room for all of
it (first fit). Chunks no window can hold are copied just before ``optimizer.step()``; that is the
blocking time, ``unassigned bytes / bandwidth``. The idle time left over after the copies is what a
durable persist may use; ``persist_every_free`` is the smallest number of iterations whose
left-over idle time covers one persist of all bytes, at the persist's bandwidth per second of
CPU time (the persist runs in idle CPU time: its CPU time is what it takes from the bubbles).

No process group, no clock, no files: plain data in, plain data out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class IdleWindow:
    """One idle period of a stage within an iteration.

    Attributes:
        index: position in the iteration's action list (windows are given in time order).
        after: the action the window follows, e.g. ``"F3"`` or ``"recv B2"`` (for traces).
        duration_s: how long the stage waits.
    """

    index: int
    after: str
    duration_s: float


@dataclass(frozen=True)
class WindowAssignment:
    """The chunks to copy in one window, in order.

    Attributes:
        window_index: :attr:`IdleWindow.index` of the window.
        chunk_ids: chunk ids, in copy order.
        num_bytes: bytes of those chunks.
        capacity_bytes: bytes the window can hold after the safety margin.
    """

    window_index: int
    chunk_ids: tuple[int, ...]
    num_bytes: int
    capacity_bytes: float


@dataclass(frozen=True)
class CheckpointPlan:
    """Where each chunk of a stage's snapshot is copied during one iteration.

    Attributes:
        assignments: one per window, in window order (possibly empty).
        blocking_chunk_ids: chunks copied just before ``optimizer.step()``.
        blocking_s: predicted blocking time (bytes of the blocking chunks / bandwidth).
        total_bytes: bytes of all chunks.
        leftover_idle_s: idle time the copies leave free, after the safety margin.
        persist_every_free: iterations of left-over idle time one durable persist needs, or
            None (no persist figures given, or no idle time left).
    """

    assignments: tuple[WindowAssignment, ...]
    blocking_chunk_ids: tuple[int, ...]
    blocking_s: float
    total_bytes: int
    leftover_idle_s: float
    persist_every_free: int | None

    def chunks_for_window(self, window_index: int) -> tuple[int, ...]:
        """Chunk ids to copy in the window with :attr:`IdleWindow.index` ``window_index``."""
        for a in self.assignments:
            if a.window_index == window_index:
                return a.chunk_ids
        raise KeyError(f"no window with index {window_index} in this plan")

    @property
    def blocking_bytes(self) -> int:
        """Bytes copied just before ``optimizer.step()``."""
        return self.total_bytes - sum(a.num_bytes for a in self.assignments)


def plan_checkpoint(
    windows: Sequence[IdleWindow],
    chunk_bytes: Sequence[int],
    copy_bandwidth_bytes_per_s: float,
    *,
    safety_margin: float = 0.1,
    persist_bandwidth_bytes_per_s: float | None = None,
) -> CheckpointPlan:
    """Assign chunks to idle windows (first fit, in chunk order); see the module docstring.

    Args:
        windows: idle windows of one iteration, in time order, with distinct indices.
        chunk_bytes: size of every chunk, indexed by chunk id.
        copy_bandwidth_bytes_per_s: measured snapshot copy bandwidth, > 0.
        safety_margin: fraction of every window left unused, in [0, 1).
        persist_bandwidth_bytes_per_s: bytes a durable persist writes per second of the CPU
            time it takes (measured), > 0, or None.

    Raises:
        ValueError: naming the bad argument.
    """
    if not (copy_bandwidth_bytes_per_s > 0 and math.isfinite(copy_bandwidth_bytes_per_s)):
        raise ValueError(
            f"copy_bandwidth_bytes_per_s must be a positive number, got {copy_bandwidth_bytes_per_s}"
        )
    if not 0 <= safety_margin < 1:
        raise ValueError(f"safety_margin must be in [0, 1), got {safety_margin}")
    if persist_bandwidth_bytes_per_s is not None and not persist_bandwidth_bytes_per_s > 0:
        raise ValueError(
            f"persist_bandwidth_bytes_per_s must be > 0 or None, got {persist_bandwidth_bytes_per_s}"
        )
    seen: set[int] = set()
    for w in windows:
        if not (w.duration_s >= 0 and math.isfinite(w.duration_s)):
            raise ValueError(
                f"window {w.index} ({w.after!r}) has duration_s {w.duration_s}; expected >= 0"
            )
        if w.index in seen:
            raise ValueError(f"window index {w.index} appears twice")
        seen.add(w.index)
    for i, n in enumerate(chunk_bytes):
        if n < 0:
            raise ValueError(f"chunk {i} has negative size {n}")

    capacity = [w.duration_s * (1 - safety_margin) * copy_bandwidth_bytes_per_s for w in windows]
    used = [0] * len(windows)
    chosen: list[list[int]] = [[] for _ in windows]
    blocking: list[int] = []
    for chunk_id, size in enumerate(chunk_bytes):
        for k, cap in enumerate(capacity):
            if used[k] + size <= cap:
                used[k] += size
                chosen[k].append(chunk_id)
                break
        else:
            blocking.append(chunk_id)

    total = sum(chunk_bytes)
    blocking_bytes = sum(chunk_bytes[i] for i in blocking)
    leftover_s = (
        sum(cap - u for cap, u in zip(capacity, used, strict=True)) / copy_bandwidth_bytes_per_s
    )
    persist_every: int | None = None
    if persist_bandwidth_bytes_per_s is not None and leftover_s > 0:
        persist_s = total / persist_bandwidth_bytes_per_s
        persist_every = max(1, math.ceil(persist_s / leftover_s))
    return CheckpointPlan(
        assignments=tuple(
            WindowAssignment(w.index, tuple(c), u, cap)
            for w, c, u, cap in zip(windows, chosen, used, capacity, strict=True)
        ),
        blocking_chunk_ids=tuple(blocking),
        blocking_s=blocking_bytes / copy_bandwidth_bytes_per_s,
        total_bytes=total,
        leftover_idle_s=leftover_s,
        persist_every_free=persist_every,
    )
