"""``stateless``: the server keeps no state of its own; workers compute through its outages.

State. Each shard has a state store actor (never a fault target). Before acknowledging a push
the server writes through to it (grouped: concurrent pushes share one commit): the whole
parameter vector and the new log rows travel through Ray's object store into the store's
memory, and a background thread of the store writes a durable copy (a checkpoint) every
``persist_every`` steps. A new server process starts from the store, or from the durable copy
if the store lost its memory (a restarted store reloads it), so no acknowledged update is lost.
(Ray 2.60 removed ``ray.put(_owner=...)``: an object put by the server would be owned by it and
die with it, which is why the state is held by the store's process.)

Outage. The driver's supervisor notices the dead server (failed ping) and starts a replacement
at once, which serves once the injected outage is over; then it publishes its name in the shard's view (Ray's
key-value store). Meanwhile each worker keeps computing on the last weights it has, buffers its
gradients (:class:`GradientBuffer`: bounded, with the documented overflow policy) and looks for
a newly published server a few times a second. When the server answers, the worker hands its
backlog over in one call and the server applies it as one
step under the chosen policy (:mod:`bubbleguard.ps.core.optim`). Each buffered gradient is
applied exactly once: a hand-over that fails is sealed and offered again, and the server skips
entries it already holds.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from bubbleguard.ps.checkpointing import latest_checkpoint, load_checkpoint, save_checkpoint
from bubbleguard.ps.core.buffer import GradientBuffer
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.messages import Ack, BacklogEntry, Gradient, Weights, WireTensors
from bubbleguard.ps.core.records import Event, PushOutcome
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.runtime.cluster import NAMESPACE
from bubbleguard.ps.runtime.membership import Membership, ShardView, actor_name, lookup_actor
from bubbleguard.ps.runtime.server import ServerIdentity, ShardServer
from bubbleguard.ps.strategies.base import (
    Liveness,
    OneServerStatus,
    ShardClient,
    Strategy,
    create_server,
    wait_ready,
)

PROBE_INTERVAL_S = 0.1
"""How often a worker whose server is down looks it up again."""


@dataclass(frozen=True)
class StateCommit(WireTensors):
    """What a server sends its store after a step: the whole state but only the new log rows."""

    version: int
    params: torch.Tensor
    momentum: torch.Tensor
    new_log: torch.Tensor


class StateStore:
    """Holds one shard's latest state outside any server process, and its durable copy.

    Args:
        shard: the shard.
        layout: the parameter layout (for the durable copy).
        directory: where the durable copy goes.
        persist_every: steps between durable copies.
    """

    def __init__(self, shard: int, layout: ParamLayout, directory: str, persist_every: int) -> None:
        torch.set_num_threads(1)
        self._shard, self._layout, self._directory = shard, layout, directory
        self._persist_every = persist_every
        self._lock = threading.Lock()
        self._latest: StateCommit | None = None
        self._log_parts: list[torch.Tensor] = []
        self._persisted_version = 0
        # A restarted store starts from the durable copy.
        info = latest_checkpoint(directory, shard)
        if info is not None:
            state = load_checkpoint(info, layout)
            self._latest = StateCommit(state.version, state.params, state.momentum, state.log)
            self._log_parts = [state.log]
            self._persisted_version = state.version
        self._wake = threading.Event()
        threading.Thread(target=self._persist_loop, daemon=True).start()

    def commit(self, update: StateCommit) -> int:
        """Take the state after ``update.version`` steps; the version taken."""
        with self._lock:
            if self._latest is None or update.version > self._latest.version:
                self._latest = update
            if update.new_log.numel():
                self._log_parts.append(update.new_log)
            due = self._latest.version - self._persisted_version >= self._persist_every
        if due:
            self._wake.set()
        return update.version

    def latest(self) -> ShardState | None:
        """The latest committed state, or ``None`` before the first commit."""
        with self._lock:
            if self._latest is None:
                return None
            latest = self._latest
            log = torch.cat(self._log_parts) if self._log_parts else torch.zeros((0, 3), dtype=torch.int64)
            self._log_parts = [log]
        return ShardState(self._shard, latest.params.clone(), latest.momentum.clone(), latest.version, log)

    def _persist_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            state = self.latest()
            if state is not None and state.version > self._persisted_version:
                save_checkpoint(self._directory, state, self._layout)
                self._persisted_version = state.version


class StatelessServer(ShardServer):
    """A server whose state lives in the shard's :class:`StateStore`.

    Pushes run on several threads (the default group is widened), serialised by the state lock,
    and a push is acknowledged only once the store holds a state that contains it. Commits are
    grouped: one thread at a time sends the latest state to the store, and every push applied
    before that snapshot is acknowledged by it, so concurrent pushes share one round trip.

    Options: ``store`` (the store's actor name), ``durable`` (the durable copy's directory),
    ``policy`` and ``backlog_lr_scale`` (how a backlog becomes one step).
    """

    _store: Any
    _commit: threading.Condition
    _committing: bool
    _committed_version: int
    _committed_rows: int

    def _starting_state(self) -> tuple[ShardState, str]:
        opts = self.spec.options
        self._store = ray.get_actor(opts["store"], namespace=NAMESPACE)
        state = ray.get(self._store.latest.remote())
        if state is not None:
            origin = "store"
        else:
            info = latest_checkpoint(opts["durable"], self.spec.shard)
            if info is not None:
                state, origin = load_checkpoint(info, self.spec.layout), "durable"
            else:
                state, origin = self.spec.initial, "initial"
        self._commit = threading.Condition()
        self._committing = False
        self._committed_version = state.version
        self._committed_rows = state.num_applied
        return state, origin

    def _after_push(self, ack: Ack) -> Ack:
        if ack.applied_uids:
            self._wait_committed(ack.state_version)
        return ack

    def _wait_committed(self, version: int) -> None:
        """Block until the store holds a state of at least ``version`` (leader/follower)."""
        while True:
            with self._commit:
                while self._committing and self._committed_version < version:
                    self._commit.wait()
                if self._committed_version >= version:
                    return
                self._committing = True
            committed = None
            try:
                committed = self._commit_latest()
            finally:
                with self._commit:
                    if committed is not None:
                        self._committed_version = max(self._committed_version, committed)
                    self._committing = False
                    self._commit.notify_all()

    def _commit_latest(self) -> int:
        with self._lock:
            state = self._state
            version, rows_now = state.version, state.num_applied
            params, momentum = state.params.clone(), state.momentum.clone()
            rows = state.log_since(self._committed_rows)
        ray.get(self._store.commit.remote(StateCommit(version, params, momentum, rows)))
        self._committed_rows = rows_now
        return version

    def push_backlog(self, entries: list[BacklogEntry]) -> Ack:
        """Apply one worker's backlog as one step (see :meth:`LiveShardState.apply_backlog`)."""
        opts = self.spec.options
        with self._lock:
            ack = self._state.apply_backlog(
                entries, policy=opts["policy"], backlog_lr_scale=opts["backlog_lr_scale"]
            )
        return self._after_push(ack)


