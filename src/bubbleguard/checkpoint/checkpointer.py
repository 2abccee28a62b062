"""The checkpointer a training loop uses: snapshot every ``every`` steps, persist every ``persist_every``.

It plugs into a pipeline job as its step hooks (``run_one`` / ``before_step`` / ``after_step``) and
owns the tiers. Which work runs where depends on the mode (a :class:`SnapshotStrategy`):

* ``bubble`` (ours): after optimizer step k the state is captured by reference; its chunks are
  copied into node-local shared memory while the stage waits on receives during iteration k+1;
  what is left is copied at the ``CHECKPOINT`` action just before step k+1. Every
  ``persist_every`` steps a helper process per rank (``persist.py``) writes the snapshot from
  shared memory to the durable tier (DCP).
* ``none`` and the baselines in :mod:`bubbleguard.checkpoint.baselines`, measured in the same
  harness with the same frequency flags.

Call order, every rank::

    ckpt = Checkpointer(job, CheckpointConfig(ckpt_dir=..., mode="bubble"),
                        data_state=batches.state_dict)   # collective: creates the persist group
    start = ckpt.resume(batches.load_state_dict)         # collective; 0 on a fresh start
    for step in range(start + 1, num_steps + 1):
        job.step(inputs, targets)                        # the hooks run inside
    ckpt.close()                                         # collective: final persist, cleanup

The memory tier's snapshots of a rank are only readable on its node; a checkpoint taken with a
different layout (stages x replicas) is restored from the durable tier, which reshards by name.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist

from bubbleguard.checkpoint.copier import SnapshotCopier
from bubbleguard.checkpoint.errors import IncompleteCheckpointError
from bubbleguard.checkpoint.layout import default_chunk_bytes
from bubbleguard.checkpoint.manifest import agree_newest_step
from bubbleguard.checkpoint.persist import BackgroundPersister, PersistResult, cpu_bandwidth
from bubbleguard.checkpoint.state import (
    StageState,
    begin_capture,
    capture_state,
    restore_state,
    stage_selector,
)
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier

__all__ = [
    "CHECKPOINT_MODES",
    "CheckpointConfig",
    "Checkpointer",
    "ResumeInfo",
    "SnapshotStrategy",
    "job_id_for",
]

CHECKPOINT_MODES: tuple[str, ...] = ("none", "sync", "background", "dcp-async", "bubble")
THREAD_PERSIST_MODES = ("background", "dcp-async")


class CheckpointableJob(Protocol):
    """What the checkpointer needs of a job (a :class:`bubbleguard.pipeline.PipelineJob`)."""

    stage: torch.nn.Module
    optimizer: torch.optim.Optimizer
    rank: int
    step_count: int

    def attach_hooks(self, hooks: Any) -> None:
        """Install ``run_one``/``before_step``/``after_step``."""
        ...


@dataclass(frozen=True)
class CheckpointConfig:
    """How often and where to checkpoint.

    Attributes:
        mode: one of :data:`CHECKPOINT_MODES`.
        ckpt_dir: durable root (local path or fsspec URL); also names the memory-tier job.
        every: snapshot every this many steps.
        persist_every: write a durable checkpoint every this many steps (0: only at close).
        keep_last: durable checkpoints to keep.
        job_id: memory-tier job name; default derived from ``ckpt_dir``.
        chunk_bytes: snapshot chunk size (the most a copy can overrun a bubble); None: 4 MiB
            on the CPU, 64 MiB for a stage on a GPU, where copies run on the copy engine and
            overrun nothing, and fewer pieces mean fewer launches (``DEVICE_CHUNK_BYTES``).
        shm_root: parent of the memory tier (default ``/dev/shm``).
        memory_slots: snapshot slots per rank in the memory tier (>= 2; see ``MemoryTier``).
            With 3 (the default) a persist, which pins its slot until written, never makes
            a snapshot wait; 2 saves one state's worth of shared memory.
        persist_when_busy: ``"skip"`` (default): a persist due while the previous one is still
            being written is skipped, so training never waits for the helper (which only gets
            idle CPU time and can fall behind on a busy machine); ``"wait"``: every due persist
            is queued, and a snapshot may wait for a free slot (see ``BackgroundPersister``).
        reuse_layout: ``bubble`` mode: the persist helper writes each persist after the first
            by replaying the first one's DCP files (``tiers/dcp_layout.py``): the same files
            for 25-40% of its CPU time (README, "Dec 7"). False: every persist is a ``dcp.save``.
    """

    mode: str = "bubble"
    ckpt_dir: str = ""
    every: int = 1
    persist_every: int = 10
    keep_last: int = 3
    job_id: str | None = None
    chunk_bytes: int | None = None
    shm_root: str | None = None
    memory_slots: int = 3
    persist_when_busy: str = "skip"
    reuse_layout: bool = True

    def __post_init__(self) -> None:
        if self.persist_when_busy not in ("skip", "wait"):
            raise ValueError(f"--persist-when-busy must be 'skip' or 'wait', got "
                             f"{self.persist_when_busy!r}")
        if self.mode not in CHECKPOINT_MODES:
            raise ValueError(f"unknown checkpoint mode {self.mode!r}; choose one of "
                             f"{', '.join(CHECKPOINT_MODES)}")
        if self.every < 1:
            raise ValueError(f"--ckpt-every must be >= 1, got {self.every}")
        if self.persist_every < 0:
            raise ValueError(f"--persist-every must be >= 0 (0: only at the end), got "
                             f"{self.persist_every}")
        if self.chunk_bytes is not None and (self.chunk_bytes <= 0 or self.chunk_bytes % 64):
            raise ValueError(f"chunk_bytes must be a positive multiple of 64, got "
                             f"{self.chunk_bytes}")
        if self.memory_slots < 2:
            raise ValueError(f"memory_slots must be >= 2 (one to keep, one to write), got "
                             f"{self.memory_slots}")
        if self.keep_last < 1:
            raise ValueError(f"--keep-last must be >= 1, got {self.keep_last}")
        if self.mode != "none" and not self.ckpt_dir:
            raise ValueError(f"checkpoint mode {self.mode!r} needs --ckpt-dir")


def job_id_for(ckpt_dir: str) -> str:
    """A memory-tier job name that is the same for every run writing to ``ckpt_dir``."""
    where = ckpt_dir if "://" in ckpt_dir else os.path.abspath(ckpt_dir)
    return "job-" + hashlib.sha256(where.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ResumeInfo:
    """Where a resume came from: ``tier`` is ``"memory"``, ``"durable"``, ``"torchsave"`` (the
    ``sync`` baseline's files) or ``"none"``."""

    step: int
    tier: str


class SnapshotStrategy(ABC):
    """When and how a mode copies state. Called on the training thread, in the runtime's order.

    ``after_step(k)`` right after optimizer step k; ``run_one()`` repeatedly inside waits of
    iteration k+1; ``before_step()`` just before optimizer step k+1; ``close()`` once at the end.
    """

    name: str = ""

    def has_work(self) -> bool:
        """Whether ``run_one`` has bubble work to do (the default: never)."""
        return False

    def run_one(self) -> bool:
        """Do one unit of bubble work; False when there is none (the default)."""
        return False

    @abstractmethod
    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` just finished."""

    def before_step(self) -> None:  # noqa: B027 -- optional hook, nothing to finish by default
        """The optimizer is about to change the state (default: nothing to finish)."""

    def flush(self) -> None:
        """Finish the snapshot in flight and wait for every queued durable write (all ranks).

        The default finishes the snapshot (``before_step``); strategies with background writes
        also wait for them.
        """
        self.before_step()

    def close(self) -> None:  # noqa: B027 -- optional hook
        """Finish outstanding work (all ranks)."""


class Checkpointer:
    """Checkpoints a pipeline job (see the module docstring for the call order).

    Args:
        job: the job whose stage and optimizer are checkpointed; its hooks are set.
        config: what, how often, where.
        data_state: returns the data cursor (JSON-able) positioned at the next batch.
        scheduler: an LR scheduler to save and restore, or None.
        strategy_factory: builds the strategy for ``config.mode`` (default: the built-in ones).

    Raises:
        ValueError: a bad configuration (names the problem).
    """

    def __init__(self, job: CheckpointableJob, config: CheckpointConfig, *,
                 data_state: Callable[[], Mapping[str, Any]] | None = None,
                 scheduler: Any | None = None) -> None:
        self.job = job
        self.config = config
        self.data_state = data_state or dict
        self.scheduler = scheduler
        self.rank = job.rank
        self.num_ranks = dist.get_world_size() if dist.is_initialized() else 1
        self.stats: dict[str, float] = {}
        self.memory: MemoryTier | None = None
        self.durable: DurableTier | None = None
        self.strategy: SnapshotStrategy | None = None
        if config.mode == "none":
            return
        # Collective, same order on every rank: the baselines persist from threads of this
        # process, on a gloo group of their own (ours persists from a helper process).
        persist_group = (dist.new_group(backend="gloo")
                         if dist.is_initialized() and config.mode in THREAD_PERSIST_MODES
                         else None)
        self.durable = DurableTier(config.ckpt_dir, process_group=persist_group,
                                   keep_last=config.keep_last,
                                   reuse_layout=config.reuse_layout and config.mode == "bubble")
        # A persist pins its slot until the helper has written it (it saves straight from
        # shared memory, in idle time: that can take a few steps); with a third slot the next
        # snapshots never wait for it (the newest complete one and the pinned one are kept).
        self.memory = MemoryTier(config.job_id or job_id_for(config.ckpt_dir), self.rank,
                                 num_ranks=self.num_ranks, root=config.shm_root,
                                 chunk_bytes=config.chunk_bytes
                                 or default_chunk_bytes(_stage_device(job.stage)),
                                 num_slots=config.memory_slots)
        self.strategy = self._make_strategy()
        job.attach_hooks(self)

    def _make_strategy(self) -> SnapshotStrategy:
        if self.config.mode == "bubble":
            return BubbleStrategy(self)
        from bubbleguard.checkpoint.baselines import make_baseline

        return make_baseline(self)

    # ------------------------------------------------------------- state

    def layout_tag(self) -> dict[str, int]:
        """Who wrote a snapshot: only the same (rank, world size) may reuse it from memory."""
        return {"rank": self.rank, "num_ranks": self.num_ranks}

    def capture(self, step: int) -> StageState:
        """The job's state after optimizer step ``step`` (tensors by reference)."""
        return capture_state(self.job.stage, self.job.optimizer, self.scheduler, step=step,
                             data_cursor={"data": dict(self.data_state()),
                                          "layout": self.layout_tag()})

    # ------------------------------------------------------------- StepHooks

    def has_work(self) -> bool:
        """Whether the strategy has bubble work (see :class:`~bubbleguard.pipeline.runtime.StepHooks`)."""
        return self.strategy.has_work() if self.strategy else False

    def run_one(self) -> bool:
        """Bubble work of the strategy (see :class:`bubbleguard.pipeline.runtime.StepHooks`)."""
        return self.strategy.run_one() if self.strategy else False

    def before_step(self) -> None:
        """Finish the snapshot in flight before the optimizer changes the state."""
        if self.strategy:
            self.strategy.before_step()

    def after_step(self, step: int) -> None:
        """Optimizer step ``step`` finished: snapshot it if due."""
        if self.strategy:
            self.strategy.after_step(step)

    def snapshot_profile(self) -> tuple[tuple[int, ...], float, float | None] | None:
        """What a planner needs, once measured: chunk sizes, copy and persist bandwidth.

        None before the first snapshot completed, or in modes other than ``bubble``. The
        persist bandwidth is per second of the helper's CPU time (:func:`cpu_bandwidth`; None
        until a persist wrote something).
        """
        strategy = self.strategy
        if not isinstance(strategy, BubbleStrategy) or not strategy.chunk_sizes:
            return None
        copy_bw = strategy.copier.bandwidth_bytes_per_s
        if copy_bw is None:
            return None
        return strategy.chunk_sizes, copy_bw, cpu_bandwidth(strategy.persister.results())

    # ------------------------------------------------------------- resume / close

    def resume(self, load_data_state: Callable[[Mapping[str, Any]], None] | None = None,
               ) -> ResumeInfo:
        """Restore the newest checkpoint every rank holds, from whichever tier has it.

        Looks in the memory tier, the ``sync`` mode's per-rank ``torch.save`` files and the
        durable tier; the newest step every rank holds wins, and on a tie the faster tier
        (memory, then files, then durable). Collective (all ranks, one agreement per tier).
        Returns step 0 and tier ``"none"`` on a fresh start; the tier is ``"memory"``,
        ``"torchsave"`` or ``"durable"`` otherwise.

        Raises:
            bubbleguard.checkpoint.errors.StateMismatchError: the checkpoint is of a different
                model (names the missing and unexpected parameters).
        """
        if self.memory is None or self.durable is None:
            return ResumeInfo(0, "none")
        # Imported here: baselines builds on this module.
        from bubbleguard.checkpoint.baselines import TorchSaveFiles

        mine = [r.step for r in self.memory.records()
                if r.metadata.get("data_cursor", {}).get("layout") == self.layout_tag()]
        valid = set(self.memory.valid_steps())
        files = (None if "://" in self.config.ckpt_dir
                 else TorchSaveFiles(self.config.ckpt_dir, self.rank, self.num_ranks,
                                     create=False))
        latest = self.durable.latest()
        # Every rank runs the three agreements, in this order, whatever it holds.
        candidates = [
            ("memory", agree_newest_step([s for s in mine if s in valid])),
            ("torchsave", agree_newest_step(files.valid_steps() if files else [])),
            ("durable", agree_newest_step([latest] if latest is not None else [])),
        ]
        found = [(tier, step) for tier, step in candidates if step is not None]
        if not found:
            return ResumeInfo(0, "none")
        tier, step = max(found, key=lambda c: c[1])  # the first of equals: the faster tier
        if tier == "memory":
            state = self.memory.read(step)
        elif tier == "torchsave":
            assert files is not None
            state = files.read(step)
        else:
            state = self.durable.read(step, select=stage_selector(self.job.stage),
                                      rank=self.rank)
        result = restore_state(state, self.job.stage, self.job.optimizer, self.scheduler)
        if load_data_state is not None:
            load_data_state(result.data_cursor["data"])
        self.job.step_count = step
        return ResumeInfo(step, tier)

    def flush(self) -> None:
        """Finish the snapshot in flight and wait until every queued durable write is done.

        Collective (all ranks). Afterwards the newest snapshot is complete in the memory tier
        and every persist that was due has finished (committed, or failed and reported). Use it
        before something that must see the checkpoints, e.g. an evaluation that reads them, or
        when a pre-emption notice arrives; training may go on afterwards.
        """
        if self.strategy is not None:
            self.strategy.flush()

    def persist_results(self, start: int = 0) -> list[PersistResult] | None:
        """This rank's finished background persists so far, in submission order, from the
        ``start``-th on (no waiting; a caller that polls passes how many it has seen).

        None where nothing is persisted in the background: ``none``, and ``sync``, whose saves
        are durable before the step returns.
        """
        strategy = self.strategy
        if isinstance(strategy, BubbleStrategy):
            return strategy.persister.results(start)
        results = getattr(strategy, "results", None)
        return results[start:] if results is not None else None

    def close(self) -> None:
        """Finish the snapshot in flight, persist the newest step, wait (all ranks)."""
        if self.strategy is not None:
            self.strategy.close()


class BubbleStrategy(SnapshotStrategy):
    """Ours: chunk copies inside the bubbles, the rest before the step, persist in background.

    The step boundary does only what cannot wait; everything else runs in bubbles:

    * ``after_step(k)``: :func:`~bubbleguard.checkpoint.state.begin_capture` -- buffers, RNG
      states, data cursor, hyperparameters (~0.1 ms). Parameters and optimizer state do not
      change until the next step, so naming them, building the metadata and
      ``MemoryTier.begin`` wait for the first ``run_one``.
    * ``run_one()`` in the waits of iteration k+1: the deferred capture + begin of k, then one
      chunk copy + checksum per call, then the record of k (the snapshot is complete), its
      persist, and on rank 0 the commit markers.
    * ``before_step()``: only if the bubbles did not hold it all: copies the rest and writes
      the record (blocking, counted in ``ckpt_blocking_s``).

    The persist runs in a helper process that only gets CPU time the ranks leave idle (see
    ``persist.py``): it, too, mostly uses the bubbles, and never holds the training GIL.

    On a GPU (the stage's parameters on CUDA) the copies are the copy engine's work, not the
    CPU's: ``after_step(k)`` also records an event after the step; ``run_one`` (which the job
    runs alongside compute there) queues the chunks on the memory tier's side stream a
    millisecond's worth at a time, then completes their checksums once they have landed;
    ``before_step()`` queues whatever is left and orders the optimizer step after the copies
    on the device (``MemoryTier.guard_copies``), with no CPU wait, so snapshot k may complete
    during iteration k+2. A snapshot due while the previous one is still completing waits in
    ``queued``; ``before_step`` finishes the older one first (by then its copies have landed).
    """

    name = "bubble"

    def __init__(self, owner: Checkpointer) -> None:
        assert owner.memory is not None and owner.durable is not None
        self.owner = owner
        self.memory = owner.memory
        self.copier = SnapshotCopier(owner.memory)
        # A helper process that runs in idle CPU time (see persist.py): collective.
        self.persister = BackgroundPersister(
            owner.memory, owner.durable,
            skip_while_busy=owner.config.persist_when_busy == "skip")
        self.persister.wait_ready()  # before training: see BackgroundPersister.wait_ready
        self.active: int | None = None
        # GPU: a snapshot taken while the previous one is still being checksummed.
        self.queued: tuple[int, Callable[[], StageState], Any] | None = None
        self.on_device = _stage_device(owner.job.stage).type == "cuda"
        self.chunk_sizes: tuple[int, ...] = ()
        self.finished: int | None = None
        self.persisted: int | None = None
        self.to_commit: list[int] = []
        # The commit marker is written by a process that sees every rank's files: on one node.
        self.commits = owner.rank == 0 and os.environ.get(
            "LOCAL_WORLD_SIZE", str(owner.num_ranks)) == str(owner.num_ranks)

    def after_step(self, step: int) -> None:
        self.persister.raise_if_failed()
        if step % self.owner.config.every == 0:
            owner = self.owner
            # What Checkpointer.capture takes, split at the step boundary (see the class doc).
            pending = begin_capture(owner.job.stage, owner.job.optimizer, owner.scheduler,
                                    step=step,
                                    data_cursor={"data": dict(owner.data_state()),
                                                 "layout": owner.layout_tag()})
            ready = _state_ready_event(owner.job.stage)
            if self.active is not None:
                # GPU: the previous snapshot's checksums are still running; this one begins
                # when they are done (run_one), at the latest at the next CHECKPOINT.
                self.queued = (step, pending.complete, ready)
                return
            self.copier.start(pending.complete, after=ready)
            self.active = step

    def _start_queued(self) -> None:
        assert self.queued is not None and self.active is None
        step, complete, ready = self.queued
        self.queued = None
        self.copier.start(complete, after=ready)
        self.active = step

    def has_work(self) -> bool:
        return (self.copier.has_work() or self.queued is not None
                or (self.commits and bool(self.to_commit)))

    def run_one(self) -> bool:
        if self.copier.run_one():
            self._on_complete()
            return True
        if self.queued is not None and self.active is None:
            self._start_queued()
            return True
        if self.commits and self.to_commit:
            return self._try_commit()
        return False

    def _on_complete(self) -> None:
        """Once per completed snapshot: queue its commit and, if due, its persist."""
        report = self.copier.take_report()
        if report is None:
            return
        stats = self.owner.stats
        stats["ckpt_chunks_in_bubbles"] = report.num_chunks_in_bubbles
        stats["ckpt_chunks_blocking"] = report.num_chunks_blocking
        step = report.record.step
        self.chunk_sizes = report.record.layout.chunk_sizes()
        self.finished, self.active = step, None
        self.to_commit.append(step)
        every = self.owner.config.persist_every
        if every and step % every == 0:
            self.persister.submit(step)
            self.persisted = step

    def _try_commit(self) -> bool:
        """Commit what every rank has recorded; True if a marker was written."""
        wrote = False
        while self.to_commit:
            try:
                self.memory.commit(self.to_commit[0])
            except IncompleteCheckpointError:
                break  # another rank is not done yet; try again in a later bubble
            self.to_commit.pop(0)
            wrote = True
        return wrote

    def before_step(self) -> None:
        if self.queued is not None:
            # GPU, a step behind: the older snapshot's copies were ordered before the step
            # that just ran, so finishing it only waits for checksums; then the newer begins.
            self.copier.finish()
            self._on_complete()
            self._start_queued()
        if self.active is None:
            return  # nothing in flight, or the bubbles completed it
        if self.on_device:
            # The copies run on the device: queue what is left and order the optimizer step
            # after them there. Their checksums and the record follow in the helper thread.
            self.copier.queue_all()
            self.memory.guard_copies()
            return
        self.copier.finish()
        self._on_complete()

    def _finish_all(self) -> None:
        """Complete the snapshot in flight and the one queued behind it (blocking)."""
        if self.active is not None:
            self.copier.finish()
            self._on_complete()
        if self.queued is not None:
            self._start_queued()
            self.copier.finish()
            self._on_complete()

    def flush(self) -> None:
        self.persister.wait()  # so that a persist due now is not skipped behind one in flight
        self._finish_all()
        if self.commits:
            self._try_commit()
        self.persister.wait()

    def close(self) -> None:
        # The last step's persist must not be skipped behind one still in flight.
        self.persister.wait()
        self._finish_all()  # the snapshot of the last step, if one is in flight
        if self.commits:
            self._try_commit()
        if self.finished is not None and self.persisted != self.finished:
            self.persister.submit(self.finished)
        results = self.persister.close()
        skipped = [r for r in results if not r.persisted]
        if skipped and self.owner.rank == 0:
            warnings.warn(f"{len(skipped)} of {len(results)} durable persists did not happen; "
                          f"the first, of step {skipped[0].step}: {skipped[0].error}", stacklevel=2)
        if results and results[-1].persisted and results[-1].step == self.finished:
            # The newest step is durable, so this rank's shared memory can go; a later --resume
            # reads the durable tier. The job directory (and its commit marker) goes with the
            # last rank directory: rank 0, which writes the marker, removes its own only after
            # its last commit, and a rank that kept its snapshots keeps the marker too.
            self.memory.cleanup()
        else:
            # Keep the snapshots: they may be the only copy of the newest state.
            self.memory.close()


def _stage_device(module: torch.nn.Module) -> torch.device:
    param = next(module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _state_ready_event(module: torch.nn.Module) -> Any:
    """On a GPU, an event on the current stream right after the optimizer step: the snapshot's
    copies wait for it, and not for the next iteration's kernels queued after it. None on the
    CPU."""
    param = next(module.parameters(), None)
    if param is None or not param.is_cuda:
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(param.device))
    return event
