"""A parameter-server training job on Ray: the driver's view of servers, workers and faults.

Call order::

    with RayCluster():                       # a cluster must be up before start()
        with PSJob(config) as job:           # validates, loads data, builds the model (no Ray yet)
            job.start()                      # clock service, recorder, servers, workers
            job.train(10.0, faults=plan)     # blocks; supervises, injects faults, evaluates
            job.kill("server")               # faults can also be injected by hand between calls
            job.wait_until_serving()
            job.train(5.0)
            states = job.server_states()     # the served state of every shard
        # close(): every actor of the job is killed, its key-value entries deleted

During :meth:`train` the driver loops every ``TICK_S``: each strategy's supervision step, the
fault schedule, restarting killed workers' training calls, and an evaluation every
``config.eval_every_s``. Iteration and acknowledgement records are drained from the recorder at
the end of every call.
"""

from __future__ import annotations

import math
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from bubbleguard.ps.config import FaultPlan, RunConfig
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.records import AckRecord, Event, IterationRecord, Sample, ServerStatus
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.runtime.clock import ClockService
from bubbleguard.ps.runtime.cluster import NAMESPACE
from bubbleguard.ps.runtime.datahost import DataHost
from bubbleguard.ps.runtime.faults import FaultSchedule, kill_actor
from bubbleguard.ps.runtime.membership import Membership, actor_name
from bubbleguard.ps.runtime.recorder import Recorder
from bubbleguard.ps.runtime.worker import Worker, WorkerIdentity, WorkerReport, WorkerSpec
from bubbleguard.ps.strategies import STRATEGY_CLASSES, ShardContext, Strategy
from bubbleguard.ps.training.data import DataSplits, load_dataset
from bubbleguard.ps.training.model import FlatModel, build_model, model_factory

TICK_S = 0.02
"""Period of the driver loop."""
READ_TIMEOUT_S = 0.5
"""An evaluation read unanswered this long counts the shard as unreadable."""
STOP_GRACE_S = 60.0
"""How long after the deadline workers may take to stop before the job gives up."""

_STATUS_ORDER: dict[ServerStatus, int] = {"up": 0, "degraded": 1, "down": 2}


