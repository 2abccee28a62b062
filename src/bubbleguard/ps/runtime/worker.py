"""The worker actor: gate, pull, compute, push, repeat.

One iteration, in order:

1. **gate**: under a staleness bound, wait until the slowest worker is close enough (asks the
   clock service only when the cached lower bound of the slowest clock is too low);
2. **pull** every shard's weights through its :class:`ShardClient` (which may wait for a
   restarting server, or hand back cached weights while a stateless server is down);
3. **compute** the gradient of one seeded minibatch of the worker's data shard;
4. **push** it to every shard under one update id (acknowledged, or buffered);
5. **advance** the worker's clock (fire-and-forget to the clock service; under eventual
   consistency nobody waits on it, so it is reported only with the records).

Records of every iteration and acknowledgement go to the recorder a few times a second. Ray
restarts a killed worker (after its injected outage); it comes back with a new incarnation, so
its update ids never collide with its predecessor's, and resumes from its clock.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import ray
import torch

from bubbleguard.ps.core.consistency import must_wait
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.messages import Ack, Gradient, make_update_id
from bubbleguard.ps.core.records import AckRecord, IterationRecord, PushOutcome
from bubbleguard.ps.runtime.cluster import NAMESPACE
from bubbleguard.ps.runtime.membership import Membership
from bubbleguard.ps.training.data import MinibatchSampler, worker_shard
from bubbleguard.ps.training.model import FlatModel, ModelFactory, build_model

if TYPE_CHECKING:
    # Only the interface: strategies build on the runtime, not the other way round.
    from bubbleguard.ps.strategies.base import ShardClient

FLUSH_EVERY_S = 0.25
"""How often a worker sends its records to the recorder."""


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to start.

    Attributes:
        run_id: the run.
        index: worker index.
        name: Ray actor name.
        num_workers: workers in the run (for the data shard).
        clients: one client per shard.
        layout: the parameter layout.
        model_factory: builds the model.
        input_shape: ``(C, H, W)``.
        num_classes: classes.
        batch_size: examples per gradient.
        seed: run seed.
        delay_s: extra seconds per gradient (a straggler).
        bound: staleness bound in clocks (``None``: eventual).
        clock_service: name of the clock actor.
        recorder: name of the recorder actor.
        data_host: name of the actor holding the training split.
        niceness: added to the process's nice value (see ``ResourceConfig.worker_niceness``).
    """

    run_id: str
    index: int
    name: str
    num_workers: int
    clients: tuple[ShardClient, ...]
    layout: ParamLayout
    model_factory: ModelFactory
    input_shape: tuple[int, int, int]
    num_classes: int
    batch_size: int
    seed: int
    delay_s: float
    bound: int | None
    clock_service: str
    recorder: str
    data_host: str
    niceness: int = 0


@dataclass(frozen=True)
class WorkerIdentity:
    """Who a worker process is (what the fault injector kills)."""

    name: str
    pid: int
    node_id: str
    incarnation: int
    ready_at: float


@dataclass(frozen=True)
class WorkerReport:
    """What :meth:`Worker.run` returns."""

    worker: int
    incarnation: int
    num_iterations: int
    num_pending: int
    dropped_uids: tuple[int, ...]


