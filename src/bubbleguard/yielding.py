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

Yielding is not always enough: the scheduler (EEVDF) gives the core to a woken thread at a yield
only if that thread is owed CPU time, so a training thread that ran a lot may still queue behind
the copy. Where the process may both lower and restore a thread's priority
(:func:`idle_priority_is_reversible`: root, ``CAP_SYS_NICE`` or ``RLIMIT_NICE`` >= 20), the
runtime therefore sets the flag to :data:`ENTER_KERNEL` instead of :data:`YIELD`: the native
copy then lowers its thread to ``SCHED_IDLE`` for its length (with the GIL released: a thread
holding the GIL at idle priority can be starved while the woken training thread waits for the
GIL, seen as a 1.4 s stall beside a starting persist helper), which any waking normal thread
preempts, and between pieces only enters the kernel, where a lazily applied preemption takes
effect (a yield would give the core to any other idle task, a persist helper included, for a
slice per piece). When the data lands the training thread clears the flag and puts the thread
back to normal priority (:func:`restore_normal_priority`) before it waits for the chunk in flight, which so
never starves behind other busy processes. Elsewhere (an unprivileged user cannot leave
``SCHED_IDLE``) the copy stays at normal priority and yields.
"""

from __future__ import annotations

import functools
import os
import threading

import numpy as np

__all__ = ["ENTER_KERNEL", "PIECE_BYTES", "YIELD", "YieldFlag", "current",
           "idle_priority_is_reversible", "install", "restore_normal_priority"]

PIECE_BYTES = 256 << 10
"""Bytes copied between two yields: ~13 us at the ~20 GB/s snapshot copy ``overhead.py`` measured
on the dev VM (computed from that bandwidth, not timed per piece)."""

_local = threading.local()


YIELD = 1
"""Flag value: between pieces, give up the core (``sched_yield``): for a normal-priority copy."""

ENTER_KERNEL = 2
"""Flag value: copy at ``SCHED_IDLE`` and between pieces only enter the kernel (a cheap system
call), where a pending preemption by the woken training thread takes effect (this kernel
preempts lazily: at the current thread's next return from the kernel, or at the next tick). Only
where :func:`idle_priority_is_reversible`, since the runtime restores the priority."""


class YieldFlag:
    """A C ``int`` the copy reads between pieces: 0 nothing, :data:`YIELD` or
    :data:`ENTER_KERNEL` while set (``mode``)."""

    def __init__(self, mode: int = YIELD) -> None:
        if mode not in (YIELD, ENTER_KERNEL):
            raise ValueError(f"mode must be YIELD or ENTER_KERNEL, got {mode}")
        self.mode = mode
        self._cell = np.zeros(1, dtype=np.intc)
        self.address: int = self._cell.ctypes.data

    def set(self, on: bool) -> None:
        self._cell[0] = self.mode if on else 0


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


@functools.cache
def idle_priority_is_reversible() -> bool:
    """Whether a thread of this process can go to ``SCHED_IDLE`` and back to ``SCHED_OTHER``.

    Asked once per process, of a throwaway thread that tries it: Linux lets an unprivileged
    thread into ``SCHED_IDLE`` but out again only with ``CAP_SYS_NICE`` or ``RLIMIT_NICE`` >= 20,
    and a container may forbid either call; trying covers every case, and a thread left stuck at
    ``SCHED_IDLE`` by a failed try ends right there.
    """
    if not hasattr(os, "SCHED_IDLE"):
        return False
    outcome: list[bool] = []

    def probe() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            outcome.append(True)
        except OSError:
            outcome.append(False)

    thread = threading.Thread(target=probe, name="bubbleguard-sched-probe", daemon=True)
    thread.start()
    thread.join()
    return outcome == [True]


def restore_normal_priority(native_id: int) -> None:
    """Put the thread ``native_id`` back at ``SCHED_OTHER`` (the native copy lowers itself).

    Only call where :func:`idle_priority_is_reversible` said so.
    """
    os.sched_setscheduler(native_id, os.SCHED_OTHER, os.sched_param(0))
