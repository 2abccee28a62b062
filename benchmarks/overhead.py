"""Checkpoint overhead of every mode against no checkpoints, and snapshot copy bandwidth.

    python benchmarks/overhead.py                 # full size (15-25 min), writes benchmarks/results/overhead.json
    python benchmarks/overhead.py --tiny --out D  # seconds; what the test suite runs

Setup: 2 pipeline stages x 1 thread (one rank per core), 1F1B with 4 microbatches, the built-in GPT
sized so that one stage's state (parameters + AdamW state) is tens of MB; a snapshot every
iteration and a durable persist every 10 for every mode (``--ckpt-every 1 --persist-every 10``).
``--batch-size N`` (default 16) lengthens the step for the same state: the same copies and
persists against more compute.

Method: the modes take turns inside *one* training job (one torchrun launch), in blocks of 10
steps. On a shared machine the speed drifts by 10% and more from one run to the next (on the dev
VM two ``none`` runs minutes apart had median steps of 237 and 273 ms), which buries a 1% effect
when every mode is a run of its own; and single steps vary by about 5% (white noise), so a 1%
question needs hundreds of steps per mode. A round is ``none, bubble, none, b`` for every
baseline ``b`` (rotated by one per round): ``bubble`` and ``none`` get the most blocks, always
next to each other in time. A warm-up round of every mode (first snapshots map their shared
memory, the persist helpers start) is not measured. Each block covers steps 10j .. 10j+9 and is
one period of "persist every 10":

* its first step carries no work of its mode yet (its first snapshot is taken at the end of it)
  and absorbs the switch from the previous mode, so it is not measured;
* each of the other 9 steps carries exactly one snapshot's work (for ``bubble``: the copies of
  the previous step's snapshot and the capture of its own), and the block's one durable persist
  (of step 10j) runs during them;
* then the mode's ``Checkpointer.flush()`` finishes the snapshot in flight and waits for queued
  durable writes. Its time is reported (``flush_s``), not counted: it holds the copies the next
  step would make; a persist that spilled past the block would show here.

Reported per mode, over the measured steps of all rounds, on the last stage (which reports the
step times, as ``bubbleguard train`` does):

* step time: mean, median, 25th/75th percentile;
* overhead vs ``none``: the mode's mean step over ``none``'s mean step, minus 1, pooled over the
  rounds with a 95% bootstrap interval (rounds resampled); and per round (the same ratio within
  one round, against that round's ``none`` blocks), with the median and [min, max] over rounds.
  Means, not medians: the steps a persist slows are part of the cost;
* ``ckpt_blocking_s``: mean per step of the time each rank's training thread spent in checkpoint
  hooks (``after_step`` + ``before_step``); ``ckpt_bubble_s``: the same for the work done while
  waiting on receives; ``ckpt_overrun_s``: the part of that work that outlasted its wait (from
  the data's arrival to the end of the chunk in flight: on the critical path too);
  per step and rank, ``blocks[].thread``: the training thread's scheduler counters (time on a
  CPU, time runnable but off the CPU, minor faults, preemptions);
* ``excess_by_position``: where in its block a mode's extra time sits, per measured step (the
  block's persist starts with the block): the mean step time over ``none``'s at the same step,
  and the same for the training threads' CPU time and run delay per rank (printed for the step
  time). In main's 200-round run of Dec 6 morning ``bubble``'s excess was +14.5, +21.3, +12.1 ms
  in the first three steps and -3.5 to +5.9 in the other six.

``--modes none,bubble,bubble-snapshots`` adds an ablation: ``bubble`` without durable persists, in
blocks of its own in every round, and reports ``bubble.persist_cost`` (bubble's mean step over the
ablation's, pooled over rounds, with a round-paired bootstrap interval): what the persists cost,
separated from what the snapshot copies cost, within one run. ``bubble-dcp-save`` is the other
ablation: ``bubble`` whose helpers write every persist with ``dcp.save``
(``CheckpointConfig.reuse_layout=False``) instead of replaying the first one's files; it reports
``bubble.vs_dcp_save`` (bubble's mean step over the ablation's, the same way): what the replay
saves. Per block, ``persists`` lists the persists that finished in it, per rank, as
``[step, helper CPU seconds, replayed]``; per mode, ``persist_cpu_s`` sums them up.

``--busy N`` runs the training job beside N busy processes (each a Python loop that never
sleeps, at normal priority), started after the bandwidth measurement and stopped when the job
ends, however it ends: the cost of each mode on a machine whose cores are shared with other work,
where nothing is idle for the helper processes and the bubbles are shorter than planned.

Copy bandwidth, measured in this process (1 thread, like a rank) on a stage's real state, each
method after a pass over 256 MiB that evicts the caches, in alternating order: the snapshot copy as
the bubble copier does it (into shared memory, with the per-chunk checksum; timed by
``SnapshotCopier.bandwidth_bytes_per_s``), a plain ``Tensor.copy_`` of the same tensors into
preallocated buffers, and ``memcpy`` (through NumPy).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bubbleguard.checkpoint.baselines import SyncSave
from bubbleguard.checkpoint.checkpointer import (
    CheckpointConfig,
    Checkpointer,
    job_id_for,
)
from bubbleguard.checkpoint.copier import SnapshotCopier
from bubbleguard.checkpoint.layout import flat_bytes
from bubbleguard.checkpoint.state import StageState, capture_state
from bubbleguard.checkpoint.tiers.shm import MemoryTier, remove_job
from bubbleguard.elastic.launcher import launch_local
from bubbleguard.models import build_model, model_config, model_seq_len
from bubbleguard.pipeline.stage import split
from bubbleguard.train import TrainConfig, run_local, start_rank

MODES = ("none", "sync", "background", "dcp-async", "bubble")
SNAPSHOTS_ONLY = "bubble-snapshots"
"""An ablation, run only when named in ``--modes``: ``bubble`` without its durable persists, in
blocks of its own between the others, so that what the persists cost is measured in the same run
(``persist_cost``: bubble against it, round by round)."""
DCP_SAVE = "bubble-dcp-save"
"""An ablation like ``SNAPSHOTS_ONLY``: ``bubble`` whose every persist is a ``dcp.save``
(``bubble.vs_dcp_save``: bubble against it)."""
ABLATIONS = (SNAPSHOTS_ONLY, DCP_SAVE)
BLOCK_STEPS = 10  # one block = one persist period
THREAD_COUNTERS = ("cpu_s", "run_delay_s", "minor_faults", "preempted")
EVICT_BYTES = 256 << 20


def bench_size(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"width": 32, "layers": 2, "rounds": 1, "microbatches": 4, "batch_size": 8}
    return {"width": 384, "layers": 4, "rounds": 20, "microbatches": 4, "batch_size": 16}


def _train_config(size: dict[str, Any], steps: int, run_dir: str) -> TrainConfig:
    return TrainConfig(model="gpt", stages=2, microbatches=size["microbatches"],
                       batch_size=size["batch_size"], schedule="1f1b", steps=steps,
                       model_options={"d_model": size["width"], "num_layers": size["layers"]},
                       run_dir=run_dir, threads=1, progress=False)


def block_order(modes: Sequence[str], rounds: int) -> list[tuple[int, str]]:
    """(round, mode) of every block: a warm-up round (-1) of every mode, then the rounds.

    A round is ``none, bubble, none, b`` for every baseline ``b`` (in an order rotated by one
    per round), or ``none, bubble, none`` without baselines. ``bubble`` gets as many blocks as
    the baselines together, ``none`` twice that, next to them in time: the <= 1% question needs
    the precision, the baselines' tens of percent do not.
    """
    order = [(-1, m) for m in modes]
    baselines = [m for m in modes if m not in ("none", "bubble")]
    for r in range(rounds):
        k = r % len(baselines) if baselines else 0
        for b in (*baselines[k:], *baselines[:k]) or (None,):
            order += [(r, "none"), (r, "bubble"), (r, "none")] + ([(r, b)] if b else [])
    return order


# ------------------------------------------------------------------------------- training job


def bench_worker(cfg: TrainConfig, modes: Sequence[str], rounds: int, ckpt_root: str,
                 persist_every: int = BLOCK_STEPS) -> dict[str, Any]:
    """One rank of the interleaved job: every mode's blocks in turn (see the module docstring)."""
    ranked = start_rank(cfg)
    job = ranked.job
    ckpts = mode_checkpointers(job, modes, ckpt_root, ranked.batches.state_dict,
                               persist_every=persist_every)
    losses: list[float | None] = []

    def step() -> tuple[float, dict[str, float]]:
        inputs, targets = ranked.next_batch(cfg)
        before = thread_counters()
        start = time.perf_counter()
        losses.append(job.step(inputs, targets))
        elapsed = time.perf_counter() - start
        after = thread_counters()
        return elapsed, {**job.last_stats, **{k: after[k] - before[k] for k in after}}

    blocks = run_blocks(job, ckpts, step, block_order(modes, rounds))
    for ckpt in ckpts.values():
        ckpt.close()
    job.close()
    torch.distributed.destroy_process_group()
    return {"rank": ranked.rank, "blocks": blocks, "losses": losses}