class Worker:
    """A worker actor (see the module docstring).

    Args:
        spec: the worker's configuration.
    """

    def __init__(self, spec: WorkerSpec) -> None:
        torch.set_num_threads(1)
        if spec.niceness:
            os.nice(spec.niceness)
        self.spec = spec
        data_host: Any = ray.get_actor(spec.data_host, namespace=NAMESPACE)
        train_x: np.ndarray
        train_y: np.ndarray
        train_x, train_y = ray.get(data_host.arrays.remote())
        membership = Membership(spec.run_id)
        self.incarnation: int = membership.next_incarnation(spec.name)
        membership.wait_out_outage(spec.name)
        indices = worker_shard(len(train_x), spec.num_workers, spec.index, spec.seed)
        self._x: torch.Tensor = torch.from_numpy(np.ascontiguousarray(train_x[indices]))
        self._y: torch.Tensor = torch.from_numpy(np.ascontiguousarray(train_y[indices]))
        self._sampler: MinibatchSampler = MinibatchSampler(
            np.arange(len(indices)), spec.batch_size, seed=spec.seed, worker=spec.index, incarnation=self.incarnation
        )
        module = build_model(spec.model_factory, spec.input_shape, spec.num_classes, spec.seed)
        self._model: FlatModel = FlatModel(module, spec.layout)
        self._clock_service: Any = ray.get_actor(spec.clock_service, namespace=NAMESPACE)
        self._recorder: Any = ray.get_actor(spec.recorder, namespace=NAMESPACE)
        # Clients connect on the first run(): the job creates workers while the servers are
        # still starting, so the two start-ups overlap.
        self._connected = False
        self._clock: int = cast(int, ray.get(self._clock_service.clock_of.remote(spec.index)))
        self._known_min: int = 0
        self._seq: int = 0
        self._iterations: list[IterationRecord] = []
        self._acks: list[AckRecord] = []
        self._ready_at: float = time.time()

    @ray.method(concurrency_group="control")
    def identity(self) -> WorkerIdentity:
        """Process id, node, incarnation and start time."""
        return WorkerIdentity(
            self.spec.name, os.getpid(), ray.get_runtime_context().get_node_id(), self.incarnation, self._ready_at
        )

    def run(self, deadline: float) -> WorkerReport:
        """Train until ``deadline`` (``time.time()`` seconds), then settle pending pushes."""
        spec = self.spec
        if not self._connected:
            for client in spec.clients:
                client.connect()
            self._connected = True
        last_flush = time.time()
        num_iterations = 0
        while time.time() < deadline:
            t_start = time.time()
            if must_wait(self._clock, self._known_min, spec.bound):
                assert spec.bound is not None
                self._known_min, ok = ray.get(
                    self._clock_service.wait_min.remote(self._clock - spec.bound, deadline)
                )
                if not ok:
                    break
            t_gate = time.time()
            pulled = [c.pull(deadline) for c in spec.clients]
            if any(w is None for w in pulled):
                break
            weights = [w for w in pulled if w is not None]
            t_compute_start = time.time()
            self._model.load([w.values for w in weights])
            idx = torch.from_numpy(self._sampler.next_indices())
            loss, grads = self._model.gradient(self._x[idx], self._y[idx])
            if spec.delay_s:
                time.sleep(spec.delay_s)
            t_compute_end = time.time()
            uid = make_update_id(spec.index, self.incarnation, self._seq)
            self._seq += 1
            outcomes: list[PushOutcome] = []
            for client, w, g in zip(spec.clients, weights, grads, strict=True):
                outcome, ack = client.push(Gradient(uid, w.version, g), deadline)
                outcomes.append(outcome)
                if ack is not None:
                    self._record_ack(ack)
            t_end = time.time()
            self._iterations.append(
                IterationRecord(
                    spec.index, self.incarnation, uid, self._clock, t_start, t_gate,
                    t_compute_start, t_compute_end, t_end, loss,
                    tuple(w.version for w in weights), tuple(outcomes),
                )
            )
            num_iterations += 1
            for client in spec.clients:
                for ack in client.take_acks():
                    self._record_ack(ack)
            if "failed" in outcomes:
                break  # the deadline passed while a server was down; the clock stays
            self._clock += 1
            if spec.bound is not None:
                self._clock_service.advance.remote(spec.index, self._clock)
            if t_end - last_flush >= FLUSH_EVERY_S:
                self._flush()
                last_flush = t_end
        for client in spec.clients:
            client.settle(deadline + 1.0)
            for ack in client.take_acks():
                self._record_ack(ack)
        self._flush()
        return WorkerReport(
            spec.index,
            self.incarnation,
            num_iterations,
            sum(c.num_pending() for c in spec.clients),
            tuple(u for c in spec.clients for u in c.dropped_uids()),
        )

    def _record_ack(self, ack: Ack) -> None:
        self._acks.append(
            AckRecord(self.spec.index, ack.shard, time.time(), ack.uids, ack.state_version, ack.state_digest)
        )

    def _flush(self) -> None:
        if self._iterations or self._acks:
            self._recorder.add.remote(self._iterations, self._acks)
            self._iterations, self._acks = [], []
        if self.spec.bound is None:
            # Nobody waits on clocks under eventual consistency: report them only with the
            # records (a restarted worker resumes from here), not once per gradient.
            self._clock_service.advance.remote(self.spec.index, self._clock)
