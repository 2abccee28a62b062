"""Fault injection: SIGKILL an actor's process and keep it down for a while.

:func:`kill_actor` is the primitive: it asks the actor for its process id (a ``control``
method, answered even while the actor is busy), records in the key-value store until when the
actor must stay down, and sends SIGKILL to the process: from this process when the actor runs
on this node, otherwise from a small task pinned to the actor's node. Nobody tells the victim's
supervisor; it has to notice.

:class:`FaultSchedule` turns a :class:`FaultPlan` into kills at the right moments of a
training call; the job polls it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from bubbleguard.ps.config import FaultPlan
from bubbleguard.ps.core.records import Event
from bubbleguard.ps.runtime.membership import Membership


@ray.remote(num_cpus=0)
def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)


def kill_actor(membership: Membership, name: str, handle: Any, downtime_s: float, *, shard: int = -1) -> Event:
    """SIGKILL actor ``name`` and keep it down for ``downtime_s``; the ``kill`` event.

    Raises:
        ray.exceptions.GetTimeoutError: the actor did not say who it is within 30 s.
    """
    identity = ray.get(handle.identity.remote(), timeout=30)
    pid, node_id = identity.pid, identity.node_id
    # The outage must be recorded before the kill: a restarted process reads it first thing.
    # It is measured from just before the kill, so the actor is down at least downtime_s.
    membership.set_outage(name, time.time() + downtime_s)
    killed_at = time.time()
    if node_id == ray.get_runtime_context().get_node_id():
        os.kill(pid, signal.SIGKILL)
    else:
        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        ray.get(_sigkill.options(scheduling_strategy=strategy).remote(pid), timeout=30)
    return Event(killed_at, "kill", shard, name, f"SIGKILL pid {pid}, down for {downtime_s:g} s")


class FaultSchedule:
    """When to kill what during one training call.

    Call order: construct at the start of the call, then :meth:`poll` every driver tick.

    Args:
        plan: the fault plan.
        duration_s: length of the training call (for evenly spaced kills).
        start: ``time.time()`` when the call started.
        kill: callback ``kill(target, shard, worker, downtime_s) -> Event``.
    """

    def __init__(
        self,
        plan: FaultPlan,
        duration_s: float,
        start: float,
        kill: Callable[[str, int, int, float], Event],
    ) -> None:
        self.plan = plan
        self._start = start
        self._kill = kill
        self._times = plan.kill_times(duration_s)
        self._done = 0

    @property
    def pending(self) -> int:
        """Kills not yet made."""
        return self.plan.num_kills - self._done

    def poll(self, now: float, num_applied: int) -> list[Event]:
        """Make the kill that is due, if any (``num_applied``: progress of the target shard)."""
        if self._done >= self.plan.num_kills:
            return []
        plan = self.plan
        if plan.kill_after_updates is not None:
            due = num_applied >= (self._done + 1) * plan.kill_after_updates
        else:
            due = now - self._start >= self._times[self._done]
        if not due:
            return []
        self._done += 1
        return [self._kill(plan.target, plan.shard, plan.worker, plan.downtime_s)]