class StatelessClient(ShardClient):
    """Worker side of ``stateless``: never waits for the server (see the module docstring)."""

    def __init__(self, shard: int, run_id: str, buffer_cap: int, overflow: str) -> None:
        super().__init__(shard, run_id)
        self.buffer_cap, self.overflow = buffer_cap, overflow

    def connect(self) -> None:
        """Find the published server; create the buffer."""
        self._membership = Membership(self.run_id)
        view = self._membership.view(self.shard)
        self._server: Any = lookup_actor(view.head) if view else None
        if view is None or self._server is None:
            raise RuntimeError(f"no server published for shard {self.shard}")
        self._epoch = view.epoch
        self._down = False
        self._weights: Weights | None = None
        self._buffer = GradientBuffer(self.buffer_cap, self.overflow)
        self._acks: list[Ack] = []
        self._probe: Any = None
        self._probe_handle: Any = None
        self._last_lookup = 0.0

    def _fetch(self) -> None:
        try:
            self._weights = ray.get(self._server.pull.remote())
        except RayActorError:
            self._down = True

    def pull(self, deadline: float) -> Weights | None:
        """Fresh weights if the server answers, else the last ones this worker had."""
        if self._down:
            self._try_recover()
        if not self._down:
            self._fetch()
        # A worker's first pull must reach a server: it has no weights to reuse yet.
        while self._weights is None and time.time() < deadline:
            time.sleep(PROBE_INTERVAL_S)
            self._try_recover()
            if not self._down:
                self._fetch()
        return self._weights

    def push(self, grad: Gradient, deadline: float) -> tuple[PushOutcome, Ack | None]:
        """Push if the server is up; otherwise buffer. A push that fails is buffered as
        uncertain (the server may have applied it before dying)."""
        if self._down:
            self._buffer.add(grad)
            return "buffered", None
        try:
            return "acked", ray.get(self._server.push.remote(grad))
        except RayActorError:
            self._down = True
            self._buffer.add(grad, uncertain=True)
            return "buffered", None

    def _try_recover(self) -> None:
        """Non-blocking: look for a newly published server, ping it, and hand the backlog over
        once it answers."""
        now = time.time()
        if self._probe is None:
            if now - self._last_lookup < PROBE_INTERVAL_S:
                return
            self._last_lookup = now
            view = self._membership.view(self.shard)
            if view is None or view.epoch <= self._epoch:
                return
            self._probe_handle = lookup_actor(view.head)
            if self._probe_handle is None:
                return
            self._probe_epoch = view.epoch
            self._probe = self._probe_handle.ping.remote()
        ready, _ = ray.wait([self._probe], timeout=0)
        if not ready:
            return
        probe, self._probe = self._probe, None
        try:
            ray.get(probe)
        except RayActorError:
            return
        self._server, self._epoch, self._down = self._probe_handle, self._probe_epoch, False
        self._hand_over()

    def _hand_over(self) -> None:
        entries = self._buffer.entries()
        if not entries:
            return
        try:
            ack = ray.get(self._server.push_backlog.remote(entries))
        except RayActorError:
            self._buffer.seal()
            self._down = True
            return
        self._buffer.clear()
        self._acks.append(ack)

    def take_acks(self) -> list[Ack]:
        """Acknowledgements of handed-over backlogs since the last call."""
        acks, self._acks = self._acks, []
        return acks

    def settle(self, deadline: float) -> None:
        """Hand the backlog over once the server is back, looking for it until ``deadline``
        (a replacement not yet published by then leaves the backlog pending)."""
        if self._down:
            self._last_lookup = 0.0
            self._try_recover()
            while self._down and time.time() < deadline:
                time.sleep(0.01)
                self._try_recover()
        elif len(self._buffer):
            self._hand_over()

    def num_pending(self) -> int:
        """Gradients buffered and not yet handed over."""
        return self._buffer.num_gradients

    def dropped_uids(self) -> list[int]:
        """Ids the overflow policy discarded."""
        return list(self._buffer.dropped_uids)


