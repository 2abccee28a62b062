"""``checkpoint``: periodic durable checkpoints; Ray restarts a killed server, which reloads.

Server: after every ``every``-th step the push's thread writes a checkpoint (see
:mod:`bubbleguard.ps.checkpointing`) before acknowledging, so checkpoint cost shows up as lost
throughput. The actor has unlimited Ray restarts; a restarted process loads the newest
committed checkpoint (or the initial state if none committed yet). Updates acknowledged after
that checkpoint are lost, and counted as such.

Workers: a failed pull or push is retried, with the same update id, until the server answers:
workers wait out the outage. The restarted server applies a retried gradient unless its state
already holds it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ray

from bubbleguard.ps.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from bubbleguard.ps.core.messages import Ack, Gradient, Weights
from bubbleguard.ps.core.records import Event, PushOutcome
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.runtime.membership import Membership, ShardView, actor_name, lookup_actor
from bubbleguard.ps.runtime.server import ServerIdentity, ShardServer
from bubbleguard.ps.strategies.base import (
    Liveness,
    OneServerStatus,
    ShardClient,
    Strategy,
    call_until_done,
    create_server,
    wait_ready,
)


class CheckpointServer(ShardServer):
    """A shard server that checkpoints every ``options["every"]`` steps and reloads on start.

    Options: ``directory`` (checkpoint root), ``every`` (steps), ``keep`` (committed
    checkpoints kept).
    """

    def _starting_state(self) -> tuple[ShardState, str]:
        opts = self.spec.options
        info = latest_checkpoint(opts["directory"], self.spec.shard)
        if info is None:
            return self.spec.initial, "initial"
        return load_checkpoint(info, self.spec.layout), f"checkpoint:{info.seq}"

    def _after_push(self, ack: Ack) -> Ack:
        opts = self.spec.options
        if ack.step_version is not None and self._state.version % opts["every"] == 0:
            with self._lock:
                frozen = self._state.freeze()
            # Written before the acknowledgement, on the push thread: the cost is visible as
            # throughput, and no later step can interleave with the snapshot.
            save_checkpoint(opts["directory"], frozen, self.spec.layout, keep=opts["keep"])
        return ack


class RetryingClient(ShardClient):
    """Worker side of ``checkpoint`` (and ``baseline``): wait and retry until the server answers."""

    def __init__(self, shard: int, run_id: str) -> None:
        super().__init__(shard, run_id)
        self._server: Any = None

    def connect(self) -> None:
        """Find the published server."""
        view = Membership(self.run_id).view(self.shard)
        self._server = lookup_actor(view.head) if view is not None else None
        if self._server is None:
            raise RuntimeError(f"no server published for shard {self.shard}")

    def pull(self, deadline: float) -> Weights | None:
        """The server's weights, once it answers."""
        weights: Weights | None = call_until_done(self._server.pull, None, deadline)
        return weights

    def push(self, grad: Gradient, deadline: float) -> tuple[PushOutcome, Ack | None]:
        """Push until acknowledged (``failed`` if the deadline passes first)."""
        ack: Ack | None = call_until_done(self._server.push, grad, deadline)
        return ("acked", ack) if ack is not None else ("failed", None)


class SingleServerStrategy(OneServerStatus, Strategy):
    """One server per shard, restarted by Ray when ``max_restarts`` allows.

    Subclasses set ``server_class``, ``max_restarts`` and :meth:`server_options`.
    """

    server_class: type[ShardServer] = ShardServer
    max_restarts = 0

    def server_options(self) -> dict[str, Any]:
        """Options passed to the server (see the server class)."""
        return {}

    def start(self) -> None:
        """Create the server and wait until it serves."""
        self.server_name = actor_name(self.ctx.run_id, f"shard{self.ctx.shard}", "server")
        self.handle = create_server(
            self.ctx, self.server_class, self.server_name, max_restarts=self.max_restarts, **self.server_options()
        )
        self.identity: ServerIdentity = wait_ready(self.handle)
        self.liveness = Liveness(self.handle)
        # Ray restarts the same actor, so the published view never changes.
        self.membership.set_view(self.ctx.shard, ShardView(0, (self.server_name,)))

    def client(self) -> ShardClient:
        """A waiting, retrying client."""
        return RetryingClient(self.ctx.shard, self.ctx.run_id)

    def reader(self) -> Any | None:
        """The server, when it answers pings."""
        return self.handle if self.liveness.state in ("alive", "pending") else None

    def victim(self, target: str) -> tuple[str, Any]:
        """The server (the only role)."""
        if target != "server":
            raise ValueError(f"the {self.name} strategy has no {target!r} node")
        return self.server_name, self.handle

    def poll(self, now: float) -> list[Event]:
        """Notice a restarted server: its ping reports a new incarnation."""
        self.liveness.poll(now)
        health = self.liveness.health
        if self.liveness.state == "alive" and health and health.incarnation != self.identity.incarnation:
            self.identity = ray.get(self.handle.identity.remote())
            detail = f"restarted from {self.identity.started_from} at version {self.identity.start_version}"
            return [Event(self.identity.ready_at, "recovered", self.ctx.shard, self.server_name, detail)]
        return []


class CheckpointStrategy(SingleServerStrategy):
    """Checkpoint-restart (see the module docstring)."""

    name = "checkpoint"
    server_class = CheckpointServer
    max_restarts = -1

    def server_options(self) -> dict[str, Any]:
        """Checkpoint directory, interval and retention."""
        cfg = self.ctx.config.checkpoint
        # One directory per run, so runs sharing a root never load each other's checkpoints.
        root = Path(cfg.directory) if cfg.directory else self.ctx.workdir / "checkpoints"
        return {"directory": str(root / self.ctx.run_id), "every": cfg.every, "keep": cfg.keep}