class PSJob:
    """One parameter-server training job (see the module docstring).

    Args:
        config: the run configuration (validated here).
        workdir: where checkpoints and durable copies go (a temporary directory if ``None``).
        splits: the data, if already loaded (otherwise loaded from ``config.training.dataset``).
        run_id: names the job's actors and key-value entries (random if ``None``).
        progress: called with every evaluation sample.

    Raises:
        ValueError: invalid configuration or a data set that does not load.
        FileNotFoundError: a data set file that does not exist.
    """

    def __init__(
        self,
        config: RunConfig,
        *,
        workdir: str | Path | None = None,
        splits: DataSplits | None = None,
        run_id: str | None = None,
        progress: Callable[[Sample], None] | None = None,
    ) -> None:
        config.validate()
        self.config = config
        training = config.training
        self.splits = splits if splits is not None else load_dataset(training.dataset, training.seed)
        self.model_factory = model_factory(training.model)
        self.run_id = run_id or f"{config.strategy}-seed{training.seed}-{uuid.uuid4().hex[:8]}"
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="bubbleguard-ps-"))
        module = build_model(self.model_factory, self.splits.input_shape, self.splits.num_classes, training.seed)
        self.layout = ParamLayout.from_module(module, config.num_shards)
        flats = self.layout.flatten(dict(module.named_parameters()))
        momentum = training.momentum > 0
        self.initial_states = [ShardState.initial(k, flats[k], momentum=momentum) for k in range(config.num_shards)]
        self._eval_model = FlatModel(module, self.layout)
        self._test_x = torch.from_numpy(self.splits.test_x)
        self._test_y = torch.from_numpy(self.splits.test_y)
        self.progress = progress
        self.samples: list[Sample] = []
        self.events: list[Event] = []
        self.iterations: list[IterationRecord] = []
        self.acks: list[AckRecord] = []
        self.reports: dict[int, WorkerReport] = {}
        self.t0: float | None = None
        self.strategies: list[Strategy] = []
        self.workers: list[Any] = []
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------

    def __enter__(self) -> PSJob:
        """The job itself; :meth:`close` runs on exit."""
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        """Close the job."""
        self.close()

    def start(self) -> None:
        """Create the clock service, the recorder, every shard's servers and the workers, and
        wait until all of them are ready.

        Raises:
            RuntimeError: Ray is not initialised (use :class:`RayCluster`).
        """
        if not ray.is_initialized():
            raise RuntimeError("Ray is not running; start the job inside `with RayCluster(...):`")
        if self._started:
            raise RuntimeError("the job is already started")
        self._started = True
        torch.set_num_threads(1)
        cfg, training = self.config, self.config.training
        self.membership = Membership(self.run_id)
        clock_name = actor_name(self.run_id, "clock")
        recorder_name = actor_name(self.run_id, "recorder")
        self.clock = ray.remote(ClockService).options(name=clock_name, namespace=NAMESPACE, num_cpus=0).remote(
            training.num_workers
        )
        self.recorder = ray.remote(Recorder).options(name=recorder_name, namespace=NAMESPACE, num_cpus=0).remote()
        data_host_name = actor_name(self.run_id, "data")
        self.data_host = ray.remote(DataHost).options(name=data_host_name, namespace=NAMESPACE, num_cpus=0).remote(
            self.splits.train_x, self.splits.train_y
        )
        for shard in range(cfg.num_shards):
            ctx = ShardContext(self.run_id, shard, cfg, self.layout, self.initial_states[shard], self.workdir)
            self.strategies.append(STRATEGY_CLASSES[cfg.strategy](ctx))
        worker_class = ray.remote(concurrency_groups={"control": 1})(Worker)  # type: ignore[call-overload]
        for i in range(training.num_workers):
            spec = WorkerSpec(
                run_id=self.run_id,
                index=i,
                name=actor_name(self.run_id, f"worker{i}"),
                num_workers=training.num_workers,
                clients=tuple(s.client() for s in self.strategies),
                layout=self.layout,
                model_factory=self.model_factory,
                input_shape=self.splits.input_shape,
                num_classes=self.splits.num_classes,
                batch_size=training.batch_size,
                seed=training.seed,
                delay_s=training.delay_of(i),
                bound=cfg.consistency.bound,
                clock_service=clock_name,
                recorder=recorder_name,
                data_host=data_host_name,
                niceness=cfg.resources.worker_niceness,
            )
            self.workers.append(
                worker_class.options(
                    name=spec.name,
                    namespace=NAMESPACE,
                    num_cpus=cfg.resources.worker_cpus,
                    max_restarts=-1,
                    max_task_retries=0,
                ).remote(spec)
            )
        for strategy in self.strategies:
            strategy.start()
        # Workers were created first so that their start-up overlaps the servers'.
        ray.get([w.identity.remote() for w in self.workers], timeout=300)
        for strategy in self.strategies:
            strategy.poll(time.time())

    def close(self) -> None:
        """Kill every actor of the job and delete its key-value entries (idempotent)."""
        if not self._started or not ray.is_initialized():
            return
        self._started = False
        for worker in self.workers:
            ray.kill(worker, no_restart=True)
        for strategy in self.strategies:
            strategy.stop()
        ray.kill(self.clock, no_restart=True)
        ray.kill(self.recorder, no_restart=True)
        ray.kill(self.data_host, no_restart=True)
        self.membership.clear()

    # -- training ----------------------------------------------------------------------------

    def train(self, duration_s: float | None = None, *, faults: FaultPlan | None = None) -> None:
        """Train for ``duration_s`` (default: the configuration's), injecting ``faults``.

        Returns once every worker has stopped and settled its pending pushes.
        """
        if not self._started:
            raise RuntimeError("call start() before train()")
        duration = self.config.duration_s if duration_s is None else duration_s
        plan = faults or FaultPlan()
        plan.validate(duration)
        start = time.time()
        if self.t0 is None:
            self.t0 = start
        deadline = start + duration
        ray.get(self.clock.reset_release.remote())
        running = {i: w.run.remote(deadline) for i, w in enumerate(self.workers)}
        restarting: dict[int, Any] = {}
        schedule = FaultSchedule(plan, duration, start, self._inject)
        next_eval = start
        while running or restarting or time.time() < deadline:
            now = time.time()
            for strategy in self.strategies:
                self.events.extend(strategy.poll(now))
            # Update-triggered kills count the progress of the target shard (shard 0 for workers).
            progress_shard = plan.shard if plan.target != "worker" else 0
            self.events.extend(schedule.poll(now, self.strategies[progress_shard].num_applied))
            self._watch_workers(running, restarting, deadline, now)
            if now >= next_eval:
                self.sample()
                next_eval += self.config.eval_every_s
            if now > deadline + STOP_GRACE_S:
                raise RuntimeError(f"workers {sorted(running)} did not stop within {STOP_GRACE_S:g} s of the deadline")
            time.sleep(TICK_S)
        ray.get(self.clock.release.remote())
        self._drain()
        self.sample()

    def _watch_workers(self, running: dict[int, Any], restarting: dict[int, Any], deadline: float, now: float) -> None:
        """Collect finished training calls; re-issue the call of a worker Ray restarted."""
        if running:
            ready, _ = ray.wait(list(running.values()), num_returns=len(running), timeout=0)
            for i in [i for i, ref in running.items() if ref in ready]:
                ref = running.pop(i)
                try:
                    self.reports[i] = ray.get(ref)
                except RayActorError:
                    if now < deadline:
                        restarting[i] = self.workers[i].identity.remote()
        for i, ref in list(restarting.items()):
            if not ray.wait([ref], timeout=0)[0]:
                continue
            try:
                identity: WorkerIdentity = ray.get(ref)
            except RayActorError:
                restarting[i] = self.workers[i].identity.remote()  # still restarting
                continue
            del restarting[i]
            self.events.append(
                Event(identity.ready_at, "worker_restarted", -1, identity.name, f"incarnation {identity.incarnation}")
            )
            if time.time() < deadline:
                running[i] = self.workers[i].run.remote(deadline)

    def _inject(self, target: str, shard: int, worker: int, downtime_s: float) -> Event:
        if target == "worker":
            return kill_actor(self.membership, actor_name(self.run_id, f"worker{worker}"), self.workers[worker], downtime_s)
        name, handle = self.strategies[shard].victim(target)
        return kill_actor(self.membership, name, handle, downtime_s, shard=shard)

    def kill(self, target: str = "server", *, shard: int = 0, worker: int = 0, downtime_s: float = 0.0) -> Event:
        """SIGKILL the actor in role ``target`` (``server``, ``middle``, ``tail``, ``worker``)."""
        event = self._inject(target, shard, worker, downtime_s)
        self.events.append(event)
        return event

    def wait_until_serving(self, timeout_s: float = 60.0, *, full: bool = False) -> None:
        """Supervise until every shard's reader answers a fresh ping (``full``: and every
        replica is back).

        Raises:
            TimeoutError: not serving within ``timeout_s``.
        """
        wanted = ("up",) if full else ("up", "degraded")
        end = time.time() + timeout_s
        while time.time() < end:
            now = time.time()
            for strategy in self.strategies:
                self.events.extend(strategy.poll(now))
            readers = [s.reader() for s in self.strategies]
            if all(s.status() in wanted for s in self.strategies) and all(r is not None for r in readers):
                try:
                    ray.get([r.ping.remote() for r in readers], timeout=READ_TIMEOUT_S)
                    return
                except (RayActorError, ray.exceptions.GetTimeoutError):
                    pass
            time.sleep(TICK_S)
        raise TimeoutError(f"shards not serving after {timeout_s:g} s: {[s.status() for s in self.strategies]}")

    def wait_for_event(self, kind: str, *, since: float, shard: int | None = None, timeout_s: float = 60.0) -> Event:
        """Supervise until an event of ``kind`` (on ``shard``, if given) at or after ``since``.

        Raises:
            TimeoutError: none within ``timeout_s``.
        """
        end = time.time() + timeout_s
        while time.time() < end:
            now = time.time()
            for strategy in self.strategies:
                self.events.extend(strategy.poll(now))
            for event in self.events:
                if event.kind == kind and event.time >= since and (shard is None or event.shard == shard):
                    return event
            time.sleep(TICK_S)
        raise TimeoutError(f"no {kind!r} event within {timeout_s:g} s")

    # -- observation ---------------------------------------------------------------------------

    def _drain(self) -> None:
        iterations, acks = ray.get(self.recorder.drain.remote())
        self.iterations.extend(iterations)
        self.acks.extend(acks)

    def status(self) -> ServerStatus:
        """The worst status over shards."""
        return max((s.status() for s in self.strategies), key=_STATUS_ORDER.__getitem__)

    def sample(self) -> Sample:
        """Evaluate the served model on the test split now and record the sample."""
        now = time.time()
        t = now - (self.t0 if self.t0 is not None else now)
        readers = [s.reader() for s in self.strategies]
        refs = [r.pull.remote() for r in readers if r is not None]
        weights = []
        if len(refs) == len(readers):
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=READ_TIMEOUT_S)
            if len(ready) == len(refs):
                try:
                    weights = ray.get(refs)
                except RayActorError:
                    weights = []
        if weights:
            self._eval_model.load([w.values for w in weights])
            accuracy, loss = self._eval_model.evaluate(self._test_x, self._test_y)
            updates, steps = min(w.num_applied for w in weights), min(w.version for w in weights)
        else:
            accuracy = loss = math.nan
            updates = min(s.num_applied for s in self.strategies)
            steps = self.samples[-1].steps if self.samples else 0
        sample = Sample(t, updates, steps, accuracy, loss, self.status())
        self.samples.append(sample)
        if self.progress is not None:
            self.progress(sample)
        return sample

    def server_states(self, timeout_s: float = 60.0) -> list[ShardState]:
        """The served state of every shard (waits until each shard serves)."""
        self.wait_until_serving(timeout_s)
        readers = [s.reader() for s in self.strategies]
        return list(ray.get([r.state.remote() for r in readers], timeout=timeout_s))

    def node_states(self, shard: int = 0, timeout_s: float = 60.0) -> dict[str, ShardState]:
        """The state of every live server of ``shard`` (every node of a chain)."""
        servers = self.strategies[shard].servers()
        states = ray.get([h.state.remote() for h in servers.values()], timeout=timeout_s)
        return dict(zip(servers, states, strict=True))

    def clocks(self) -> list[int]:
        """Every worker's clock."""
        clocks: list[int] = ray.get(self.clock.clocks.remote())
        return clocks
