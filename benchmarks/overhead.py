"""Checkpoint overhead of every mode against no checkpoints, and snapshot copy bandwidth.

    python benchmarks/overhead.py                 # full size (~8 min), writes benchmarks/results/overhead.json
    python benchmarks/overhead.py --tiny --out D  # seconds; what the test suite runs

Setup: 2 pipeline stages x 1 thread (one rank per core), 1F1B with 4 microbatches, the built-in GPT
sized so that one stage's state (parameters + AdamW state) is tens of MB; a snapshot every
iteration (``--ckpt-every 1``) and a durable persist every 10 (``--persist-every 10``) for every
mode. The modes run interleaved: each round runs every mode once, in an order rotated by one per
round, so that drift of the machine (other load, thermal, page cache) spreads over all modes.

Reported per mode, over the steps after the warm-up of each run, on the last stage (which
reports the step times):

* step time: median, 25th/75th percentile and mean over all rounds;
* overhead vs ``none``: per round, the mode's median step time over ``none``'s in the same round,
  minus 1; the table shows the median over rounds and the [min, max] spread, and the overhead of
  the mean step time (which, unlike the median, includes the steps a persist lands on);
* ``ckpt_blocking_s``: median per step of the time the training thread spent in checkpoint hooks
  (``after_step`` + ``before_step``), for each rank, from the runs' timelines.

Copy bandwidth, measured in this process (1 thread, like a rank) on a stage's real state: the
snapshot copy as the bubble copier does it (shared-memory chunk copy including the per-chunk
checksum, ``SnapshotCopier.bandwidth_bytes_per_s``), its copy and checksum parts alone, and a
plain ``Tensor.copy_`` of the same bytes into a preallocated buffer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bubbleguard.checkpoint.checksum import checksum
from bubbleguard.checkpoint.copier import SnapshotCopier
from bubbleguard.checkpoint.layout import flat_bytes
from bubbleguard.checkpoint.state import StageState, capture_state
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from bubbleguard.elastic.launcher import LaunchError
from bubbleguard.models import build_model, model_config, model_seq_len
from bubbleguard.pipeline.stage import split
from bubbleguard.pipeline.timeline import EventKind, TimelineEvent
from bubbleguard.train import TrainConfig, run_local

MODES = ("none", "sync", "background", "dcp-async", "bubble")
BLOCKING_EVENTS = ("CKPT begin", "CKPT finish")


def _size(tiny: bool) -> dict[str, Any]:
    if tiny:
        return {"width": 32, "layers": 2, "steps": 5, "warmup": 2, "rounds": 1,
                "persist_every": 2, "microbatches": 4, "batch_size": 8}
    return {"width": 384, "layers": 4, "steps": 30, "warmup": 5, "rounds": 3,
            "persist_every": 10, "microbatches": 4, "batch_size": 16}


# ------------------------------------------------------------------------------- training runs


def run_mode(mode: str, size: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """One training run of ``mode``; step times (last stage) and blocking time per rank/step."""
    run_dir = workdir / f"run-{mode}"
    ckpt_dir = workdir / f"ckpt-{mode}"
    metrics = workdir / f"metrics-{mode}.jsonl"
    cfg = TrainConfig(model="gpt", stages=2, microbatches=size["microbatches"],
                      batch_size=size["batch_size"], schedule="1f1b", steps=size["steps"],
                      model_options={"d_model": size["width"], "num_layers": size["layers"]},
                      run_dir=str(run_dir), metrics=str(metrics), threads=1, progress=False,
                      ckpt=mode, ckpt_dir="" if mode == "none" else str(ckpt_dir),
                      ckpt_every=1, persist_every=size["persist_every"])
    start = time.perf_counter()
    failed = []
    for _attempt in range(2):
        try:
            result = run_local(cfg)
            break
        except LaunchError as e:  # report it and run the mode again, once
            print(f"{mode}: run failed ({e}); running it again", flush=True)
            failed.append(str(e))
            for path in (run_dir, ckpt_dir):
                shutil.rmtree(path, ignore_errors=True)
            metrics.unlink(missing_ok=True)
    else:
        raise RuntimeError(f"mode {mode} failed twice: {failed}")
    wall_s = time.perf_counter() - start
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    measured = [r for r in lines if r["step"] > size["warmup"]]
    blocking = _blocking_per_rank(result.events, size["warmup"], size["steps"])
    for path in (run_dir, ckpt_dir, metrics):
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return {"step_times_s": [r["step_time_s"] for r in measured],
            "losses": [r["loss"] for r in lines],
            "blocking_s": blocking, "wall_s": wall_s, "failed_attempts": failed}


def _blocking_per_rank(events: Sequence[TimelineEvent], warmup: int, steps: int,
                       ) -> dict[str, list[float]]:
    per: dict[int, list[float]] = {}
    for e in events:
        per.setdefault(e.rank, [0.0] * (steps + 1))
        if e.kind == EventKind.CHECKPOINT and e.name in BLOCKING_EVENTS:
            per[e.rank][e.step] += e.duration_s
    return {str(rank): values[warmup + 1:] for rank, values in sorted(per.items())}


# ------------------------------------------------------------------------------ copy bandwidth


def _stage_state(size: dict[str, Any]) -> StageState:
    """Stage 0's real state after one AdamW step (parameters, exp_avg, exp_avg_sq, step)."""
    cfg = model_config("gpt", d_model=size["width"], num_layers=size["layers"])
    stage = split(build_model("gpt", seed=0, d_model=size["width"], num_layers=size["layers"]),
                  2, 0)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    # Any gradient gives the optimizer its state; the loss does not matter here.
    stage(torch.randint(0, 256, (2, model_seq_len(cfg)))).float().pow(2).mean().backward()
    opt.step()
    return capture_state(stage, opt, step=1)