def thread_counters() -> dict[str, float]:
    """The calling thread's scheduler counters (Linux; empty elsewhere): ``cpu_s``, time on a
    CPU; ``run_delay_s``, time it was runnable but waited for a CPU; ``minor_faults``;
    ``preempted``, involuntary context switches. Differences over a step split its time into
    the thread's own work, waiting for the CPU and waiting for peers (the rest)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu_ns, waiting_ns, _ = f.read().split()
    except OSError:
        return {}
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return {"cpu_s": int(on_cpu_ns) / 1e9, "run_delay_s": int(waiting_ns) / 1e9,
            "minor_faults": float(usage.ru_minflt), "preempted": float(usage.ru_nivcsw)}


def mode_checkpointers(job: Any, modes: Sequence[str], ckpt_root: str, data_state: Any,
                       shm_root: str | None = None, chunk_bytes: int | None = None,
                       persist_every: int = BLOCK_STEPS) -> dict[str, Checkpointer]:
    """One checkpointer per mode but ``none`` (each with its own directory), all detached;
    ``persist_every=0``: snapshots only (an ablation: what the durable tier costs)."""
    def config(mode: str) -> CheckpointConfig:
        snapshots_only = mode == SNAPSHOTS_ONLY
        return CheckpointConfig(mode="bubble" if mode in ABLATIONS else mode,
                                ckpt_dir=f"{ckpt_root}/ckpt-{mode}", every=1,
                                persist_every=0 if snapshots_only else persist_every,
                                keep_last=2, shm_root=shm_root, chunk_bytes=chunk_bytes,
                                reuse_layout=mode != DCP_SAVE)

    ckpts = {mode: Checkpointer(job, config(mode), data_state=data_state)
             for mode in modes if mode != "none"}
    job.detach_hooks()
    return ckpts


def run_blocks(job: Any, ckpts: dict[str, Checkpointer],
               step: Callable[[], tuple[float, dict[str, float]]],
               order: Sequence[tuple[int, str]]) -> list[dict[str, Any]]:
    """Run every (round, mode) block of ``order`` in turn (see the module docstring).

    ``step()`` runs one training step and returns its time and ``job.last_stats``. First
    ``BLOCK_STEPS - 1`` steps so that blocks start at multiples of 10; then per block: attach
    the mode's checkpointer (none for ``none``), ``BLOCK_STEPS`` steps, flush. Returns per
    block this rank's measured step times and checkpoint times (the first step left out).
    """
    for _ in range(BLOCK_STEPS - 1):  # steps 1..9: blocks then start at multiples of 10
        step()
    blocks: list[dict[str, Any]] = []
    reported: dict[str, int] = {}  # failed persists already listed, per mode
    finished: dict[str, int] = {}  # persist results already listed, per mode
    for round_index, mode in order:
        ckpt = ckpts.get(mode)
        if ckpt is None:
            job.detach_hooks()
        else:
            job.attach_hooks(ckpt)
        first = job.step_count + 1
        times, blocking, in_bubbles, overrun = [], [], [], []
        counters: dict[str, list[float]] = {}
        for _ in range(BLOCK_STEPS):
            dt, stats = step()
            times.append(dt)
            blocking.append(stats["ckpt_blocking_s"])
            in_bubbles.append(stats["ckpt_bubble_s"])
            overrun.append(stats["ckpt_overrun_s"])
            for key in THREAD_COUNTERS:
                if key in stats:
                    counters.setdefault(key, []).append(stats[key])
        start = time.perf_counter()
        if ckpt is not None:
            ckpt.flush()
        flush_s = time.perf_counter() - start
        failed = persist_failures(ckpt)
        done = (ckpt.persist_results(finished.get(mode, 0)) if ckpt is not None else None) or []
        finished[mode] = finished.get(mode, 0) + len(done)
        blocks.append({"round": round_index, "mode": mode, "first_step": first,
                       "step_times_s": times[1:], "blocking_s": blocking[1:],
                       "bubble_s": in_bubbles[1:], "overrun_s": overrun[1:], "flush_s": flush_s,
                       "durable_step": newest_durable_step(ckpt),
                       "persist_errors": failed[reported.get(mode, 0):],
                       "persists": [[r.step, r.cpu_s, r.replayed] for r in done if r.persisted],
                       "thread": {key: v[1:] for key, v in counters.items()}})
        reported[mode] = len(failed)
    return blocks


def persist_failures(ckpt: Checkpointer | None) -> list[str]:
    """Every failed durable write of ``ckpt`` so far, as "step k: why" (in submission order)."""
    results = (ckpt.persist_results() if ckpt is not None else None) or []
    return [f"step {r.step}: {r.error}" for r in results if not r.persisted]


def newest_durable_step(ckpt: Checkpointer | None) -> int | None:
    """The newest step this rank's checkpointer holds in durable storage (after a flush).

    ``sync`` writes its own fsynced ``torch.save`` files; the other modes commit to the DCP
    durable tier. Recorded per block so that the results show every block's persist landed: a
    persist that failed quietly would make a mode look cheaper than it is.
    """
    if ckpt is None:
        return None
    if isinstance(ckpt.strategy, SyncSave):
        steps = ckpt.strategy.files.steps()
        return steps[0] if steps else None
    assert ckpt.durable is not None
    return ckpt.durable.latest()


BUSY_LOOP = "while True: pass  # bubbleguard benchmarks/overhead.py --busy"
"""What each ``--busy`` process runs (the comment names it in ``ps``)."""


@contextlib.contextmanager
def busy_processes(n: int) -> Iterator[list[int]]:
    """``n`` processes that keep a core busy while the block runs; killed and reaped after it."""
    procs = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for _ in range(n)]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def run_interleaved(size: dict[str, Any], modes: Sequence[str], workdir: Path, ckpt_root: Path,
                    persist_every: int = BLOCK_STEPS) -> tuple[list[dict[str, Any]], list[float]]:
    """Launch the interleaved job; per block: rank 1's step times, both ranks' checkpoint
    time (blocking, in bubbles, flush)."""
    rounds = size["rounds"]
    steps = BLOCK_STEPS - 1 + BLOCK_STEPS * len(block_order(modes, rounds))
    cfg = _train_config(size, steps, str(workdir / "run"))
    try:
        results = launch_local(bench_worker, (cfg, tuple(modes), rounds, str(ckpt_root),
                                              persist_every), 2,
                               threads_per_rank=1)
    finally:
        for mode in modes:
            remove_job(job_id_for(str(ckpt_root / f"ckpt-{mode}")))
    last = results[1]
    blocks = []
    for b0, b1 in zip(results[0]["blocks"], last["blocks"], strict=True):
        assert (b0["mode"], b0["first_step"]) == (b1["mode"], b1["first_step"])
        blocks.append({**b1, **{key: {"0": b0[key], "1": b1[key]}
                                for key in ("blocking_s", "bubble_s", "overrun_s", "flush_s",
                                            "durable_step", "thread", "persists")}})
    return blocks, [float(x) for x in last["losses"]]


# ------------------------------------------------------------------------------ copy bandwidth


def stage_zero(size: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    """The benchmark's stage 0 (of 2), its AdamW optimizer, and the model's sequence length."""
    cfg = model_config("gpt", d_model=size["width"], num_layers=size["layers"])
    stage = split(build_model("gpt", seed=0, d_model=size["width"], num_layers=size["layers"]),
                  2, 0)
    return stage, torch.optim.AdamW(stage.parameters(), lr=1e-3), model_seq_len(cfg)


def stage_state(size: dict[str, Any]) -> StageState:
    """Stage 0's real state after one AdamW step (parameters, exp_avg, exp_avg_sq, step)."""
    stage, opt, seq_len = stage_zero(size)
    # Any gradient gives the optimizer its state; the loss does not matter here.
    stage(torch.randint(0, 256, (2, seq_len))).float().pow(2).mean().backward()
    opt.step()
    return capture_state(stage, opt, step=1)


