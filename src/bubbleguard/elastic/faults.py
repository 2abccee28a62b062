"""Fault injection as a test API: kill a rank at (rank, step, phase), on the first attempt only.

``--fault 1:5:before`` kills rank 1 with SIGKILL just before it starts step 5; ``after`` kills it
right after step 5 returned. Only the first attempt (``TORCHELASTIC_RESTART_COUNT`` 0) is killed,
so torchrun's restart of the group runs through and the test can check what was resumed.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

__all__ = ["PHASES", "Fault", "parse_fault"]

PHASES: tuple[str, ...] = ("before", "after")


@dataclass(frozen=True)
class Fault:
    """Kill ``rank`` at ``step`` (``phase``: just ``before`` it starts, or just ``after`` it)."""

    rank: int
    step: int
    phase: str = "before"

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 1:
            raise ValueError(f"--fault needs rank >= 0 and step >= 1, got {self.rank}:{self.step}")
        if self.phase not in PHASES:
            raise ValueError(f"--fault phase {self.phase!r} is not one of {', '.join(PHASES)}")

    def maybe_fire(self, rank: int, step: int, phase: str) -> None:
        """SIGKILL this process if it is the chosen (rank, step, phase) on the first attempt."""
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and (rank, step, phase) == (self.rank, self.step, self.phase):
            os.kill(os.getpid(), signal.SIGKILL)


def parse_fault(text: str) -> Fault:
    """Parse ``RANK:STEP[:PHASE]``.

    Raises:
        ValueError: not of that form (names what is accepted).
    """
    parts = text.split(":")
    if len(parts) not in (2, 3) or not all(p.strip().isdigit() for p in parts[:2]):
        raise ValueError(f"--fault {text!r} is not RANK:STEP[:PHASE] (e.g. 1:5:before)")
    return Fault(int(parts[0]), int(parts[1]), parts[2] if len(parts) == 3 else "before")
