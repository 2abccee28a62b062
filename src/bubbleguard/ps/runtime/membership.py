"""Membership and roles in Ray's own key-value store (the GCS), plus actor naming.

What lives here, per run (keys are prefixed with the run id):

- ``view/<shard>``: the servers of a shard, ``{"epoch": e, "nodes": [head, ..., tail]}`` (one
  node unless the shard is a chain), written only by the driver's supervisor; workers read it
  to find the head and the tail, and re-read it when a server fails them.
- ``outage/<actor>``: the time before which a killed actor may not come back (written by the
  fault injector just before the kill; read by whatever restarts or replaces the actor).
- ``incarnation/<actor>``: how many times an actor's process has started.

Actors are found by name (``ray.get_actor(name, namespace=NAMESPACE)``). A replacement gets a
new name: Ray 2.60 keeps a dead actor's name taken while handles to it exist.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray.experimental import internal_kv

from bubbleguard.ps.runtime.cluster import NAMESPACE


def actor_name(run_id: str, *parts: object) -> str:
    """The Ray name of an actor of ``run_id``, e.g. ``run/shard0/node2``."""
    return "/".join([run_id, *(str(p) for p in parts)])


@dataclass(frozen=True)
class ShardView:
    """A shard's servers at one epoch; ``nodes[0]`` is the head, ``nodes[-1]`` the tail (the
    same node unless the shard is a chain)."""

    epoch: int
    nodes: tuple[str, ...]

    @property
    def head(self) -> str:
        """The node that receives pushes."""
        return self.nodes[0]

    @property
    def tail(self) -> str:
        """The node whose state holds only acknowledged updates."""
        return self.nodes[-1]


class Membership:
    """Typed access to one run's entries in Ray's key-value store.

    Args:
        run_id: the run whose entries are read and written.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id

    def _key(self, *parts: object) -> bytes:
        return "/".join([self.run_id, *(str(p) for p in parts)]).encode()

    def _put(self, key: bytes, value: Any) -> None:
        internal_kv._internal_kv_put(key, json.dumps(value).encode(), overwrite=True, namespace=NAMESPACE)

    def _get(self, key: bytes) -> Any:
        raw = internal_kv._internal_kv_get(key, namespace=NAMESPACE)
        return None if raw is None else json.loads(raw)

    def set_view(self, shard: int, view: ShardView) -> None:
        """Publish a shard's servers."""
        self._put(self._key("view", shard), {"epoch": view.epoch, "nodes": list(view.nodes)})

    def view(self, shard: int) -> ShardView | None:
        """A shard's current servers, or ``None`` before they are published."""
        raw = self._get(self._key("view", shard))
        return None if raw is None else ShardView(int(raw["epoch"]), tuple(raw["nodes"]))

    def set_outage(self, actor: str, until: float) -> None:
        """Keep ``actor`` down until the time ``until`` (``time.time()`` seconds)."""
        self._put(self._key("outage", actor), until)

    def outage_until(self, actor: str) -> float:
        """When ``actor`` may come back (0 if it was never taken down)."""
        value = self._get(self._key("outage", actor))
        return 0.0 if value is None else float(value)

    def wait_out_outage(self, actor: str) -> None:
        """Sleep until ``actor``'s outage, if any, is over."""
        delay = self.outage_until(actor) - time.time()
        if delay > 0:
            time.sleep(delay)

    def next_incarnation(self, actor: str) -> int:
        """Count one more start of ``actor``'s process and return its incarnation (0 first).

        Only the actor's own process calls this and only one process per actor is alive, so
        the read-modify-write needs no lock.
        """
        key = self._key("incarnation", actor)
        value = self._get(key)
        incarnation = 0 if value is None else int(value) + 1
        self._put(key, incarnation)
        return incarnation

    def clear(self) -> None:
        """Delete every entry of the run."""
        prefix = (self.run_id + "/").encode()
        for key in internal_kv._internal_kv_list(prefix, namespace=NAMESPACE):
            internal_kv._internal_kv_del(key, namespace=NAMESPACE)


def lookup_actor(name: str) -> Any | None:
    """The live actor called ``name``, or ``None`` if there is none right now."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None