class StatelessStrategy(OneServerStatus, Strategy):
    """Stateless server with worker-side buffering (see the module docstring)."""

    name = "stateless"
    PUSH_THREADS = 8
    """Threads serving pushes, so that concurrent pushes can share a commit."""

    def start(self) -> None:
        """Create the state store and the first server, and publish it."""
        cfg, ctx = self.ctx.config.stateless, self.ctx
        store_name = actor_name(ctx.run_id, f"shard{ctx.shard}", "store")
        durable = str(ctx.workdir / "durable" / ctx.run_id)
        Path(durable).mkdir(parents=True, exist_ok=True)
        self.store: Any = ray.remote(StateStore).options(
            name=store_name, namespace=NAMESPACE, num_cpus=0, max_restarts=-1
        ).remote(ctx.shard, ctx.layout, durable, cfg.persist_every)
        self._options = {
            "store": store_name,
            "durable": durable,
            "policy": cfg.policy,
            "backlog_lr_scale": cfg.backlog_lr_scale,
        }
        self._num_created = 0
        self._view = ShardView(-1, ())
        self.server_name, self.handle = self._create()
        self.identity: ServerIdentity = wait_ready(self.handle)
        self.liveness = Liveness(self.handle)
        self._publish()
        self._replacement: tuple[str, Liveness] | None = None

    def _create(self, replaces: str | None = None) -> tuple[str, Any]:
        name = actor_name(self.ctx.run_id, f"shard{self.ctx.shard}", f"server{self._num_created}")
        self._num_created += 1
        handle = create_server(
            self.ctx, StatelessServer, name, max_concurrency=self.PUSH_THREADS, replaces=replaces, **self._options
        )
        return name, handle

    def _publish(self) -> None:
        self._view = ShardView(self._view.epoch + 1, (self.server_name,))
        self.membership.set_view(self.ctx.shard, self._view)

    def client(self) -> ShardClient:
        """A buffering client."""
        cfg = self.ctx.config.stateless
        return StatelessClient(self.ctx.shard, self.ctx.run_id, cfg.buffer_cap, cfg.overflow)

    def reader(self) -> Any | None:
        """The server, while it answers pings."""
        return self.handle if self.liveness.state in ("alive", "pending") else None

    def victim(self, target: str) -> tuple[str, Any]:
        """The server (the only role)."""
        if target != "server":
            raise ValueError(f"the stateless strategy has no {target!r} node")
        return self.server_name, self.handle

    def poll(self, now: float) -> list[Event]:
        """Start a replacement as soon as the server is dead (it serves once the outage is
        over); publish it once it answers."""
        if self._replacement is None:
            if self.liveness.poll(now) != "dead":
                return []
            name, handle = self._create(replaces=self.server_name)
            self._replacement = (name, Liveness(handle))
        name, liveness = self._replacement
        if liveness.poll(now) != "alive":
            return []
        self.server_name, self.handle, self.liveness = name, liveness.handle, liveness
        self._replacement = None
        self._publish()
        self.identity = ray.get(self.handle.identity.remote())
        detail = f"{name} started from the {self.identity.started_from} at version {self.identity.start_version}"
        return [Event(self.identity.ready_at, "recovered", self.ctx.shard, name, detail)]

    def stop(self) -> None:
        """Kill the server, a replacement being started, and the store."""
        super().stop()
        if self._replacement is not None:
            ray.kill(self._replacement[1].handle, no_restart=True)
        ray.kill(self.store, no_restart=True)
