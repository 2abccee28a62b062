"""The server actor that holds one shard; strategies subclass it.

Concurrency (Ray concurrency groups of a threaded actor):

- the default group has one thread: ``push`` and every other state change run there, one at a
  time, in arrival order, so a subclass can block in it (a chain node waiting for its
  successor) without reordering updates (the stateless server widens it so concurrent pushes
  can share a commit; its state lock still applies them one at a time);
- ``read`` (two threads): ``pull`` and ``state``, so workers and evaluators read while a push is
  being applied or forwarded;
- ``control`` (one thread): ``ping`` and ``identity``, answered even while the default thread
  blocks, for supervision and fault injection.

A lock makes every read see a whole step. Construction order: the process counts its
incarnation, waits out an injected outage (a killed server that Ray restarts, or its
replacement, stays down as long as the fault plan says), asks the subclass for its starting
state (:meth:`_starting_state`), and reports ready.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import ray
import torch

from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.messages import Ack, Gradient, Weights
from bubbleguard.ps.core.state import LiveShardState, ShardState
from bubbleguard.ps.runtime.membership import Membership

SERVER_CONCURRENCY_GROUPS = {"read": 2, "control": 1}


@dataclass(frozen=True)
class ServerSpec:
    """What a shard server needs to start.

    Attributes:
        run_id: the run it belongs to.
        name: its Ray actor name.
        shard: the shard it holds.
        layout: the parameter layout (checkpoints key tensors by name).
        initial: the state before any update.
        lr: SGD learning rate.
        momentum: SGD momentum.
        options: strategy-specific settings.
        replaces: the dead server this one replaces; it stays down until that server's
            injected outage is over, like a restarted process would.
    """

    run_id: str
    name: str
    shard: int
    layout: ParamLayout
    initial: ShardState
    lr: float
    momentum: float
    options: dict[str, Any]
    replaces: str | None = None


@dataclass(frozen=True)
class ServerIdentity:
    """Who a server process is and how it started.

    Attributes:
        name: actor name.
        pid: process id (what the fault injector kills).
        node_id: the Ray node it runs on.
        incarnation: 0 for the first process, +1 per restart.
        started_at: when its constructor began (``time.time()``).
        ready_at: when it finished starting.
        started_from: where its state came from (``initial``, ``checkpoint``, ``store``, ...).
        start_version: the version it started with.
        start_digest: the digest of the state it started with.
    """

    name: str
    pid: int
    node_id: str
    incarnation: int
    started_at: float
    ready_at: float
    started_from: str
    start_version: int
    start_digest: str


@dataclass(frozen=True)
class Health:
    """A server's answer to ``ping``: alive, which process, how far along."""

    incarnation: int
    version: int
    num_applied: int


class ShardServer:
    """Base shard server: applies pushes, serves reads (see the module docstring).

    Subclasses override :meth:`_starting_state` (where the state comes from) and
    :meth:`_after_push` (what must happen before a push is acknowledged).
    """

    def __init__(self, spec: ServerSpec) -> None:
        started_at = time.time()
        torch.set_num_threads(1)
        self.spec = spec
        self._lock = threading.Lock()
        self._membership = Membership(spec.run_id)
        self._incarnation = self._membership.next_incarnation(spec.name)
        # Processes start (import, connect) while the outage lasts; only serving waits for it.
        self._membership.wait_out_outage(spec.name)
        if spec.replaces is not None:
            self._membership.wait_out_outage(spec.replaces)
        state, origin = self._starting_state()
        self._state = LiveShardState(state, lr=spec.lr, momentum=spec.momentum)
        self._identity = ServerIdentity(
            name=spec.name,
            pid=os.getpid(),
            node_id=ray.get_runtime_context().get_node_id(),
            incarnation=self._incarnation,
            started_at=started_at,
            ready_at=time.time(),
            started_from=origin,
            start_version=state.version,
            start_digest=state.digest(),
        )

    # -- hooks -------------------------------------------------------------------------------

    def _starting_state(self) -> tuple[ShardState, str]:
        """The state to start from and where it came from; the base starts fresh."""
        return self.spec.initial, "initial"

    def _after_push(self, ack: Ack) -> Ack:
        """Runs on the default thread after a push was applied, before it is acknowledged."""
        return ack

    # -- default group: state changes, one at a time ----------------------------------------

    def push(self, grad: Gradient) -> Ack:
        """Apply ``grad`` (or recognise it as already applied) and acknowledge it."""
        with self._lock:
            ack = self._state.apply(grad)
        return self._after_push(ack)

    # -- read group ----------------------------------------------------------------------------

    @ray.method(concurrency_group="read")
    def pull(self) -> Weights:
        """The current parameters and version."""
        with self._lock:
            return self._state.weights()

    @ray.method(concurrency_group="read")
    def state(self) -> ShardState:
        """A frozen copy of the whole state (parameters, momentum, version, log)."""
        with self._lock:
            return self._state.freeze()

    # -- control group -----------------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def ping(self) -> Health:
        """Cheap liveness and progress check."""
        # Two ints read without the lock: a value one step old is fine for supervision.
        return Health(self._incarnation, self._state.version, self._state.num_applied)

    @ray.method(concurrency_group="control")
    def identity(self) -> ServerIdentity:
        """Process id, node and start record."""
        return self._identity
