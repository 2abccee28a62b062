"""Checkpoint overhead on a GPU, and device-to-host snapshot bandwidth (needs a CUDA device).

    python benchmarks/gpu.py                   # writes benchmarks/results/gpu.json (a few minutes)
    python benchmarks/gpu.py --tiny --out D    # seconds

Setup: the built-in GPT (``d_model`` 1024, 8 layers, 16 heads, 256 tokens, batch 32 by default:
~100M parameters, a 1.2 GB state with AdamW's) as one stage on one GPU, fp32; a snapshot every
step and a durable persist every 10, for every mode. One GPU holds one stage, so there are no
pipeline bubbles here: ``bubble``'s copies go on a side stream into registered shared memory,
where the copy engine runs them alongside compute, and their checksums run in the job's helper
thread on a CPU core the training thread does not use (see ``PipelineJob``).

Method, as in ``overhead.py``: the modes take turns inside one process in blocks of 10 steps
(rounds of ``none, bubble, none, <baseline>``, the baselines rotating), the first step of a block
unmeasured; a step's time is the wall time of ``job.step``, which reads the loss back (a device
sync). Overhead = mean step of the mode / mean step of ``none`` - 1 over all rounds, with a 95%
bootstrap interval over rounds.

Copy bandwidth, on the benchmark model's real state after one step, median of ``--repeats``:
the snapshot as the copier makes it (side-stream copies into registered shared memory, with
the per-chunk checksums pipelined behind them), the same copies without the checksums, a plain
``Tensor.copy_(non_blocking=True)`` into pinned buffers (what the copy engine can do), and into
ordinary (pageable) CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bubbleguard.checkpoint.checkpointer import job_id_for
from bubbleguard.checkpoint.copier import SnapshotCopier
from bubbleguard.checkpoint.layout import default_chunk_bytes
from bubbleguard.checkpoint.state import StageState, capture_state
from bubbleguard.checkpoint.tiers.shm import MemoryTier, remove_job
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.stage import split
from bubbleguard.pipeline.timeline import EventKind

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import (  # noqa: E402 -- the sibling benchmark's method, reused
    BLOCK_STEPS,
    MODES,
    block_order,
    goals,
    mode_checkpointers,
    mode_table,
    run_blocks,
    summarize,
)


def bench_size(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"width": 64, "layers": 2, "heads": 4, "seq_len": 32, "batch_size": 4,
                "rounds": 1}
    return {"width": 1024, "layers": 8, "heads": 16, "seq_len": 256, "batch_size": 32,
            "rounds": 3}


def build_job(size: dict[str, Any]) -> PipelineJob:
    model = build_model("gpt", seed=0, d_model=size["width"], num_layers=size["layers"],
                        num_heads=size["heads"], seq_len=size["seq_len"])
    stage = split(model, 1, 0).to(size["device"])
    return PipelineJob(stage, torch.optim.AdamW(stage.parameters(), lr=1e-4), lm_loss,
                       num_microbatches=1)


class Batches:
    """Random byte sequences made on the device; the cursor is the batch index."""

    def __init__(self, size: dict[str, Any]) -> None:
        self.size = size
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.size["device"]
        g = torch.Generator(device=device).manual_seed(self.index)
        self.index += 1
        rows = torch.randint(0, 256, (self.size["batch_size"], self.size["seq_len"] + 1),
                             device=device, generator=g)
        return rows[:, :-1], rows[:, 1:]


def shm_root(state_bytes: int) -> str | None:
    """/dev/shm when it holds the benchmark's snapshots (three per mode), else the temp dir."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 12 * state_bytes:
        return None
    return tempfile.gettempdir()


# ---------------------------------------------------------------------------------- overhead


