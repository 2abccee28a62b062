"""Clocks and the stale-synchronous gate, as pure logic.

A worker's clock counts the gradients it has finished (pushed and acknowledged or buffered).
With bound ``s`` (``0`` for strict, ``None`` for eventual) a worker that has finished ``c``
clocks may start the next one only when every worker has finished at least ``c - s``.

Workers keep a lower bound of the slowest clock (clocks only grow), so most iterations pass the
gate without asking anyone; only when the cached bound is too low does a worker ask the clock
service, which answers once the true minimum is high enough.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from bubbleguard.ps.core.records import IterationRecord


def must_wait(clock: int, known_min: int, bound: int | None) -> bool:
    """Whether a worker that finished ``clock`` clocks must wait, given a lower bound
    ``known_min`` of the slowest worker's clock."""
    return bound is not None and clock - known_min > bound


class ClockTable:
    """Finished clocks per worker (pure; the clock service wraps it).

    Args:
        num_workers: workers taking part.
    """

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        self._clocks = [0] * num_workers

    def advance(self, worker: int, clock: int) -> None:
        """Record that ``worker`` finished ``clock`` clocks (late, repeated reports are harmless)."""
        self._clocks[worker] = max(self._clocks[worker], clock)

    def clock_of(self, worker: int) -> int:
        """Clocks ``worker`` has finished."""
        return self._clocks[worker]

    def min(self) -> int:
        """The slowest worker's clock."""
        return min(self._clocks)

    def clocks(self) -> list[int]:
        """Every worker's clock."""
        return list(self._clocks)


def clock_leads(records: Iterable[IterationRecord], num_workers: int) -> list[int]:
    """For every iteration, how far its worker was ahead of the slowest worker when it passed
    the gate, reconstructed from the workers' own timestamps.

    Worker ``v`` counts as having finished clock ``k + 1`` from the ``t_end`` of its iteration
    at clock ``k``. A gradient's push returns before its clock advance is sent, so this count is
    never behind what the clock service knew: under bound ``s`` every lead is at most ``s``.
    """
    records = list(records)
    finished: list[list[tuple[float, int]]] = [[] for _ in range(num_workers)]
    for r in records:
        finished[r.worker].append((r.t_end, r.clock + 1))
    # Prefix maxima so "clocks finished by time t" is one binary search.
    times: list[list[float]] = []
    best: list[list[int]] = []
    for rows in finished:
        rows.sort()
        times.append([t for t, _ in rows])
        running, acc = 0, []
        for _, c in rows:
            running = max(running, c)
            acc.append(running)
        best.append(acc)

    def finished_by(worker: int, t: float) -> int:
        i = bisect.bisect_right(times[worker], t)
        return best[worker][i - 1] if i else 0

    return [r.clock - min(finished_by(v, r.t_gate) for v in range(num_workers)) for r in records]
