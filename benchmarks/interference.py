"""How much the checkpoint's background work slows a training process on the other core, or
on its own core after a wait.

    python benchmarks/interference.py                 # ~5 min, writes benchmarks/results/interference.json
    python benchmarks/interference.py --same-core     # ~4 min, writes .../interference_same_core.json
    python benchmarks/interference.py --tiny --out D  # seconds; what the test suite runs

In a pipeline a stage copies its snapshot inside its bubble, which is when its neighbour computes,
and the persist helper runs when its rank waits. Neither takes the neighbour's CPU time, but both
move memory, and the cores share the last-level cache and the memory bus. The overhead benchmark
sees this only inside a noisy end-to-end figure; this one isolates it.

Method: process A, pinned to core 0, trains ``overhead.py``'s stage 0 (forward + backward of one
microbatch, then AdamW, 1 thread) in a loop and times each iteration. Process B, pinned to core
1, does one kind of work over and over during A's measurement; the kinds take turns (rotated per
repeat):

* ``idle``: B sleeps (the reference);
* ``snapshot``: ``MemoryTier.write`` of the stage's state into shared memory, i.e. the bubble
  copy with its per-chunk checksums;
* ``plain_copy``: ``Tensor.copy_`` of the same tensors into ordinary buffers;
* ``persist``: what the persist helper does once per persist, at its ``SCHED_IDLE`` priority
  (normal priority with ``--tiny``):
  ``MemoryTier.read`` of the snapshot into a reused buffer, then ``DurableTier.save`` (DCP,
  fsync, commit marker, retention) into a temporary directory.

Reported per kind: A's mean iteration, its slowdown against ``idle``, B's work done while A was
measured, and A's time lost per unit of that work: milliseconds per GB copied, and per persist.
A rank's step costs its neighbour about (lost ms per GB) x (GB snapshotted per step), plus
(lost ms per persist) once per persist.

``--same-core``: the cost a stage pays on its *own* core for the work done in its bubbles, which
is off the critical path but may evict what the compute after it needs (the weights, kept
warm from one microbatch to the next). An iteration of A is 4 microbatches (forward +
backward, gradients accumulating), each followed by a ``--gap-ms`` pause (a bubble), then the
AdamW step; only the compute is timed. In the pauses, per kind: ``idle`` sleeps; ``snapshot``
copies the state of the previous step into shared memory, a quarter of its chunks per pause
(``MemoryTier.begin``/``copy_chunk``/``finish``, as the bubble copier does), then sleeps the
rest; ``plain_copy`` copies a quarter of the tensors into ordinary buffers; ``persist``: B runs
on A's core at ``SCHED_IDLE``, so it gets only the pauses, as the persist helper does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import torch

from bubbleguard.checkpoint.state import capture_state
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from bubbleguard.elastic.forking import process_target

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import bench_size, stage_state, stage_zero  # noqa: E402

KINDS = ("idle", "snapshot", "plain_copy", "persist")
MICROBATCH_ROWS = 4  # the overhead benchmark's batch of 16 in 4 microbatches
SAME_CORE_MICROBATCHES = 4  # --same-core: microbatches per iteration, each with its pause


def _trainer(size: dict[str, Any], core: int, gap_s: float, microbatches: int, commands: Any,
             results: Any) -> None:
    """Process A: time training iterations for as long as each (kind, seconds) command says.

    An iteration is ``microbatches`` forwards + backwards (gradients accumulate) and one AdamW
    step; with ``gap_s``, each backward is followed by a pause of that length in which A does
    its share of the kind's work (see the module docstring). Only the compute is timed.
    """
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    stage, opt, seq_len = stage_zero(size)
    x = torch.randint(0, 256, (MICROBATCH_ROWS, seq_len), generator=torch.Generator().manual_seed(0))

    def forward_backward() -> float:
        start = time.perf_counter()
        stage(x).float().pow(2).mean().backward()
        return time.perf_counter() - start

    forward_backward()
    opt.step()  # the optimizer's state exists from here on
    opt.zero_grad()
    sources = capture_state(stage, opt, step=0).all_tensors()  # the live tensors
    plain_dst = {k: torch.empty_like(v) for k, v in sources.items()}
    names = list(plain_dst)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        memory = MemoryTier("interference-same-core", 0, root=shm)
        step = 0
        num_chunks = 0

        def pause(kind: str, mb: int) -> int:
            """Microbatch ``mb``'s bubble: its share of the work, then sleep; bytes copied.

            ``snapshot`` copies the state of the previous optimizer step over the pauses of
            the iteration, as the bubble copier does."""
            nonlocal step, num_chunks
            end = time.perf_counter() + gap_s
            copied = 0
            if kind == "snapshot":
                if mb == 0:
                    step += 1
                    num_chunks = memory.begin(capture_state(stage, opt, step=step)).num_chunks
                share = range(num_chunks * mb // microbatches,
                              num_chunks * (mb + 1) // microbatches)
                copied = sum(memory.copy_chunk(c) for c in share)
                if mb == microbatches - 1:
                    memory.finish()
            elif kind == "plain_copy":
                for name in names[len(names) * mb // microbatches:
                                  len(names) * (mb + 1) // microbatches]:
                    plain_dst[name].copy_(sources[name])
                    copied += plain_dst[name].numel() * plain_dst[name].element_size()
            time.sleep(max(0.0, end - time.perf_counter()))
            return copied

        while (command := commands.get()) is not None:
            kind, seconds = command
            times: list[float] = []
            copied = 0
            end = time.perf_counter() + seconds
            while time.perf_counter() < end or not times:
                took = 0.0
                for mb in range(microbatches):
                    took += forward_backward()
                    if gap_s:
                        copied += pause(kind, mb)
                start = time.perf_counter()
                opt.step()
                opt.zero_grad()
                times.append(took + time.perf_counter() - start)
            results.put((times, copied))
        memory.cleanup()


def _worker(size: dict[str, Any], kind: str, core: int, idle_priority: bool, measuring: Event,
            stop: Event, results: Any) -> None:
    """Process B: do ``kind`` over and over; count what was done while ``measuring`` was set."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    if kind == "persist":  # as the persist helper runs
        if idle_priority:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        torch.serialization.set_crc32_options(False)
    state = stage_state(size)
    tensors = state.all_tensors()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm, tempfile.TemporaryDirectory() as disk:
        memory = MemoryTier("interference-bench", 0, root=shm)
        durable = DurableTier(str(Path(disk) / "ckpt"), keep_last=2)
        plain_dst = {k: torch.empty_like(v) for k, v in tensors.items()}
        if kind == "persist":  # one snapshot, read again and again into one reused buffer
            memory.write(state)
            buffer = torch.empty(memory.records()[0].layout.total_bytes, dtype=torch.uint8)
        step = 0

        def unit() -> int:
            """One unit of the work; the bytes it copied (a persist counts as one)."""
            nonlocal step
            step += 1
            if kind == "snapshot":
                memory.write(dataclasses.replace(state, step=step))
                return state.num_bytes
            if kind == "plain_copy":
                for name, src in tensors.items():
                    plain_dst[name].copy_(src)
                return state.num_bytes
            assert kind == "persist"
            durable.save(dataclasses.replace(memory.read(state.step, out=buffer), step=step))
            return 1

        if kind != "idle":
            for _ in range(2):  # map and touch the pages before anything is measured
                unit()
        results.put("ready")
        done = 0
        while not stop.is_set():
            if kind == "idle":
                time.sleep(0.01)
                continue
            counted = measuring.is_set()
            n = unit()
            if counted and measuring.is_set():  # the whole unit ran while A was timed
                done += n
        memory.cleanup()
    results.put(done)