def run_interleaved(size: dict[str, Any], modes: Sequence[str], ckpt_root: str,
                    shm: str | None) -> list[dict[str, Any]]:
    """Every mode's blocks in turn in this process (see the module docstring); per-rank
    figures under rank "0", as ``overhead.summarize`` reads them. Each block also gets
    ``blocking_by_phase``: its measured steps' blocking time summed per timeline name
    (``CKPT begin``/``CKPT finish``: the hooks; ``CKPT pause``: waiting for the helper's unit)."""
    job = build_job(size)
    batches = Batches(size)
    ckpts = mode_checkpointers(job, modes, ckpt_root, batches.state_dict, shm,
                               chunk_bytes=size.get("chunk_bytes"))
    phases: dict[int, dict[str, float]] = {}  # step -> name -> seconds

    def step() -> tuple[float, dict[str, float]]:
        inputs, targets = batches.next()
        events = job.timeline.events
        first_event = len(events)
        start = time.perf_counter()
        job.step(inputs, targets)  # returns the loss as a float: the step ends on the device
        elapsed = time.perf_counter() - start
        mine = phases.setdefault(job.step_count, {})
        for e in events[first_event:]:
            if e.kind == EventKind.CHECKPOINT and e.name != "ckpt chunk":
                mine[e.name] = mine.get(e.name, 0.0) + e.duration_s
        del events[:]  # the benchmark reads each step's events once: keep memory flat
        return elapsed, dict(job.last_stats)

    try:
        blocks = run_blocks(job, ckpts, step, block_order(modes, size["rounds"]))
        for b in blocks:
            by_phase: dict[str, float] = {}
            for k in range(b["first_step"] + 1, b["first_step"] + BLOCK_STEPS):
                for name, seconds in phases.get(k, {}).items():
                    by_phase[name] = by_phase.get(name, 0.0) + seconds
            b["blocking_by_phase"] = by_phase
    finally:
        for ckpt in ckpts.values():
            ckpt.close()
        job.close()
        for mode in modes:
            remove_job(job_id_for(f"{ckpt_root}/ckpt-{mode}"), shm)
    per_rank = ("blocking_s", "bubble_s", "overrun_s", "flush_s", "durable_step", "persists")
    return [{**b, **{key: {"0": b[key]} for key in per_rank}} for b in blocks]


# ------------------------------------------------------------------------------ copy bandwidth


def stage_state(size: dict[str, Any]) -> StageState:
    """The benchmark stage's state after one AdamW step, on the device."""
    job = build_job(size)
    job.step(*Batches(size).next())
    return capture_state(job.stage, job.optimizer, step=1)


def measure_bandwidth(state: StageState, repeats: int, shm: str | None,
                      chunk_bytes: int) -> dict[str, Any]:
    """Device-to-host copies of ``state`` four ways (see the module docstring)."""
    on_gpu = any(t.is_cuda for t in state.tensors.values())
    tensors = {k: v for k, v in state.all_tensors().items() if v.is_cuda or not on_gpu}
    device_state = StageState(step=1, tensors=tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    pinned = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=on_gpu)
              for k, v in tensors.items()}
    pageable = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in tensors.items()}
    tier = MemoryTier("gpu-bench-bandwidth", 0, root=shm, chunk_bytes=chunk_bytes)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize()

    def timed(f: Any) -> float:
        sync()
        t0 = time.perf_counter()
        f()
        sync()
        return total / (time.perf_counter() - t0)

    def snapshot() -> None:
        # As the job's helper thread runs it: queue every chunk, checksum each as it lands.
        copier = SnapshotCopier(tier)
        copier.start(device_state)
        while copier.has_work():
            copier.run_one()
        copier.finish()

    def to_pinned() -> None:
        for k, v in tensors.items():
            pinned[k].copy_(v, non_blocking=True)

    def to_pageable() -> None:
        for k, v in tensors.items():
            pageable[k].copy_(v)

    runs: dict[str, list[float]] = {}
    copy_only_runs: list[float] = []
    methods = {"snapshot": snapshot, "pinned": to_pinned, "pageable": to_pageable}
    for f in methods.values():  # the first round maps, registers and touches the pages
        f()
    for i in range(repeats):
        for name in (list(methods) if i % 2 == 0 else list(reversed(methods))):
            runs.setdefault(name, []).append(timed(methods[name]))
        # The snapshot's copies alone: queued and landed, the checksums after the clock stops
        # (on the CPU they are fused with the copies).
        sync()
        t0 = time.perf_counter()
        layout = tier.begin(device_state)
        for chunk_id in range(layout.num_chunks):
            tier.copy_chunk(chunk_id)
        sync()
        copy_only_runs.append(total / (time.perf_counter() - t0))
        tier.finish()
    runs["snapshot_copies_only"] = copy_only_runs
    tier.cleanup()
    med = {k: statistics.median(v) for k, v in runs.items()}
    return {"state_bytes": total, "repeats": repeats, "chunk_bytes": tier.chunk_bytes,
            "snapshot_bytes_per_s": med["snapshot"],
            "snapshot_copies_only_bytes_per_s": med["snapshot_copies_only"],
            "pinned_copy_bytes_per_s": med["pinned"],
            "pageable_copy_bytes_per_s": med["pageable"],
            # goals() compares the snapshot with a plain copy: here the pinned one.
            "snapshot_vs_plain": med["snapshot"] / med["pinned"],
            "all_runs_bytes_per_s": runs}