def measure_bandwidth(size: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Snapshot copy (chunk copy + checksum, as the copier times it) against plain copies.

    All in this process with one thread, like a rank. The plain copies write the same bytes into
    an ordinary buffer that was touched before (as the reused shared-memory slots are):
    ``Tensor.copy_`` per tensor, and ``memcpy`` (through NumPy) per tensor. A separate checksum
    pass over the same bytes shows what fusing the checksum into the copy saves.
    """
    torch.set_num_threads(1)
    state = _stage_state(size)
    tensors = state.all_tensors()
    total = state.num_bytes
    plain_dst = {k: torch.empty_like(v) for k, v in tensors.items()}
    memcpy_src = {k: flat_bytes(v).numpy() for k, v in tensors.items()}
    memcpy_dst = {k: flat_bytes(v).numpy() for k, v in plain_dst.items()}
    flat = torch.zeros(-(-total // 8) * 8, dtype=torch.uint8)
    runs: dict[str, list[float]] = {"snapshot": [], "plain": [], "memcpy": [], "checksum": []}
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as shm:
        tier = MemoryTier("overhead-bench", 0, root=shm)
        for _ in range(repeats + 1):  # the first round maps and touches the pages
            # As the runtime does it: one chunk per run_one call, timed by the copier.
            copier = SnapshotCopier(tier)
            copier.start(state)
            while copier.run_one():
                pass
            copier.finish()
            assert copier.bandwidth_bytes_per_s is not None
            runs["snapshot"].append(copier.bandwidth_bytes_per_s)
            t0 = time.perf_counter()
            for name, src in tensors.items():
                plain_dst[name].copy_(src)
            runs["plain"].append(total / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for name, src_np in memcpy_src.items():
                memcpy_dst[name][:] = src_np
            runs["memcpy"].append(total / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            for start in range(0, flat.numel(), tier.chunk_bytes):
                checksum(flat[start:start + tier.chunk_bytes], tier.checksum)
            runs["checksum"].append(flat.numel() / (time.perf_counter() - t0))
        tier.cleanup()
    med = {k: statistics.median(v[1:]) for k, v in runs.items()}
    return {"state_bytes": total, "repeats": repeats, "chunk_bytes": tier.chunk_bytes,
            "snapshot_bytes_per_s": med["snapshot"],
            "plain_copy_bytes_per_s": med["plain"],
            "memcpy_bytes_per_s": med["memcpy"],
            "separate_checksum_bytes_per_s": med["checksum"],
            "snapshot_vs_plain": med["snapshot"] / med["plain"],
            "snapshot_vs_memcpy": med["snapshot"] / med["memcpy"],
            "all_runs_bytes_per_s": {k: v[1:] for k, v in runs.items()}}


# ---------------------------------------------------------------------------------- reporting


def _quantiles(values: Sequence[float]) -> dict[str, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2],
            "mean": statistics.fmean(values)}


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: step-time quantiles, overhead vs ``none`` (per round and pooled), blocking."""
    out: dict[str, Any] = {}
    for mode in MODES:
        times = [t for r in rounds for t in r["runs"][mode]["step_times_s"]]
        per_round = [statistics.median(r["runs"][mode]["step_times_s"])
                     / statistics.median(r["runs"]["none"]["step_times_s"]) - 1 for r in rounds]
        per_round_mean = [statistics.fmean(r["runs"][mode]["step_times_s"])
                          / statistics.fmean(r["runs"]["none"]["step_times_s"]) - 1
                          for r in rounds]
        ranks = sorted(rounds[0]["runs"][mode]["blocking_s"])
        blocking = {rank: statistics.median(
            [b for r in rounds for b in r["runs"][mode]["blocking_s"][rank]]) for rank in ranks}
        blocking_mean = {rank: statistics.fmean(
            [b for r in rounds for b in r["runs"][mode]["blocking_s"][rank]]) for rank in ranks}
        out[mode] = {
            "num_steps": len(times),
            "step_time_s": _quantiles(times),
            "overhead": {"median": statistics.median(per_round), "min": min(per_round),
                         "max": max(per_round), "per_round": per_round,
                         "mean_step": statistics.median(per_round_mean)},
            "ckpt_blocking_s": {"median": blocking, "mean": blocking_mean},
        }
    return out


def goals(modes: dict[str, Any], bandwidth: dict[str, Any]) -> dict[str, Any]:
    """The issue's three goals, as measured."""
    bubble, dcp = modes["bubble"], modes["dcp-async"]
    max_block = {m: max(modes[m]["ckpt_blocking_s"]["mean"].values()) for m in ("bubble",
                                                                                  "dcp-async")}
    overhead_ratio = (dcp["overhead"]["median"] / bubble["overhead"]["median"]
                      if bubble["overhead"]["median"] > 0 else float("inf"))
    return {
        "bubble_overhead_median": bubble["overhead"]["median"],
        "bubble_overhead_le_1pct": bubble["overhead"]["median"] <= 0.01,
        "dcp_async_over_bubble_overhead": overhead_ratio,
        "dcp_async_over_bubble_blocking": (max_block["dcp-async"] / max_block["bubble"]
                                           if max_block["bubble"] > 0 else float("inf")),
        "bubble_5x_below_dcp_async": overhead_ratio >= 5,
        "snapshot_vs_plain_copy": bandwidth["snapshot_vs_plain"],
        "bandwidth_ge_80pct": bandwidth["snapshot_vs_plain"] >= 0.8,
    }


def table(modes: dict[str, Any], bandwidth: dict[str, Any]) -> str:
    """The printed table."""
    lines = [f"{'mode':>10} {'step ms':>8} {'p25-p75 ms':>13} {'overhead':>9} "
             f"{'[min, max]':>17} {'mean ovh':>9} {'blocking ms (rank0/rank1)':>26}"]
    for mode, m in modes.items():
        st, ov = m["step_time_s"], m["overhead"]
        block = "/".join(f"{v * 1e3:.2f}" for v in m["ckpt_blocking_s"]["median"].values())
        lines.append(f"{mode:>10} {st['median'] * 1e3:8.1f} "
                     f"{st['p25'] * 1e3:6.1f}-{st['p75'] * 1e3:<6.1f} {ov['median']:9.2%} "
                     f"[{ov['min']:+7.2%}, {ov['max']:+7.2%}] {ov['mean_step']:9.2%} "
                     f"{block:>26}")
    gb = 1e9
    lines.append(
        f"copy bandwidth ({bandwidth['state_bytes'] / 1e6:.1f} MB stage state, 1 thread): "
        f"snapshot (copy + checksum, fused) {bandwidth['snapshot_bytes_per_s'] / gb:.2f} GB/s; "
        f"plain Tensor.copy_ {bandwidth['plain_copy_bytes_per_s'] / gb:.2f} GB/s "
        f"(snapshot/plain {bandwidth['snapshot_vs_plain']:.0%}); "
        f"plain memcpy {bandwidth['memcpy_bytes_per_s'] / gb:.2f} GB/s "
        f"(snapshot/memcpy {bandwidth['snapshot_vs_memcpy']:.0%}); "
        f"a separate checksum pass {bandwidth['separate_checksum_bytes_per_s'] / gb:.2f} GB/s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a few steps of a small model")
    parser.add_argument("--rounds", type=int, help="rounds of all modes (default 3; tiny 1)")
    parser.add_argument("--out", default="benchmarks/results", help="directory for overhead.json")
    args = parser.parse_args(argv)
    size = _size(args.tiny)
    if args.rounds:
        size["rounds"] = args.rounds
    started = time.perf_counter()
    bandwidth_before = measure_bandwidth(size, repeats=1 if args.tiny else 7)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bubbleguard-overhead-") as work:
        for r in range(size["rounds"]):
            order = list(MODES[r % len(MODES):] + MODES[:r % len(MODES)])
            runs = {}
            for mode in order:
                runs[mode] = run_mode(mode, size, Path(work))
                times = runs[mode]["step_times_s"]
                print(f"round {r + 1}/{size['rounds']} {mode:>10}: median step "
                      f"{statistics.median(times) * 1e3:7.1f} ms ({runs[mode]['wall_s']:.0f} s)",
                      flush=True)
            rounds.append({"order": order, "runs": runs})
    bandwidth_after = measure_bandwidth(size, repeats=1 if args.tiny else 7)
    bandwidth = (bandwidth_before if bandwidth_before["snapshot_vs_plain"]
                 <= bandwidth_after["snapshot_vs_plain"] else bandwidth_after)
    # Losses must not depend on the checkpoint mode: a mode that changed training is a bug.
    reference = rounds[0]["runs"]["none"]["losses"]
    changed = [m for r in rounds for m, run in r["runs"].items() if run["losses"] != reference]
    modes = summarize(rounds)
    doc = {
        "benchmark": "overhead",
        "command": "python benchmarks/overhead.py" + (" --tiny" if args.tiny else ""),
        "config": {"model": "gpt", "d_model": size["width"], "num_layers": size["layers"],
                   "stages": 2, "threads_per_rank": 1, "schedule": "1f1b",
                   "microbatches": size["microbatches"], "batch_size": size["batch_size"],
                   "steps": size["steps"], "warmup_steps": size["warmup"],
                   "rounds": size["rounds"], "ckpt_every": 1,
                   "persist_every": size["persist_every"]},
        "torch": torch.__version__, "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "wall_s": time.perf_counter() - started,
        "modes": modes,
        "copy_bandwidth": bandwidth,
        "copy_bandwidth_runs": [bandwidth_before, bandwidth_after],
        "goals": goals(modes, bandwidth),
        "losses_identical_across_modes": not changed,
        "rounds": [{"order": r["order"],
                    "runs": {m: {k: v for k, v in run.items() if k != "losses"}
                             for m, run in r["runs"].items()}} for r in rounds],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps(doc, indent=2))
    print()
    print(table(modes, bandwidth))
    g = doc["goals"]
    print(f"goals: bubble overhead {g['bubble_overhead_median']:.2%} (<= 1%: "
          f"{g['bubble_overhead_le_1pct']}); dcp-async/bubble overhead "
          f"{g['dcp_async_over_bubble_overhead']:.1f}x, blocking "
          f"{g['dcp_async_over_bubble_blocking']:.1f}x (>= 5x: {g['bubble_5x_below_dcp_async']}); "
          f"snapshot/plain copy {g['snapshot_vs_plain_copy']:.0%} (>= 80%: "
          f"{g['bandwidth_ge_80pct']})")
    if changed:
        print(f"WARNING: losses differ from the 'none' run in modes {sorted(set(changed))}")
    print(f"written to {out / 'overhead.json'} ({doc['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