def run(size: dict[str, Any], seconds: float, repeats: int, *, idle_priority: bool = True,
        gap_s: float = 0.0) -> dict[str, Any]:
    """Every kind, ``repeats`` times each in rotated order, ``seconds`` of A's timing each.

    ``idle_priority=False`` persists at normal priority: on a machine busy with other work a
    ``SCHED_IDLE`` worker may not run at all (the tiny run only checks the plumbing).
    ``gap_s`` > 0: the same-core variant (see the module docstring): A pauses that long after
    each iteration and copies in the pause itself; B persists on A's core.
    """
    same_core = gap_s > 0
    if not same_core and len(os.sched_getaffinity(0)) < 2:
        raise SystemExit("interference.py needs 2 CPU cores (one per process); this process "
                         f"may use {len(os.sched_getaffinity(0))}")
    cores = sorted(os.sched_getaffinity(0))
    core_a = cores[0]
    core_b = core_a if same_core else cores[1]
    # Both processes fork from the launcher's server, which imported torch once: spawned, every
    # window's worker spent seconds of CPU importing it before the window could start.
    method, trainer_target = process_target(_trainer)
    _, worker_target = process_target(_worker)
    ctx = mp.get_context(method)
    commands, a_results = ctx.Queue(), ctx.Queue()
    microbatches = SAME_CORE_MICROBATCHES if same_core else 1
    trainer = ctx.Process(target=trainer_target,
                          args=(size, core_a, gap_s, microbatches, commands, a_results))
    trainer.start()
    for kind in ("snapshot", "plain_copy"):  # warm-up: maps and touches every buffer
        commands.put((kind, seconds))
        a_results.get()
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    work: dict[str, list[int]] = {k: [] for k in KINDS}
    window_s: dict[str, float] = dict.fromkeys(KINDS, 0.0)
    window_means: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        for r in range(repeats):
            for kind in KINDS[r % len(KINDS):] + KINDS[:r % len(KINDS)]:
                measuring, stop, b_results = ctx.Event(), ctx.Event(), ctx.Queue()
                # Same core: A copies in its own pauses; B only persists.
                b_kind = "idle" if same_core and kind != "persist" else kind
                worker = ctx.Process(target=worker_target,
                                     args=(size, b_kind, core_b, idle_priority, measuring, stop,
                                           b_results))
                worker.start()
                assert b_results.get() == "ready"
                measuring.set()
                start = time.perf_counter()
                commands.put((kind, seconds))
                a_times, a_copied = a_results.get()
                times[kind] += a_times
                window_means[kind].append(statistics.fmean(a_times))
                window_s[kind] += time.perf_counter() - start
                measuring.clear()
                stop.set()
                work[kind].append(b_results.get() + a_copied)
                worker.join()
    finally:
        commands.put(None)
        trainer.join()
    idle = statistics.fmean(times["idle"])
    out: dict[str, Any] = {}
    for kind in KINDS:
        mean = statistics.fmean(times[kind])
        lost_s = (mean - idle) * len(times[kind])  # A's time lost over all its windows
        done = sum(work[kind])
        row = {"iterations": len(times[kind]), "mean_iteration_s": mean,
               "median_iteration_s": statistics.median(times[kind]),
               "slowdown": mean / idle - 1, "window_s": window_s[kind]}
        # The same ratio per repeat, against that repeat's idle window (drift cancels).
        paired = [w / i - 1 for w, i in zip(window_means[kind], window_means["idle"], strict=True)]
        row["slowdown_per_repeat"] = {"median": statistics.median(paired),
                                      "min": min(paired), "max": max(paired)}
        if kind in ("snapshot", "plain_copy"):
            row["copied_bytes"] = done
            row["copied_bytes_per_s"] = done / window_s[kind]
            row["lost_ms_per_gb"] = lost_s * 1e3 / (done / 1e9) if done else None
        elif kind == "persist":
            row["persists"] = done
            row["lost_ms_per_persist"] = lost_s * 1e3 / done if done else None
        out[kind] = row
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a small model, short windows")
    parser.add_argument("--seconds", type=float, help="A's timing window per kind (default 6; "
                                                      "tiny 0.5)")
    parser.add_argument("--repeats", type=int, help="windows per kind (default 10; tiny 1)")
    parser.add_argument("--out", default="benchmarks/results",
                        help="directory for interference.json")
    parser.add_argument("--same-core", action="store_true",
                        help="the work runs on the trainer's own core, in a pause after each "
                             "iteration (writes interference_same_core.json)")
    parser.add_argument("--gap-ms", type=float, default=20.0,
                        help="--same-core: the pause after each iteration (default 20 ms, about "
                             "stage 0's bubble per microbatch in overhead.py)")
    args = parser.parse_args(argv)
    if args.gap_ms <= 0:
        parser.error(f"--gap-ms must be > 0, got {args.gap_ms}")
    size = bench_size(args.tiny)
    seconds = args.seconds or (0.5 if args.tiny else 6.0)
    repeats = args.repeats or (1 if args.tiny else 10)
    gap_s = args.gap_ms / 1e3 if args.same_core else 0.0
    start = time.perf_counter()
    kinds = run(size, seconds, repeats, idle_priority=not args.tiny, gap_s=gap_s)
    name = "interference_same_core" if args.same_core else "interference"
    doc = {"benchmark": name, "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
           "config": {"model": "gpt", "d_model": size["width"], "num_layers": size["layers"],
                      "stage": "0 of 2", "microbatch_rows": MICROBATCH_ROWS,
                      "seconds_per_window": seconds, "repeats": repeats,
                      "same_core": args.same_core, "gap_s": gap_s,
                      "state_bytes": stage_state(size).num_bytes},
           "torch": torch.__version__, "machine": platform.platform(),
           "cpu_count": os.cpu_count(), "wall_s": time.perf_counter() - start, "kinds": kinds}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(f"{'work':>11} {'A mean ms':>10} {'slowdown':>9}  per unit of the work"
          + (f" (A's own, in a {args.gap_ms:g} ms pause after each microbatch)"
             if args.same_core else " (B's, on the other core)"))
    for kind, row in kinds.items():
        if "lost_ms_per_gb" in row:
            unit = (f"{row['copied_bytes_per_s'] / 1e9:.2f} GB/s copied, A lost "
                    f"{row['lost_ms_per_gb']:.1f} ms per GB" if row["lost_ms_per_gb"] is not None
                    else "nothing copied")
        elif "lost_ms_per_persist" in row:
            unit = (f"{row['persists']} persists, A lost {row['lost_ms_per_persist']:.2f} ms per "
                    "persist" if row["lost_ms_per_persist"] is not None else "no persist done")
        else:
            unit = "(reference)"
        spread = row["slowdown_per_repeat"]
        print(f"{kind:>11} {row['mean_iteration_s'] * 1e3:10.2f} {row['slowdown']:+9.2%}  {unit}; "
              f"per repeat {spread['median']:+.2%} [{spread['min']:+.2%}, {spread['max']:+.2%}]")
    print(f"wrote {out / (name + '.json')} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
