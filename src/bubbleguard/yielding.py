"""Copies on a helper thread that hand the core back as soon as the training thread is woken.

While a stage waits on a receive, a helper thread of the same process copies snapshot chunks on
the stage's core. When the data lands, the training thread is woken on that core, but the
scheduler lets the running copy go on until it next looks (up to a tick); measured on the 2-core
dev VM, the training threads spent several ms per step runnable but off the CPU that way. So the
helper's native copies go in pieces and call ``sched_yield`` between them while a flag says the
training thread is still waiting: a woken training thread then runs after one piece at most.

The runtime owns the flag (:class:`YieldFlag`: set while the training thread waits, cleared once it
has the core back and waits for the chunk in flight instead) and installs it on its helper thread
with :func:`install`; the native copy (``checkpoint/layout.py``) reads :func:`current` on whatever
thread runs it. Threads without an installed flag copy in one pass, as before. Only the C copy
yields: the NumPy fallback holds the GIL and is left alone.
"""

from __future__ import annotations

import threading

import numpy as np

__all__ = ["PIECE_BYTES", "YieldFlag", "current", "install"]

PIECE_BYTES = 256 << 10
"""Bytes copied between two yields: ~13 us at the ~20 GB/s snapshot copy ``overhead.py`` measured
on the dev VM (computed from that bandwidth, not timed per piece)."""

_local = threading.local()


class YieldFlag:
    """A C ``int`` the copy reads between pieces: nonzero means "yield the core"."""

    def __init__(self) -> None:
        self._cell = np.zeros(1, dtype=np.intc)
        self.address: int = self._cell.ctypes.data

    def set(self, on: bool) -> None:
        self._cell[0] = 1 if on else 0


def install(flag: YieldFlag | None, piece_bytes: int = PIECE_BYTES) -> None:
    """Make the calling thread's native copies yield between ``piece_bytes`` pieces while
    ``flag`` is set (None: copy in one pass)."""
    if piece_bytes <= 0 or piece_bytes % 64:
        raise ValueError(f"piece_bytes must be a positive multiple of 64, got {piece_bytes}")
    _local.args = (piece_bytes, flag.address, flag) if flag is not None else None


def current() -> tuple[int, int] | None:
    """(piece bytes, flag address) installed on the calling thread, or None."""
    args = getattr(_local, "args", None)
    return None if args is None else (args[0], args[1])
