"""Per-rank timeline: when each action started and ended, and every idle wait.

Timestamps come from ``time.perf_counter()``, which on Linux reads the system-wide monotonic clock,
so events of all ranks on one machine share a time axis. Across machines the axes are unaligned;
the bubble analysis only uses differences within one rank, which stay exact.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["EventKind", "Timeline", "TimelineEvent", "load_events", "save_events"]


class EventKind:
    """Names of event kinds (plain strings so that events stay JSON)."""

    COMPUTE = "compute"  # forward or backward of a microbatch
    SEND = "send"  # posting a send (the transfer itself completes in the background)
    IDLE = "idle"  # waiting for a receive: the bubble
    STEP = "step"  # gradient averaging (with replicas) and optimizer step
    ALLREDUCE = "allreduce"  # data-parallel gradient averaging, inside STEP
    CHECKPOINT = "checkpoint"  # checkpoint work (copying snapshot chunks)


@dataclass(frozen=True)
class TimelineEvent:
    """One interval on one rank.

    Attributes:
        rank: global rank that recorded it.
        stage: pipeline stage of that rank.
        replica: data-parallel replica of that rank.
        step: training step (1-based: the iteration that ends with optimizer step ``step``).
        kind: one of :class:`EventKind`'s values.
        name: what it was, e.g. ``"F3"`` or ``"wait RA3<-0"``.
        action_index: index of the schedule action it belongs to (-1 if none).
        start_s: start time, seconds on the monotonic clock.
        end_s: end time.
    """

    rank: int
    stage: int
    replica: int
    step: int
    kind: str
    name: str
    action_index: int
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """Length of the interval in seconds."""
        return self.end_s - self.start_s


class Timeline:
    """Collects the events of one rank. Cheap enough to leave on: one small object per action."""

    def __init__(self, rank: int, stage: int, replica: int, enabled: bool = True) -> None:
        self.rank, self.stage, self.replica = rank, stage, replica
        self.enabled = enabled
        self.events: list[TimelineEvent] = []
        self.step = 0

    def add(self, kind: str, name: str, start_s: float, end_s: float, action_index: int = -1) -> None:
        """Record an interval that has already happened."""
        if self.enabled:
            self.events.append(TimelineEvent(self.rank, self.stage, self.replica, self.step, kind,
                                             name, action_index, start_s, end_s))

    @contextmanager
    def span(self, kind: str, name: str, action_index: int = -1) -> Iterator[None]:
        """Record the interval that the ``with`` block takes."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, name, start, time.perf_counter(), action_index)


def save_events(path: str | Path, events: Iterable[TimelineEvent]) -> None:
    """Write events as a JSON list of objects."""
    Path(path).write_text(json.dumps([asdict(e) for e in events]))


def load_events(path: str | Path) -> list[TimelineEvent]:
    """Read events written by :func:`save_events`."""
    return [TimelineEvent(**d) for d in json.loads(Path(path).read_text())]
