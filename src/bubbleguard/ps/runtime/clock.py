"""The clock service: workers' clocks and the stale-synchronous wait, as an async Ray actor.

Call order: each worker calls ``advance(worker, clock)`` (fire-and-forget) after every
gradient, and ``wait_min(target, deadline)`` only when its cached lower bound of the slowest
clock says it may be too far ahead. The driver calls ``release()`` to unblock every waiter at
the end of a training call. One actor per run; it is never a fault target.
"""

from __future__ import annotations

import asyncio
import time

from bubbleguard.ps.core.consistency import ClockTable


class ClockService:
    """Async actor wrapping a :class:`ClockTable`.

    Args:
        num_workers: workers taking part.
    """

    def __init__(self, num_workers: int) -> None:
        self._table = ClockTable(num_workers)
        self._changed = asyncio.Condition()
        self._released = False

    async def advance(self, worker: int, clock: int) -> None:
        """Record that ``worker`` finished ``clock`` clocks."""
        async with self._changed:
            self._table.advance(worker, clock)
            self._changed.notify_all()

    async def wait_min(self, target: int, deadline: float) -> tuple[int, bool]:
        """Wait until every worker finished ``target`` clocks.

        Returns:
            The slowest clock and whether it reached ``target`` (``False``: the deadline passed
            or the driver released the waiters first).
        """
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self._table.min() >= target or self._released),
                    timeout=max(deadline - time.time(), 0.0),
                )
            except asyncio.TimeoutError:
                pass
            low = self._table.min()
            return low, low >= target

    async def clock_of(self, worker: int) -> int:
        """Clocks ``worker`` has finished (a restarted worker resumes from here)."""
        return self._table.clock_of(worker)

    async def clocks(self) -> list[int]:
        """Every worker's clock."""
        return self._table.clocks()

    async def release(self) -> None:
        """Unblock every waiter (they return ``False``) until :meth:`reset_release`."""
        async with self._changed:
            self._released = True
            self._changed.notify_all()

    async def reset_release(self) -> None:
        """Let workers wait again (the start of the next training call)."""
        self._released = False
