"""``chain``: chain replication, head -> ... -> tail, per shard.

Per-update mode (default). Workers push to the head. Each node applies the update and forwards
it to its successor on its (single) push thread, so at most one update is in flight down the
chain and every node applies the same updates in the same order; the tail's answer travels back
as the acknowledgement. Workers read from the tail, whose state holds only acknowledged updates.
No acknowledged update can be lost while one node survives.

Periodic mode (``replicate_every = n``, the paper's). The head acknowledges at once and every
``n`` steps copies its whole state down the chain. Workers read from the head. On head failure
the successor takes over with the last copy: up to ``n - 1`` acknowledged updates are lost.

Failures (detected by the driver's supervisor through a failed ping, never told by the
injector):

- head: removed from the chain; its successor becomes the head. A push that failed is retried by
  its worker on the new head with the same id: applied if it never got there, acknowledged as a
  duplicate (and forwarded again, in case it stopped half-way) if it did.
- middle: removed; its predecessor is linked to its successor (``set_successor``) and re-sends
  the update it was forwarding, which the successor applies or recognises.
- tail: removed; its predecessor becomes the tail.
- replacement: a new node is started at once and, once the dead node's injected outage is
  over, joins at the tail: the tail sends it its state and links it, on the tail's push thread,
  so no update slips between the copy and the link.

The chain is published in Ray's key-value store (``view/<shard>``: epoch and node names);
workers cache it and re-read it when a node fails them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import RayActorError

from bubbleguard.ps.core.messages import Ack, Gradient, Weights
from bubbleguard.ps.core.records import Event, PushOutcome, ServerStatus
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.runtime.membership import Membership, ShardView, actor_name, lookup_actor
from bubbleguard.ps.runtime.server import ServerSpec, ShardServer
from bubbleguard.ps.strategies.base import (
    RETRY_INTERVAL_S,
    Liveness,
    ShardClient,
    Strategy,
    create_server,
    wait_ready,
)

RELINK_TIMEOUT_S = 60.0
"""How long a node waits for a new successor after its successor died before it gives up."""


class ChainServer(ShardServer):
    """One node of a chain.

    Options: ``per_update`` (forward every update before acknowledging), ``replicate_every``
    (periodic mode's interval), ``join`` (a replacement that waits for a state transfer).
    """

    def __init__(self, spec: ServerSpec) -> None:
        self._link = threading.Condition()
        self._successor_name: str | None = None
        self._successor: Any = None
        self._link_epoch = 0
        super().__init__(spec)

    def _starting_state(self) -> tuple[ShardState, str]:
        if self.spec.options.get("join"):
            # Placeholder until the tail's state transfer (install_state) replaces it; the node
            # is published only after that.
            return self.spec.initial, "awaiting-transfer"
        return self.spec.initial, "initial"

    # -- default group -------------------------------------------------------------------------

    def push(self, grad: Gradient) -> Ack:
        """Apply ``grad`` here and, in per-update mode, down the chain before acknowledging."""
        with self._lock:
            ack = self._state.apply(grad)
        opts = self.spec.options
        if opts["per_update"]:
            down: Ack | None = self._forward(lambda node: node.push.remote(grad))
            # Same updates in the same order on every node: states must agree bit for bit.
            assert down is None or down.state_digest == ack.state_digest, (
                f"{self.spec.name} and its successor diverged at version {ack.state_version}"
            )
        elif ack.step_version is not None and self._state.version % opts["replicate_every"] == 0:
            with self._lock:
                snapshot = self._state.freeze()
            self._forward(lambda node: node.replace_state.remote(snapshot))
        return ack

    def replace_state(self, state: ShardState) -> int:
        """Periodic mode: take the predecessor's state and pass it on; the version taken."""
        with self._lock:
            self._state.replace(state)
        self._forward(lambda node: node.replace_state.remote(state))
        return state.version

    def install_state(self, state: ShardState) -> int:
        """State transfer to a joining node; the version installed."""
        with self._lock:
            self._state.replace(state)
        return state.version

    def attach_successor(self, name: str) -> int:
        """Tail only: copy this node's state to ``name`` and make it the successor.

        Runs on the push thread, so nothing is applied between the copy and the link.
        Returns the version transferred.
        """
        handle = lookup_actor(name)
        if handle is None:
            raise ValueError(f"cannot attach {name}: no such actor")
        with self._lock:
            snapshot = self._state.freeze()
        ray.get(handle.install_state.remote(snapshot))
        self._relink(name, handle)
        return snapshot.version

    def _forward(self, call: Callable[[Any], Any]) -> Any:
        """Send ``call`` to the successor and wait for its answer; ``None`` at the tail.

        If the successor dies, wait for the supervisor to link a new one and send again.
        """
        while True:
            with self._link:
                successor, epoch = self._successor, self._link_epoch
            if successor is None:
                return None
            try:
                return ray.get(call(successor))
            except RayActorError:

                def relinked_since(seen: int = epoch) -> bool:
                    return self._link_epoch != seen

                with self._link:
                    relinked = self._link.wait_for(relinked_since, timeout=RELINK_TIMEOUT_S)
                if not relinked:
                    raise RuntimeError(
                        f"{self.spec.name}: successor {self._successor_name} died and no new link "
                        f"arrived within {RELINK_TIMEOUT_S:g} s"
                    ) from None

    # -- control group ---------------------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def set_successor(self, name: str | None) -> None:
        """Link to ``name`` (``None``: become the tail); wakes a forward waiting on a dead node."""
        handle = lookup_actor(name) if name else None
        if name and handle is None:
            raise ValueError(f"cannot link to {name}: no such actor")
        self._relink(name, handle)

    @ray.method(concurrency_group="control")
    def successor(self) -> str | None:
        """The successor's name (``None`` at the tail)."""
        return self._successor_name

    def _relink(self, name: str | None, handle: Any) -> None:
        with self._link:
            self._successor_name, self._successor = name, handle
            self._link_epoch += 1
            self._link.notify_all()


class ChainClient(ShardClient):
    """Worker side of ``chain``: push to the head, read from the tail (or the head in periodic
    mode); on a failed call, wait for the supervisor to publish the next chain and retry."""

    def __init__(self, shard: int, run_id: str, per_update: bool) -> None:
        super().__init__(shard, run_id)
        self.per_update = per_update
        self._view: ShardView | None = None
        self._handles: dict[str, Any] = {}

    def connect(self) -> None:
        """Read the published chain."""
        self._membership = Membership(self.run_id)
        self._view = self._membership.view(self.shard)
        if self._view is None:
            raise RuntimeError(f"no servers published for shard {self.shard}")

    def _handle(self, name: str) -> Any:
        if name not in self._handles:
            self._handles[name] = lookup_actor(name)
        return self._handles[name]

    def _call(self, pick: Callable[[ShardView], str], method: str, arg: Any, deadline: float) -> Any:
        while time.time() < deadline:
            assert self._view is not None
            view = self._view
            handle = self._handle(pick(view))
            if handle is not None:
                try:
                    return ray.get(getattr(handle, method).remote(*(() if arg is None else (arg,))))
                except RayActorError:
                    pass
            self._await_new_view(view.epoch, deadline)
        return None

    def _await_new_view(self, epoch: int, deadline: float) -> None:
        while time.time() < deadline:
            view = self._membership.view(self.shard)
            if view is not None and view.epoch > epoch:
                self._view = view
                self._handles = {n: h for n, h in self._handles.items() if n in view.nodes}
                return
            time.sleep(RETRY_INTERVAL_S)

    def pull(self, deadline: float) -> Weights | None:
        """Weights from the tail (per-update) or the head (periodic)."""
        weights: Weights | None = self._call(
            (lambda v: v.tail) if self.per_update else (lambda v: v.head), "pull", None, deadline
        )
        return weights

    def push(self, grad: Gradient, deadline: float) -> tuple[PushOutcome, Ack | None]:
        """Push to the head until some head acknowledges it."""
        ack: Ack | None = self._call(lambda v: v.head, "push", grad, deadline)
        return ("acked", ack) if ack is not None else ("failed", None)


@dataclass
class _Joining:
    name: str
    handle: Any
    liveness: Liveness
    attach: Any = None
    started: float = field(default_factory=time.time)


class ChainStrategy(Strategy):
    """Chain replication for one shard (see the module docstring)."""

    name = "chain"

    def start(self) -> None:
        """Create the chain, link it, publish it."""
        cfg = self.ctx.config.chain
        self._num_created = 0
        names = [self._next_name() for _ in range(cfg.length)]
        self._nodes = {n: self._create(n, join=False) for n in names}
        for handle in self._nodes.values():
            wait_ready(handle)
        for a, b in zip(names, names[1:], strict=False):
            ray.get(self._nodes[a].set_successor.remote(b))
        self._liveness = {n: Liveness(h) for n, h in self._nodes.items()}
        self._view = ShardView(0, tuple(names))
        self.membership.set_view(self.ctx.shard, self._view)
        self._to_replace: list[str] = []
        self._joining: _Joining | None = None

    def _next_name(self) -> str:
        name = actor_name(self.ctx.run_id, f"shard{self.ctx.shard}", f"node{self._num_created}")
        self._num_created += 1
        return name

    def _create(self, name: str, *, join: bool, replaces: str | None = None) -> Any:
        cfg = self.ctx.config.chain
        return create_server(
            self.ctx,
            ChainServer,
            name,
            replaces=replaces,
            per_update=cfg.per_update,
            replicate_every=cfg.replicate_every,
            join=join,
        )

    @property
    def view(self) -> ShardView:
        """The chain as last published."""
        return self._view

    def client(self) -> ShardClient:
        """A chain client."""
        return ChainClient(self.ctx.shard, self.ctx.run_id, self.ctx.config.chain.per_update)

    def reader(self) -> Any | None:
        """The tail (per-update) or the head (periodic), if alive."""
        name = self._view.tail if self.ctx.config.chain.per_update else self._view.head
        return self._nodes[name] if self._liveness[name].state in ("alive", "pending") else None

    def victim(self, target: str) -> tuple[str, Any]:
        """Head for ``server``, the middle node, or the tail."""
        nodes = self._view.nodes
        if target == "server":
            name = nodes[0]
        elif target == "tail":
            name = nodes[-1]
        elif target == "middle":
            if len(nodes) < 3:
                raise ValueError(f"the chain of shard {self.ctx.shard} has no middle node now: {nodes}")
            name = nodes[len(nodes) // 2]
        else:
            raise ValueError(f"the chain strategy has no {target!r} node")
        return name, self._nodes[name]

    def poll(self, now: float) -> list[Event]:
        """Remove dead nodes, then start or finish a replacement."""
        events = []
        for name in list(self._view.nodes):
            if self._liveness[name].poll(now) == "dead":
                events.append(self._remove(name, now))
        joined = self._advance_replacement(now)
        if joined is not None:
            events.append(joined)
        return events

    def _publish(self, nodes: list[str]) -> None:
        self._view = ShardView(self._view.epoch + 1, tuple(nodes))
        self.membership.set_view(self.ctx.shard, self._view)

    def _remove(self, name: str, now: float) -> Event:
        nodes = list(self._view.nodes)
        i = nodes.index(name)
        nodes.pop(i)
        if not nodes:
            raise RuntimeError(f"every node of shard {self.ctx.shard}'s chain failed; nothing to recover from")
        role = "head" if i == 0 else ("tail" if i == len(nodes) else "middle")
        if i > 0:
            successor = nodes[i] if i < len(nodes) else None
            ray.get(self._nodes[nodes[i - 1]].set_successor.remote(successor), timeout=30)
        self._publish(nodes)
        del self._nodes[name], self._liveness[name]
        self._to_replace.append(name)
        detail = f"{role} removed; head {self._view.head}, tail {self._view.tail}"
        return Event(time.time(), "recovered", self.ctx.shard, name, detail)

    def _advance_replacement(self, now: float) -> Event | None:
        if self._joining is None:
            if not self._to_replace:
                return None
            # Started at once; the process waits out the dead node's outage before it serves.
            dead = self._to_replace.pop(0)
            name = self._next_name()
            handle = self._create(name, join=True, replaces=dead)
            self._joining = _Joining(name, handle, Liveness(handle))
        joining = self._joining
        if joining.attach is None:
            if joining.liveness.poll(now) == "alive":
                joining.attach = self._nodes[self._view.tail].attach_successor.remote(joining.name)
            return None
        ready, _ = ray.wait([joining.attach], timeout=0)
        if not ready:
            return None
        try:
            version = ray.get(joining.attach)
        except RayActorError:
            joining.attach = None  # the tail died meanwhile; attach to the next tail
            return None
        self._nodes[joining.name] = joining.handle
        self._liveness[joining.name] = joining.liveness
        self._publish([*self._view.nodes, joining.name])
        self._joining = None
        return Event(time.time(), "rejoined", self.ctx.shard, joining.name, f"joined at the tail with version {version}")

    def status(self) -> ServerStatus:
        """``down`` with no live node, ``degraded`` while shorter than configured, else ``up``."""
        if not any(self._liveness[n].state in ("alive", "pending") for n in self._view.nodes):
            return "down"
        return "degraded" if len(self._view.nodes) < self.ctx.config.chain.length else "up"

    def servers(self) -> dict[str, Any]:
        """The chain's nodes, head first, plus a joining node."""
        out = {n: self._nodes[n] for n in self._view.nodes}
        if self._joining is not None:
            out[self._joining.name] = self._joining.handle
        return out

    @property
    def num_applied(self) -> int:
        """Gradients in the head's state at the last ping."""
        health = self._liveness[self._view.head].health
        return health.num_applied if health else 0
