"""The recorder: an actor that collects workers' iteration and acknowledgement records.

Workers send records in batches (fire-and-forget) a few times a second, so a killed worker
loses at most its last unsent batch; the driver drains the recorder after each training call.
One actor per run; it is never a fault target.
"""

from __future__ import annotations

from bubbleguard.ps.core.records import AckRecord, IterationRecord


class Recorder:
    """Collects :class:`IterationRecord` and :class:`AckRecord` batches."""

    def __init__(self) -> None:
        self._iterations: list[IterationRecord] = []
        self._acks: list[AckRecord] = []

    def add(self, iterations: list[IterationRecord], acks: list[AckRecord]) -> None:
        """Append one worker's batch."""
        self._iterations.extend(iterations)
        self._acks.extend(acks)

    def drain(self) -> tuple[list[IterationRecord], list[AckRecord]]:
        """Everything received since the last drain."""
        out = (self._iterations, self._acks)
        self._iterations, self._acks = [], []
        return out