# ----------------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small model")
    parser.add_argument("--rounds", type=int, help="measured rounds (default 3; tiny 1)")
    parser.add_argument("--layers", type=int, help="transformer blocks (default 8)")
    parser.add_argument("--repeats", type=int, default=7, help="bandwidth runs per method")
    parser.add_argument("--chunk-mb", type=float,
                        help="snapshot chunk size in MiB (default: CheckpointConfig's, 64 on a "
                             "GPU)")
    parser.add_argument("--out", default="benchmarks/results", help="directory for the results")
    parser.add_argument("--name", default="gpu", help="results file name (without .json)")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated modes to compare (none and bubble always run)")
    parser.add_argument("--ckpt-root", help="where the modes write their checkpoints (default: a "
                                            "temporary directory under $TMPDIR)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cpu only checks the harness (the test suite runs it --tiny)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA device (torch.cuda.is_available() is False); "
                     "--device cpu runs the harness on the CPU")
    modes = tuple(m for m in MODES if m in {"none", "bubble", *args.modes.split(",")})
    size = bench_size(args.tiny)
    if args.rounds:
        size["rounds"] = args.rounds
    if args.layers:
        size["layers"] = args.layers
    size["device"] = args.device
    if args.chunk_mb:
        size["chunk_bytes"] = max(64, int(args.chunk_mb * 2**20) // 64 * 64)
    started = time.perf_counter()
    state = stage_state(size)
    shm = shm_root(state.num_bytes)
    bandwidth = measure_bandwidth(state, 3 if args.tiny else args.repeats, shm,
                                  size.get("chunk_bytes") or default_chunk_bytes(args.device))
    del state
    if args.device == "cuda":
        torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory(prefix="bubbleguard-gpu-ckpt-", dir=args.ckpt_root) as ckpt_root:
        blocks = run_interleaved(size, modes, ckpt_root, shm)
    summary = summarize(blocks, modes)
    doc = {
        "benchmark": "gpu",
        "command": " ".join(["python", "benchmarks/gpu.py",
                             *(sys.argv[1:] if argv is None else argv)]),
        "config": {"model": "gpt", "d_model": size["width"], "num_layers": size["layers"],
                   "num_heads": size["heads"], "seq_len": size["seq_len"],
                   "batch_size": size["batch_size"], "stages": 1, "dtype": "float32",
                   "block_steps": BLOCK_STEPS, "measured_steps_per_block": BLOCK_STEPS - 1,
                   "rounds": size["rounds"], "ckpt_every": 1, "persist_every": BLOCK_STEPS,
                   "chunk_bytes": size.get("chunk_bytes") or default_chunk_bytes(args.device),
                   "shm_root": shm or "/dev/shm",
                   "ckpt_root": args.ckpt_root or tempfile.gettempdir()},
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "wall_s": time.perf_counter() - started,
        "modes": summary,
        "copy_bandwidth": bandwidth,
        "goals": goals(summary, bandwidth),
        "blocks": blocks,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{args.name}.json").write_text(json.dumps(doc, indent=2))
    print("\n".join(mode_table(summary)))
    for mode in modes:
        mine = [b for b in blocks if b["mode"] == mode]
        steps = sum(len(b["step_times_s"]) for b in mine)
        names = sorted({n for b in mine for n in b["blocking_by_phase"]})
        if names:
            per_step = {n: sum(b["blocking_by_phase"].get(n, 0.0) for b in mine) / steps
                        for n in names}
            print(f"{mode} blocking per step: " + ", ".join(
                f"{n} {1e3 * v:.2f} ms" for n, v in per_step.items()))
    gb = 1e9
    print(f"D2H copy of a {bandwidth['state_bytes'] / 1e9:.2f} GB state on "
          f"{doc['device']}: snapshot (copies + checksums) "
          f"{bandwidth['snapshot_bytes_per_s'] / gb:.1f} GB/s, its copies alone "
          f"{bandwidth['snapshot_copies_only_bytes_per_s'] / gb:.1f} GB/s; plain copy into "
          f"pinned {bandwidth['pinned_copy_bytes_per_s'] / gb:.1f} GB/s, into pageable "
          f"{bandwidth['pageable_copy_bytes_per_s'] / gb:.1f} GB/s "
          f"(snapshot/pinned {bandwidth['snapshot_vs_plain']:.0%})")
    print(f"goals: {json.dumps(doc['goals'])}")
    print(f"written to {out / (args.name + '.json')} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