def measure_bandwidth(size: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Snapshot copy against plain copies of the same bytes, each from cold caches.

    All in this process with one thread, like a rank. The plain copies write into ordinary
    buffers that were touched before (as the reused shared-memory slots are).
    """
    torch.set_num_threads(1)
    state = stage_state(size)
    tensors = state.all_tensors()
    total = state.num_bytes
    plain_dst = {k: torch.zeros_like(v) for k, v in tensors.items()}
    memcpy_src = {k: flat_bytes(v).numpy() for k, v in tensors.items()}
    memcpy_dst = {k: flat_bytes(v).numpy() for k, v in plain_dst.items()}
    evict = np.zeros(EVICT_BYTES, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        tier = MemoryTier("overhead-bench", 0, root=shm)

        def snapshot() -> float:
            # As the runtime does it: one chunk per run_one call, timed by the copier.
            copier = SnapshotCopier(tier)
            copier.start(state)
            while copier.run_one():
                pass
            copier.finish()
            assert copier.bandwidth_bytes_per_s is not None
            return copier.bandwidth_bytes_per_s

        def plain() -> float:
            t0 = time.perf_counter()
            for name, src in tensors.items():
                plain_dst[name].copy_(src)
            return total / (time.perf_counter() - t0)

        def memcpy() -> float:
            t0 = time.perf_counter()
            for name, src_np in memcpy_src.items():
                memcpy_dst[name][:] = src_np
            return total / (time.perf_counter() - t0)

        methods = {"snapshot": snapshot, "plain": plain, "memcpy": memcpy}
        runs: dict[str, list[float]] = {k: [] for k in methods}
        for f in methods.values():  # the first round maps and touches the pages
            f()
        for i in range(repeats):
            names = list(methods) if i % 2 == 0 else list(reversed(methods))
            for name in names:
                evict[::64] += 1  # one write per cache line: the caches now hold other data
                runs[name].append(methods[name]())
        chunk_bytes = tier.chunk_bytes
        tier.cleanup()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"state_bytes": total, "repeats": repeats, "chunk_bytes": chunk_bytes,
            "snapshot_bytes_per_s": med["snapshot"],
            "plain_copy_bytes_per_s": med["plain"],
            "memcpy_bytes_per_s": med["memcpy"],
            "snapshot_vs_plain": med["snapshot"] / med["plain"],
            "snapshot_vs_memcpy": med["snapshot"] / med["memcpy"],
            "all_runs_bytes_per_s": runs}


# ---------------------------------------------------------------------------------- reporting


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"mean": statistics.fmean(values), "median": statistics.median(values),
            "p25": q[0], "p75": q[2]}


def _bootstrap_overhead(per_round: list[tuple[list[float], list[float]]], samples: int = 2000,
                        ) -> tuple[float, float]:
    """95% interval of pooled mean(mode) / mean(none) - 1, resampling rounds."""
    rng = random.Random(0)
    ratios = []
    for _ in range(samples):
        pick = [per_round[rng.randrange(len(per_round))] for _ in per_round]
        mode = [t for m, _ in pick for t in m]
        none = [t for _, n in pick for t in n]
        ratios.append(statistics.fmean(mode) / statistics.fmean(none) - 1)
    ratios.sort()
    return ratios[int(0.025 * samples)], ratios[int(0.975 * samples) - 1]


def summarize(blocks: list[dict[str, Any]], modes: Sequence[str]) -> dict[str, Any]:
    """Per mode: step-time quantiles, overhead vs ``none`` (pooled and per round), blocking."""
    measured = [b for b in blocks if b["round"] >= 0]
    rounds = sorted({b["round"] for b in measured})

    def of(r: int, mode: str, key: str, rank: str | None = None) -> list[float]:
        """The values of ``key`` over the blocks of ``mode`` in round ``r``, concatenated."""
        return [x for b in measured if b["round"] == r and b["mode"] == mode
                for x in (b[key] if rank is None else b[key][rank])]

    out: dict[str, Any] = {}
    for mode in modes:
        times = [t for r in rounds for t in of(r, mode, "step_times_s")]
        none = [t for r in rounds for t in of(r, "none", "step_times_s")]
        pairs = [(of(r, mode, "step_times_s"), of(r, "none", "step_times_s")) for r in rounds]
        per_round = [statistics.fmean(m) / statistics.fmean(n) - 1 for m, n in pairs]
        low, high = _bootstrap_overhead(pairs) if len(rounds) > 1 else (per_round[0],) * 2
        ranks = sorted(measured[0]["blocking_s"])  # "0", "1" here; "0" in benchmarks/gpu.py
        out[mode] = {
            "num_steps": len(times),
            "step_time_s": _quantiles(times),
            "overhead": {"pooled_mean": statistics.fmean(times) / statistics.fmean(none) - 1,
                         "ci95": [low, high],
                         "median_of_rounds": statistics.median(per_round),
                         "min": min(per_round), "max": max(per_round), "per_round": per_round},
            "ckpt_blocking_s": {rank: statistics.fmean(
                [x for r in rounds for x in of(r, mode, "blocking_s", rank)]) for rank in ranks},
            "ckpt_bubble_s": {rank: statistics.fmean(
                [x for r in rounds for x in of(r, mode, "bubble_s", rank)]) for rank in ranks},
            "ckpt_overrun_s": {rank: statistics.fmean(
                [x for r in rounds for x in of(r, mode, "overrun_s", rank)]) for rank in ranks},
            "flush_s": {rank: statistics.median(
                [b["flush_s"][rank] for b in measured if b["mode"] == mode]) for rank in ranks},
        }
        if mode != "none":
            out[mode]["excess_by_position"] = excess_by_position(measured, mode)
            # Blocks whose persist (of their first step) was in durable storage at their end.
            mine = [b for b in measured if b["mode"] == mode]
            out[mode]["persisted_blocks"] = {
                "of": len(mine), **{rank: sum(b["durable_step"][rank] is not None
                                              and b["durable_step"][rank] >= b["first_step"]
                                              for b in mine) for rank in ranks}}
            if all("persists" in b for b in mine):
                out[mode]["persist_cpu_s"] = persist_cpu(mine, ranks)
    # Bubble against each ablation in the run, round by round: what the durable persists cost
    # (against bubble without them), what replaying saves (against its dcp.save twin).
    for ablation, key in ((SNAPSHOTS_ONLY, "persist_cost"), (DCP_SAVE, "vs_dcp_save")):
        if ablation not in modes:
            continue
        pairs = [(of(r, "bubble", "step_times_s"), of(r, ablation, "step_times_s"))
                 for r in rounds]
        ours = [t for m, _ in pairs for t in m]
        theirs = [t for _, n in pairs for t in n]
        out["bubble"][key] = {
            "pooled_mean": statistics.fmean(ours) / statistics.fmean(theirs) - 1,
            "ci95": list(_bootstrap_overhead(pairs)) if len(rounds) > 1 else None}
    return out


def persist_cpu(blocks: list[dict[str, Any]], ranks: list[str]) -> dict[str, Any]:
    """Per rank: how many persists finished in ``blocks``, how many were replayed, and the
    median helper CPU time of each kind (None where there were none)."""
    out: dict[str, Any] = {}
    for rank in ranks:
        rows = [p for b in blocks for p in b["persists"][rank]]
        replayed = [cpu for _, cpu, again in rows if again]
        saved = [cpu for _, cpu, again in rows if not again]
        out[rank] = {"count": len(rows), "replayed": len(replayed),
                     "median_replayed_s": statistics.median(replayed) if replayed else None,
                     "median_dcp_save_s": statistics.median(saved) if saved else None}
    return out


def excess_by_position(measured: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Where in its block ``mode``'s extra time sits: per measured step of a block (the
    block's persist starts at its first step, which is not measured), the mean over all rounds
    of ``mode``'s step time minus ``none``'s at the same position; the same for the training
    threads' CPU time and time runnable but off the CPU, per rank, where recorded. Seconds.
    The mean of ``step_s`` is the pooled mean step difference (every block has as many steps)."""
    def mean_at(m: str, pick: Callable[[dict[str, Any]], list[float]]) -> list[float]:
        rows = [pick(b) for b in measured if b["mode"] == m]
        return [statistics.fmean(col) for col in zip(*rows, strict=True)]

    def diff(pick: Callable[[dict[str, Any]], list[float]]) -> list[float]:
        return [a - b for a, b in zip(mean_at(mode, pick), mean_at("none", pick), strict=True)]

    out: dict[str, Any] = {"step_s": diff(lambda b: b["step_times_s"])}
    threads = measured[0].get("thread", {})  # per rank here; benchmarks/gpu.py has none
    for rank in sorted(r for r, v in threads.items() if isinstance(v, dict)):
        for key in ("cpu_s", "run_delay_s"):
            if all(key in b["thread"].get(rank, {}) for b in measured):
                out[f"{key}_{rank}"] = diff(lambda b, r=rank, k=key: b["thread"][r][k])
    return out


def at_most(limit: float, ci95: list[float] | None) -> str:
    """Whether a measured ratio is at most ``limit``, decided by its 95% interval, not by the
    point estimate alone: "met" (the whole interval is at or below), "not met" (the whole
    interval is above) or "undecided" (the interval straddles it, or there is none)."""
    if ci95 is None:
        return "undecided"
    if ci95[1] <= limit:
        return "met"
    return "not met" if ci95[0] > limit else "undecided"


def goals(modes: dict[str, Any], bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The issue's three goals, as measured."""
    bubble = modes["bubble"]["overhead"]
    # One round has no interval (its "ci95" is that round's ratio twice): nothing is decided.
    interval = bubble["ci95"] if len(bubble["per_round"]) > 1 else None
    out = {"bubble_overhead": bubble["pooled_mean"], "bubble_overhead_ci95": bubble["ci95"],
           "bubble_overhead_le_1pct": at_most(0.01, interval),
           "snapshot_vs_plain_copy": bandwidth["snapshot_vs_plain"],
           "bandwidth_ge_80pct": bandwidth["snapshot_vs_plain"] >= 0.8}
    if "dcp-async" not in modes:
        return out
    dcp = modes["dcp-async"]["overhead"]
    ratio = (dcp["pooled_mean"] / bubble["pooled_mean"] if bubble["pooled_mean"] > 0
             else float("inf"))
    max_block = {m: max(modes[m]["ckpt_blocking_s"].values()) for m in ("bubble", "dcp-async")}
    return {**out,
            "dcp_async_over_bubble_overhead": ratio,
            "dcp_async_over_bubble_blocking": (max_block["dcp-async"] / max_block["bubble"]
                                               if max_block["bubble"] > 0 else float("inf")),
            "bubble_5x_below_dcp_async": ratio >= 5}


def mode_table(modes: dict[str, Any]) -> list[str]:
    """The printed table's rows, one per mode (per-rank figures joined by '/')."""
    lines = [f"{'mode':>16} {'mean ms':>8} {'median':>7} {'overhead':>9} {'95% CI':>17} "
             f"{'rounds [min, max]':>19} {'blocking ms r0/r1':>18} {'flush ms r0/r1':>15} "
             f"{'persisted r0/r1':>16}"]
    for mode, m in modes.items():
        st, ov = m["step_time_s"], m["overhead"]
        block = "/".join(f"{v * 1e3:.2f}" for v in m["ckpt_blocking_s"].values())
        flush = "/".join(f"{v * 1e3:.0f}" for v in m["flush_s"].values())
        done = m.get("persisted_blocks")
        persisted = ("/".join(str(v) for k, v in done.items() if k != "of") + f" of {done['of']}"
                     if done else "-")
        lines.append(f"{mode:>16} {st['mean'] * 1e3:8.1f} {st['median'] * 1e3:7.1f} "
                     f"{ov['pooled_mean']:+9.2%} [{ov['ci95'][0]:+6.2%}, {ov['ci95'][1]:+6.2%}] "
                     f"[{ov['min']:+7.2%}, {ov['max']:+7.2%}] {block:>18} {flush:>15} "
                     f"{persisted:>16}")
    return lines


def table(modes: dict[str, Any], bandwidth: dict[str, Any]) -> str:
    """The printed table."""
    lines = mode_table(modes)
    gb = 1e9
    lines.append(
        f"copy bandwidth ({bandwidth['state_bytes'] / 1e6:.1f} MB stage state, 1 thread, cold "
        f"caches): snapshot (copy + checksum into shared memory) "
        f"{bandwidth['snapshot_bytes_per_s'] / gb:.2f} GB/s; plain Tensor.copy_ "
        f"{bandwidth['plain_copy_bytes_per_s'] / gb:.2f} GB/s (snapshot/plain "
        f"{bandwidth['snapshot_vs_plain']:.0%}); memcpy {bandwidth['memcpy_bytes_per_s'] / gb:.2f} "
        f"GB/s (snapshot/memcpy {bandwidth['snapshot_vs_memcpy']:.0%})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small model")
    parser.add_argument("--rounds", type=int, help="measured rounds (default 20; tiny 1)")
    parser.add_argument("--out", default="benchmarks/results", help="directory for overhead.json")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes to compare (none and bubble always run; "
                             f"{SNAPSHOTS_ONLY}: bubble without persists, only when named)")
    parser.add_argument("--ckpt-root", help="where the modes write their checkpoints (default: a "
                                            "temporary directory under $TMPDIR)")
    parser.add_argument("--no-persist", action="store_true",
                        help="ablation: snapshots every step but no durable persists")
    parser.add_argument("--batch-size", type=int, metavar="N",
                        help="rows per iteration, a multiple of the 4 microbatches (default 16; "
                             "tiny 8): a longer step for the same state to copy and persist")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="run the job beside N busy processes (a machine shared with other "
                             "work; the bandwidth is measured before they start)")
    args = parser.parse_args(argv)
    if args.busy < 0:
        parser.error(f"--busy must be >= 0, got {args.busy}")
    persist_every = 0 if args.no_persist else BLOCK_STEPS
    asked = set(args.modes.split(","))
    unknown = asked - {*MODES, *ABLATIONS}
    if unknown:
        parser.error(f"unknown mode(s) {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join((*MODES, *ABLATIONS))}")
    modes = tuple(m for m in (*MODES, *ABLATIONS) if m in {"none", "bubble", *asked})
    size = bench_size(args.tiny)
    if args.rounds:
        size["rounds"] = args.rounds
    if args.batch_size is not None:
        size["batch_size"] = args.batch_size
        try:  # the training configuration's own checks, before the long bandwidth measurement
            _train_config(size, 1, "")
        except ValueError as e:
            parser.error(str(e))
    started = time.perf_counter()
    code = code_version()  # now: the run takes an hour or more, and commits may land meanwhile
    bandwidth = measure_bandwidth(size, repeats=3 if args.tiny else 9)
    with tempfile.TemporaryDirectory(prefix="bubbleguard-overhead-") as work, \
            tempfile.TemporaryDirectory(prefix="bubbleguard-overhead-ckpt-",
                                        dir=args.ckpt_root) as ckpt_root:
        with busy_processes(args.busy):
            blocks, losses = run_interleaved(size, modes, Path(work), Path(ckpt_root),
                                             persist_every)
        identical = None
        if args.tiny:  # a plain run of the same steps: checkpointing must not change training
            metrics = Path(work) / "plain.jsonl"
            run_local(dataclasses.replace(_train_config(size, len(losses), f"{work}/plain"),
                                          metrics=str(metrics)))
            plain = [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]
            identical = plain == losses
    summary = summarize(blocks, modes)
    doc: dict[str, Any] = {
        "benchmark": "overhead",
        "command": " ".join(["python", "benchmarks/overhead.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "config": {"model": "gpt", "d_model": size["width"], "num_layers": size["layers"],
                   "stages": 2, "threads_per_rank": 1, "schedule": "1f1b",
                   "microbatches": size["microbatches"], "batch_size": size["batch_size"],
                   "block_steps": BLOCK_STEPS, "measured_steps_per_block": BLOCK_STEPS - 1,
                   "rounds": size["rounds"], "ckpt_every": 1, "persist_every": persist_every,
                   "busy_processes": args.busy},
        "code": code,
        "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - started,
        "ckpt_root": args.ckpt_root or tempfile.gettempdir(),
        "modes": summary,
        "copy_bandwidth": bandwidth,
        "goals": goals(summary, bandwidth),
        "losses_equal_plain_run": identical,
        "blocks": blocks,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(doc, indent=2))
    print(table(summary, bandwidth))
    g = doc["goals"]
    vs_dcp = (f"dcp-async/bubble overhead {g['dcp_async_over_bubble_overhead']:.1f}x, blocking "
              f"{g['dcp_async_over_bubble_blocking']:.1f}x (>= 5x: "
              f"{g['bubble_5x_below_dcp_async']}); " if "dcp-async" in summary else "")
    print(f"goals: bubble overhead {g['bubble_overhead']:+.2%} (95% CI "
          f"[{g['bubble_overhead_ci95'][0]:+.2%}, {g['bubble_overhead_ci95'][1]:+.2%}]; <= 1%: "
          f"{g['bubble_overhead_le_1pct']}); {vs_dcp}snapshot/plain copy "
          f"{g['snapshot_vs_plain_copy']:.0%} (>= 80%: {g['bandwidth_ge_80pct']})")
    for mode, m in summary.items():
        if "excess_by_position" in m:
            steps = " ".join(f"{x * 1e3:+.1f}" for x in m["excess_by_position"]["step_s"])
            print(f"{mode}: step time over none by step of the block (the persist starts with "
                  f"it), ms: {steps}")
    for key, label in (("persist_cost", f"persists: bubble over {SNAPSHOTS_ONLY}"),
                       ("vs_dcp_save", f"replayed persists: bubble over {DCP_SAVE}")):
        cost = summary["bubble"].get(key)
        if cost is not None:
            ci = (f" (95% CI [{cost['ci95'][0]:+.2%}, {cost['ci95'][1]:+.2%}])"
                  if cost["ci95"] else "")
            print(f"{label} {cost['pooled_mean']:+.2%}{ci}")
    for mode, m in summary.items():
        for rank, p in m.get("persist_cpu_s", {}).items():
            print(f"{mode} rank {rank}: {p['count']} persists, {p['replayed']} replayed; "
                  f"helper CPU median {_ms(p['median_replayed_s'])} replayed, "
                  f"{_ms(p['median_dcp_save_s'])} by dcp.save")
    if identical is False:
        print("WARNING: the interleaved run's losses differ from a plain run's")
    print(f"written to {out / 'overhead.json'} ({doc['wall_s']:.0f} s)")


def code_version() -> dict[str, Any]:
    """The commit this file was run from and whether ``src/`` or ``benchmarks/`` differed from it
    (a scratch build), so that runs of the same code can be told apart from others; ``{}``
    outside a git checkout."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"),
                "modified": bool(git("status", "--porcelain", "--", "src", "benchmarks"))}
    except (OSError, subprocess.CalledProcessError):
        return {}


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f} ms"


if __name__ == "__main__":
    main()
