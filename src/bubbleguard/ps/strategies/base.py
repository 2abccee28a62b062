"""The two halves of a recovery strategy: the driver-side :class:`Strategy` that builds and
supervises one shard's servers, and the worker-side :class:`ShardClient` that talks to them.

Call order.

Driver (one thread, :class:`bubbleguard.ps.PSJob`), per shard::

    strategy = StrategyClass(ctx)
    clients = [strategy.client() for _ in workers]   # shipped to the workers (may precede start)
    strategy.start()                      # create the server actor(s), publish the shard's view
    loop every ~20 ms while training:
        events += strategy.poll(now)      # detect deaths, fail over, restart, replace
        strategy.reader()                 # the actor to read the served model from
        strategy.status()                 # up / degraded / down
    strategy.victim(target)               # what the fault injector kills
    strategy.stop()                       # kill every actor it created

Worker (its own thread), per shard::

    client.connect()                      # once, inside the worker process: finds the servers
                                          # through the shard's published view
    loop:
        weights = client.pull(deadline)   # may block and retry, or return cached weights
        outcome, ack = client.push(grad, deadline)   # acked, buffered, or failed at the deadline
        client.take_acks()                # acknowledgements that arrived outside push
    client.settle(deadline)               # hand over whatever is pending, if the server is up

A strategy decides what the system does while a server is down; supervision sees a failure only
through Ray (a failed ping), never through the fault injector.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import ray
from ray.exceptions import ActorDiedError, RayActorError

from bubbleguard.ps.config import RunConfig
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.messages import Ack, Gradient, Weights
from bubbleguard.ps.core.records import Event, PushOutcome, ServerStatus
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.runtime.cluster import NAMESPACE
from bubbleguard.ps.runtime.membership import Membership
from bubbleguard.ps.runtime.server import (
    SERVER_CONCURRENCY_GROUPS,
    Health,
    ServerIdentity,
    ServerSpec,
)

RETRY_INTERVAL_S = 0.02
"""How long a waiting worker sleeps between retries."""
UNRESPONSIVE_AFTER_S = 0.5
"""A ping unanswered this long marks its server down (a restarting actor does not answer)."""


@dataclass(frozen=True)
class ShardContext:
    """What a strategy needs to build one shard's servers.

    Attributes:
        run_id: the run (prefix of actor names and key-value entries).
        shard: the shard index.
        config: the run's configuration.
        layout: the parameter layout.
        initial: the shard's state before training.
        workdir: where the strategy may write (checkpoints, durable copies).
    """

    run_id: str
    shard: int
    config: RunConfig
    layout: ParamLayout
    initial: ShardState
    workdir: Path

    def server_spec(self, name: str, *, replaces: str | None = None, **options: Any) -> ServerSpec:
        """The spec of a server of this shard called ``name`` (replacing ``replaces``)."""
        training = self.config.training
        return ServerSpec(
            run_id=self.run_id,
            name=name,
            shard=self.shard,
            layout=self.layout,
            initial=self.initial,
            lr=training.lr,
            momentum=training.momentum,
            options=options,
            replaces=replaces,
        )


_REMOTE_CLASSES: dict[type, Any] = {}


def server_actor_class(cls: type) -> Any:
    """``cls`` (a :class:`ShardServer` subclass) as a Ray actor class with the server's
    concurrency groups; cached so each class is exported to the cluster once."""
    if cls not in _REMOTE_CLASSES:
        _REMOTE_CLASSES[cls] = ray.remote(concurrency_groups=SERVER_CONCURRENCY_GROUPS)(cls)  # type: ignore[call-overload]
    return _REMOTE_CLASSES[cls]


def create_server(
    ctx: ShardContext,
    cls: type,
    name: str,
    *,
    max_restarts: int = 0,
    max_concurrency: int = 1,
    replaces: str | None = None,
    **options: Any,
) -> Any:
    """Start a server actor of class ``cls`` named ``name`` (not waiting for it to be ready).

    A restartable server also gets unlimited task retries: Ray then holds calls made while it
    restarts and delivers them once it is back. (Without retries, a call made during the
    restart fails only seconds after the actor is back.) Re-delivered pushes are harmless:
    they carry update ids.
    """
    return server_actor_class(cls).options(
        name=name,
        namespace=NAMESPACE,
        num_cpus=ctx.config.resources.server_cpus,
        max_restarts=max_restarts,
        max_task_retries=-1 if max_restarts else 0,
        max_concurrency=max_concurrency,
    ).remote(ctx.server_spec(name, replaces=replaces, **options))


def wait_ready(handle: Any, timeout_s: float = 120.0) -> ServerIdentity:
    """Block until a server has started; its identity."""
    identity: ServerIdentity = ray.get(handle.identity.remote(), timeout=timeout_s)
    return identity


LivenessState = Literal["alive", "pending", "unresponsive", "dead"]


class Liveness:
    """Non-blocking health checks of one server from the driver loop.

    Each :meth:`poll` sends a ping if none is in flight and reads the answer if it has come.
    ``dead`` means Ray reported the actor dead for good (no restart will follow);
    ``unresponsive`` means a ping is overdue (the process is gone and Ray is restarting it,
    or it is overloaded).
    """

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.health: Health | None = None
        self.state: LivenessState = "pending"
        self._ref: Any = None
        self._sent_at = 0.0

    def poll(self, now: float) -> LivenessState:
        """Advance the check; the current state."""
        if self.state == "dead":
            return self.state
        if self._ref is None:
            self._ref = self.handle.ping.remote()
            self._sent_at = now
        ready, _ = ray.wait([self._ref], timeout=0)
        if ready:
            ref, self._ref = self._ref, None
            try:
                self.health = ray.get(ref)
                self.state = "alive"
            except ActorDiedError:
                self.state = "dead"
            except RayActorError:
                self.state = "unresponsive"
        elif now - self._sent_at > UNRESPONSIVE_AFTER_S:
            self.state = "unresponsive"
        return self.state


class ShardClient(ABC):
    """Worker-side access to one shard (see the module docstring for the call order).

    Instances are built by the driver and pickled into the worker, so they hold names and
    handles, and open anything else in :meth:`connect`.
    """

    def __init__(self, shard: int, run_id: str) -> None:
        self.shard = shard
        self.run_id = run_id

    def connect(self) -> None:  # noqa: B027  (optional hook; most clients need it)
        """Called once inside the worker process before the first pull."""

    @abstractmethod
    def pull(self, deadline: float) -> Weights | None:
        """The weights to compute the next gradient on; ``None`` if the deadline passed first."""

    @abstractmethod
    def push(self, grad: Gradient, deadline: float) -> tuple[PushOutcome, Ack | None]:
        """Deliver ``grad``: ``("acked", ack)``, ``("buffered", None)`` or ``("failed", None)``
        when the deadline passed before the shard acknowledged it."""

    def take_acks(self) -> list[Ack]:
        """Acknowledgements that arrived outside :meth:`push` (a backlog hand-over)."""
        return []

    def settle(self, deadline: float) -> None:  # noqa: B027  (optional hook)
        """At the end of a training call: hand over anything pending if the shard is up."""

    def num_pending(self) -> int:
        """Gradients computed for this shard and not yet acknowledged or dropped."""
        return 0

    def dropped_uids(self) -> list[int]:
        """Ids dropped by an overflow policy (never applied)."""
        return []


def call_until_done(method: Any, arg: Any, deadline: float) -> Any | None:
    """Call an actor method until it returns, retrying while the actor is unavailable.

    Used by strategies whose workers wait out an outage. Returns ``None`` if the deadline
    passes first. A server that restarts re-applies nothing twice: pushes carry update ids.
    """
    while time.time() < deadline:
        try:
            return ray.get(method.remote(arg) if arg is not None else method.remote())
        except RayActorError:
            time.sleep(RETRY_INTERVAL_S)
    return None


class Strategy(ABC):
    """Driver-side half of a recovery strategy for one shard (see the module docstring)."""

    name: ClassVar[str]

    def __init__(self, ctx: ShardContext) -> None:
        self.ctx = ctx
        self.membership = Membership(ctx.run_id)

    @abstractmethod
    def start(self) -> None:
        """Create the shard's server actor(s) and wait until they serve."""

    @abstractmethod
    def client(self) -> ShardClient:
        """A client for one worker (callable before :meth:`start`)."""

    @abstractmethod
    def reader(self) -> Any | None:
        """The actor whose state is the served model, or ``None`` if none serves now."""

    @abstractmethod
    def victim(self, target: str) -> tuple[str, Any]:
        """``(name, handle)`` of the actor a fault on ``target`` kills now.

        Raises:
            ValueError: the strategy has no such role right now.
        """

    @abstractmethod
    def poll(self, now: float) -> list[Event]:
        """One supervision step; the recoveries it observed."""

    @abstractmethod
    def status(self) -> ServerStatus:
        """``up``, ``degraded`` or ``down``."""

    @abstractmethod
    def servers(self) -> dict[str, Any]:
        """Every live server actor of the shard by name (tests compare their states)."""

    @property
    def num_applied(self) -> int:
        """Gradients in the serving state, as last seen by supervision."""
        return 0

    def stop(self) -> None:
        """Kill every actor this strategy created."""
        for handle in self.servers().values():
            ray.kill(handle, no_restart=True)


class OneServerStatus:
    """``status``, ``servers`` and ``num_applied`` for strategies with one live server per shard.

    The strategy keeps ``server_name``, ``handle`` and ``liveness`` (a :class:`Liveness`) up to
    date; these answers follow from them.
    """

    server_name: str
    handle: Any
    liveness: Liveness

    def status(self) -> ServerStatus:
        """``up`` while the server answers pings, else ``down``."""
        return "up" if self.liveness.state in ("alive", "pending") else "down"

    def servers(self) -> dict[str, Any]:
        """The one server, by name."""
        return {self.server_name: self.handle}

    @property
    def num_applied(self) -> int:
        """Gradients in the server's state at the last ping."""
        return self.liveness.health.num_applied if self.liveness.health else 0
