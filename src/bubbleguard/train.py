"""The built-in training job: what ``bubbleguard train`` runs on every rank.

Read it top to bottom: it is also the example of how to use the library in your own script.
:class:`TrainConfig` is validated in the launching process, before any rank starts;
:func:`train_worker` is the per-rank entry point that torchrun's machinery calls.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from bubbleguard.checkpoint.checkpointer import CheckpointConfig, Checkpointer, ResumeInfo
from bubbleguard.checkpoint.storage import check_checkpoint_dir
from bubbleguard.data import TokenBatches, load_corpus
from bubbleguard.elastic.faults import parse_fault
from bubbleguard.elastic.launcher import launch_local
from bubbleguard.heap import keep_freed_memory
from bubbleguard.models import (
    MODEL_NAMES,
    build_model,
    lm_loss,
    model_config,
    model_seq_len,
    model_target,
)
from bubbleguard.pipeline.layout import Layout
from bubbleguard.pipeline.profiler import plan_from_timeline
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.schedules import SCHEDULE_NAMES
from bubbleguard.pipeline.stage import partition_layers, split
from bubbleguard.pipeline.timeline import TimelineEvent, load_events, save_events

__all__ = ["RankJob", "RunResult", "TrainConfig", "max_local_ranks", "run_local", "start_rank",
           "train_worker"]


def max_local_ranks() -> int:
    """How many ranks one machine may launch: 8 per CPU core.

    Past that, ranks spend their time descheduled and gloo's timeouts fire; correctness runs of
    larger layouts fit under it, timing runs should stay at one rank per core.
    """
    return 8 * (os.cpu_count() or 1)


@dataclass(frozen=True)
class TrainConfig:
    """Everything one training run needs; checked on construction.

    Attributes:
        model: built-in model, ``"gpt"`` or ``"mlp"``.
        stages: pipeline stages P.
        replicas: data-parallel replicas D of the whole pipeline.
        microbatches: microbatches per iteration M.
        batch_size: rows per iteration over all replicas; divisible by D * M.
        schedule: ``"gpipe"`` or ``"1f1b"``.
        steps: optimizer steps to run.
        seed: fixes weights, data order and every RNG.
        lr: AdamW learning rate.
        model_options: overrides of the model's config (e.g. ``{"num_layers": 8}``).
        trace: write a Chrome trace JSON here (opens in Perfetto), or None.
        metrics: append one JSON line per step here, or None.
        run_dir: where ranks leave their timelines.
        threads: torch threads per rank.
        bind_cores: pin each local rank (and the threads and helper processes it starts) to
            ``threads`` cores of its own, when the node has enough for every local rank (see
            :func:`bind_local_rank`).
        keep_heap: each rank keeps the memory a step frees for the next step instead of
            returning it to the kernel (see :mod:`bubbleguard.heap`): ~3200 fewer page faults
            per step and rank at the overhead benchmark's size.
        progress: show a progress bar on the reporting rank.
        ckpt: checkpoint mode (``none``, ``bubble`` or a baseline; see
            :data:`bubbleguard.checkpoint.checkpointer.CHECKPOINT_MODES`).
        ckpt_dir: durable checkpoint root (local path or fsspec URL).
        ckpt_every: snapshot every this many steps.
        persist_every: durable checkpoint every this many steps (0: only at the end).
        keep_last: durable checkpoints to keep.
        persist_when_busy: ``skip`` a persist due while the previous one is still being written
            (default: training never waits for it) or ``wait`` for a slot.
        reuse_layout: ``bubble``: persists after the first replay its DCP files (default);
            False: every persist is a ``dcp.save``.
        ckpt_chunk_mb: snapshot chunk size in MiB (the most a copy can overrun a bubble).
        resume: start from the newest complete checkpoint (memory tier first, then durable).
        fault: ``RANK:STEP[:PHASE]`` to kill a rank on the first attempt (fault injection).
        max_restarts: times torchrun restarts the group after a failure; restarted ranks
            resume from the newest checkpoint.
    """

    model: str = "gpt"
    stages: int = 2
    replicas: int = 1
    microbatches: int = 4
    batch_size: int = 16
    schedule: str = "1f1b"
    steps: int = 20
    seed: int = 0
    lr: float = 1e-3
    model_options: dict[str, int] = field(default_factory=dict)
    trace: str | None = None
    metrics: str | None = None
    run_dir: str = "runs/latest"
    threads: int = 1
    bind_cores: bool = True
    keep_heap: bool = True
    progress: bool = True
    ckpt: str = "none"
    ckpt_dir: str = ""
    ckpt_every: int = 1
    persist_every: int = 10
    keep_last: int = 3
    persist_when_busy: str = "skip"
    reuse_layout: bool = True
    ckpt_chunk_mb: float = 4.0
    resume: bool = False
    fault: str | None = None
    max_restarts: int = 0

    def __post_init__(self) -> None:
        if self.model not in MODEL_NAMES:
            raise ValueError(f"unknown model {self.model!r}; choose one of {', '.join(MODEL_NAMES)}")
        if self.schedule not in SCHEDULE_NAMES:
            raise ValueError(f"unknown schedule {self.schedule!r}; choose one of "
                             f"{', '.join(SCHEDULE_NAMES)}")
        for name in ("stages", "replicas", "microbatches", "batch_size", "steps", "threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if self.ckpt != "none":
            self.checkpoint_config  # noqa: B018 -- validates the checkpoint options
            check_checkpoint_dir(self.ckpt_dir, resume=self.resume)
        if self.fault is not None:
            fault = parse_fault(self.fault)
            if fault.rank >= self.world_size:
                raise ValueError(f"--fault names rank {fault.rank} of a {self.world_size}-rank run")
        if self.max_restarts < 0:
            raise ValueError(f"--max-restarts must be >= 0, got {self.max_restarts}")
        if self.resume and self.ckpt == "none":
            raise ValueError("--resume needs a checkpoint mode (--ckpt bubble) and --ckpt-dir")
        num_layers = model_config(self.model, **self.model_options).num_layers
        partition_layers(num_layers, self.stages)  # raises: more stages than layers
        if self.world_size > max_local_ranks():
            raise ValueError(f"{self.stages} stages x {self.replicas} replicas = {self.world_size} "
                             f"ranks, more than this machine can launch ({max_local_ranks()} = 8 "
                             f"per core on {os.cpu_count()} cores)")
        rows = self.replicas * self.microbatches
        if self.batch_size % rows:
            raise ValueError(f"--batch-size {self.batch_size} does not split into {self.replicas} "
                             f"replica(s) x {self.microbatches} microbatches; use a multiple "
                             f"of {rows}")

    @property
    def world_size(self) -> int:
        """Ranks the run needs: stages x replicas."""
        return self.stages * self.replicas

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        """The checkpoint options as the checkpointer takes them."""
        # Chunks are whole multiples of 64 bytes (the layout's alignment).
        chunk_bytes = max(64, int(self.ckpt_chunk_mb * 2**20) // 64 * 64)
        return CheckpointConfig(mode=self.ckpt, ckpt_dir=self.ckpt_dir, every=self.ckpt_every,
                                persist_every=self.persist_every, keep_last=self.keep_last,
                                chunk_bytes=chunk_bytes, persist_when_busy=self.persist_when_busy,
                                reuse_layout=self.reuse_layout)

    @property
    def layout(self) -> Layout:
        """The rank layout."""
        return Layout(self.stages, self.replicas)

    def to_json(self) -> dict[str, Any]:
        """Plain-data form, for logs and for records next to results."""
        return dataclasses.asdict(self)


@dataclass
class RankJob:
    """What :func:`start_rank` sets up on one rank.

    Attributes:
        job: this rank's pipeline job (its stage, optimizer and schedule).
        batches: the seeded data iterator (every rank draws the same global batches).
        rank: global rank.
        replica: data-parallel replica of this rank.
    """

    job: PipelineJob
    batches: TokenBatches
    rank: int
    replica: int

    def next_batch(self, cfg: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
        """The next global batch, cut down to this rank's replica's rows."""
        inputs, targets = self.batches.next_batch()
        return inputs.chunk(cfg.replicas)[self.replica], targets.chunk(cfg.replicas)[self.replica]


def bind_local_rank(threads: int) -> tuple[int, ...] | None:
    """Pin this process to cores of its own: local rank i gets the i-th ``threads`` of them.

    Unpinned, the threads a rank wakes while it waits on a receive (the bubble copier, gloo's,
    the persist helper process) may land on the core of a neighbour that is computing, and
    steal its time. Pinned, a rank's helpers can only use that rank's own core, which is idle
    while the rank waits. Every thread of the process is pinned; threads and processes started
    later inherit it. Nothing is pinned when the cores this process may use are fewer than
    ``LOCAL_WORLD_SIZE * threads`` (oversubscribed: the scheduler has to share them anyway).

    Returns:
        The cores this rank now runs on, or None when it was left unpinned.
    """
    if not hasattr(os, "sched_setaffinity"):
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = sorted(os.sched_getaffinity(0))
    if local_ranks * threads > len(cores):
        return None
    mine = cores[local_rank * threads:(local_rank + 1) * threads]
    task_dir = Path("/proc/self/task")
    tasks = [int(t.name) for t in task_dir.iterdir()] if task_dir.is_dir() else [0]
    for task in tasks:
        try:
            os.sched_setaffinity(task, mine)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that just exited, or one we may not move
    return tuple(mine)


def start_rank(cfg: TrainConfig) -> RankJob:
    """Join the process group and build this rank's stage, optimizer, job and data.

    Called once per rank, under torchrun (the environment names the rank and the group).
    """
    if cfg.bind_cores:
        bind_local_rank(cfg.threads)
    if cfg.keep_heap:
        keep_freed_memory()
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    layout = cfg.layout
    # Every RNG the process might use, so that separate runs (not only resumed ones) agree.
    torch.manual_seed(cfg.seed)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)

    # The whole model is built (identically on every rank), then cut down to this rank's stage.
    model = build_model(cfg.model, seed=cfg.seed, **cfg.model_options)
    stage = split(model, cfg.stages, layout.stage_of(rank))
    del model
    optimizer = torch.optim.AdamW(stage.parameters(), lr=cfg.lr)
    job = PipelineJob(stage, optimizer, lm_loss, layout=layout, schedule=cfg.schedule,
                      num_microbatches=cfg.microbatches)

    # Every rank draws the same global batch and keeps its replica's rows, so all ranks' data
    # cursors agree (a checkpoint needs only one).
    mcfg = model_config(cfg.model, **cfg.model_options)
    batches = TokenBatches(load_corpus(), window=model_seq_len(mcfg), batch_size=cfg.batch_size,
                           seed=cfg.seed, target=model_target(mcfg))
    return RankJob(job, batches, rank, layout.replica_of(rank))


@record
def train_worker(cfg: TrainConfig) -> dict[str, Any]:
    """Train on this rank: one stage of one replica. Called once per rank by the launcher.

    Returns:
        A small summary (rank, stage, replica, last loss on the last stage).
    """
    ranked = start_rank(cfg)
    job, batches, rank, replica = ranked.job, ranked.batches, ranked.rank, ranked.replica
    layout = cfg.layout
    stage_index = layout.stage_of(rank)

    # Checkpoints: a restarted group (torchrun restart) always resumes; a new run when asked.
    ckpt = Checkpointer(job, cfg.checkpoint_config, data_state=batches.state_dict)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    resumed = ResumeInfo(0, "none")
    if cfg.resume or restart > 0:
        resumed = ckpt.resume(batches.load_state_dict)
    fault = parse_fault(cfg.fault) if cfg.fault else None

    reporter = rank == layout.rank(cfg.stages - 1, 0)
    metrics = open(cfg.metrics, "a") if reporter and cfg.metrics else None  # noqa: SIM115
    bar = None
    if reporter and cfg.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=resumed.step, desc="train", unit="step",
                   dynamic_ncols=True)
        if resumed.step:
            bar.write(f"resumed from step {resumed.step} ({resumed.tier} tier)")
    loss = None
    plan: dict[str, Any] | None = None
    durable = _DurableProgress()
    try:
        for step in range(resumed.step + 1, cfg.steps + 1):
            inputs, targets = ranked.next_batch(cfg)
            if fault:
                fault.maybe_fire(rank, step, "before")
            start = time.perf_counter()
            loss = job.step(inputs, targets)
            step_time_s = time.perf_counter() - start
            if fault:
                fault.maybe_fire(rank, step, "after")
            if step >= PLAN_FIRST_STEP and (step - PLAN_FIRST_STEP) % PLAN_EVERY == 0:
                plan = _plan(job, ckpt) or plan
            if metrics is not None:
                record = {"step": step, "loss": loss, "step_time_s": step_time_s,
                          "ckpt_blocking_s": job.last_stats["ckpt_blocking_s"],
                          "ckpt_bubble_s": job.last_stats["ckpt_bubble_s"],
                          "ckpt_overrun_s": job.last_stats["ckpt_overrun_s"], "restart": restart}
                record.update(durable.fields(ckpt))
                if step == resumed.step + 1 and resumed.step:
                    record["resumed_from"] = {"step": resumed.step, "tier": resumed.tier}
                if plan is not None and plan["step"] == step:
                    record["ckpt_plan"] = plan
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}")
        ckpt.close()
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()
        job.close()
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    save_events(Path(cfg.run_dir) / f"timeline-rank{rank}.json", job.timeline.events)
    if plan is not None:
        (Path(cfg.run_dir) / f"plan-rank{rank}.json").write_text(json.dumps(plan))
    dist.destroy_process_group()
    return {"rank": rank, "stage": stage_index, "replica": replica, "loss": loss,
            "resumed_from": resumed.step, "resumed_tier": resumed.tier}


# The checkpoint plan is made from the bubbles of the first iterations, then refreshed.
PLAN_FIRST_STEP = 5
PLAN_EVERY = 25


class _DurableProgress:
    """For the metrics lines: how far the background persists have got on this rank.

    ``ckpt_durable_step``: the newest step a finished persist committed (None before the first);
    ``ckpt_persists_missed``: persists so far that were skipped (the helper still busy) or
    failed. Nothing for modes without background persists. Reads only the results that are new
    since the last line, so a long run does not rescan every persist at every step.
    """

    def __init__(self) -> None:
        self.seen = 0
        self.newest: int | None = None
        self.missed = 0

    def fields(self, ckpt: Checkpointer) -> dict[str, Any]:
        new = ckpt.persist_results(self.seen)
        if new is None:
            return {}
        self.seen += len(new)
        for r in new:
            if r.persisted:
                self.newest = r.step if self.newest is None else max(self.newest, r.step)
            else:
                self.missed += 1
        return {"ckpt_durable_step": self.newest, "ckpt_persists_missed": self.missed}


def _plan(job: PipelineJob, ckpt: Checkpointer) -> dict[str, Any] | None:
    """This stage's checkpoint plan on its last 10 steps of bubbles, as plain data, or None
    before a snapshot and its copy bandwidth were measured."""
    profile = ckpt.snapshot_profile()
    if profile is None:
        return None
    chunk_sizes, copy_bw, persist_bw = profile
    plan = plan_from_timeline(job.timeline.events, job.schedule, job.stage.stage_index,
                              chunk_sizes, copy_bw, persist_bandwidth_bytes_per_s=persist_bw)
    persisted = [r for r in ckpt.persist_results() or [] if r.persisted]
    return {"step": job.step_count, "stage": job.stage.stage_index,
            "num_chunks": len(chunk_sizes),
            "chunks_in_bubbles": len(chunk_sizes) - len(plan.blocking_chunk_ids),
            "predicted_blocking_s": plan.blocking_s,
            "copy_bandwidth_bytes_per_s": copy_bw,
            "persist_bandwidth_bytes_per_s": persist_bw,
            "persist_cpu_s": persisted[-1].cpu_s if persisted else None,
            "persist_elapsed_s": persisted[-1].duration_s if persisted else None,
            "leftover_idle_s": plan.leftover_idle_s,
            "persist_every_free": plan.persist_every_free}


@dataclass(frozen=True)
class RunResult:
    """What a finished local run left behind.

    Attributes:
        config: the configuration it ran (with its ``run_dir``).
        final_loss: loss of the last step (replica 0's last stage reports it).
        events: every rank's timeline, concatenated.
    """

    config: TrainConfig
    final_loss: float
    events: list[TimelineEvent]


def run_local(cfg: TrainConfig) -> RunResult:
    """Launch ``cfg`` on ``cfg.world_size`` local ranks and collect their timelines.

    Raises:
        bubbleguard.elastic.launcher.LaunchError: a rank failed.
    """
    Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
    results = launch_local(train_worker, (cfg,), cfg.world_size, threads_per_rank=cfg.threads,
                           max_restarts=cfg.max_restarts)
    events = [e for r in range(cfg.world_size)
              for e in load_events(Path(cfg.run_dir) / f"timeline-rank{r}.json")]
    final_loss = results[cfg.layout.rank(cfg.stages - 1, 0)]["loss"]
    return RunResult(cfg, final_loss, events)
