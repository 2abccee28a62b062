"""``bubbleguard``: the command line.

    bubbleguard demo                      a short pipeline-parallel run with a trace and a bubble map
    bubbleguard train --stages 2 ...      launch a training run on this machine (torchrun machinery)
    bubbleguard inspect DIR               list the checkpoints of DIR on every tier, with validity
    bubbleguard ps run | experiment       parameter server on Ray that trains through failures
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bubbleguard.checkpoint.checkpointer import CHECKPOINT_MODES, job_id_for
from bubbleguard.checkpoint.inspect import describe_checkpoints
from bubbleguard.checkpoint.tiers.shm import shm_job_dir
from bubbleguard.elastic.launcher import LaunchError
from bubbleguard.models import MODEL_NAMES
from bubbleguard.pipeline.schedules import SCHEDULE_NAMES, build_schedule
from bubbleguard.ps.cli import add_ps_parser, run_ps_command
from bubbleguard.report.bubbles import compare_bubbles
from bubbleguard.report.checkpoint import checkpoint_summary
from bubbleguard.report.trace import write_chrome_trace
from bubbleguard.train import TrainConfig, run_local

__all__ = ["build_parser", "main"]

# --layers/--width/--seq-len mean the same thing for both built-in models, under their own names.
_MODEL_OPTION_NAMES = {
    "gpt": {"layers": "num_layers", "width": "d_model", "seq_len": "seq_len"},
    "mlp": {"layers": "num_layers", "width": "hidden", "seq_len": "context"},
}


def _add_train_arguments(p: argparse.ArgumentParser, defaults: TrainConfig) -> None:
    p.add_argument("--model", choices=MODEL_NAMES, default=defaults.model)
    p.add_argument("--stages", type=int, default=defaults.stages, help="pipeline stages P")
    p.add_argument("--replicas", type=int, default=defaults.replicas,
                   help="data-parallel replicas D of the pipeline")
    p.add_argument("--microbatches", type=int, default=defaults.microbatches,
                   help="microbatches per iteration M")
    p.add_argument("--batch-size", type=int, default=defaults.batch_size,
                   help="rows per iteration over all replicas (a multiple of D*M)")
    p.add_argument("--schedule", choices=SCHEDULE_NAMES, default=defaults.schedule)
    p.add_argument("--steps", type=int, default=defaults.steps)
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument("--lr", type=float, default=defaults.lr)
    p.add_argument("--layers", type=int, help="model layers (transformer blocks / MLP blocks)")
    p.add_argument("--width", type=int, help="model width (d_model / hidden)")
    p.add_argument("--seq-len", type=int, help="tokens per row (seq_len / context)")
    p.add_argument("--trace", help="write a Chrome trace JSON here (open it in Perfetto)")
    p.add_argument("--metrics", help="append one JSON line per step here")
    p.add_argument("--run-dir", help="keep the ranks' timelines and bubble map here")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--no-bind-cores", action="store_true",
                   help="do not pin each rank to cores of its own (pinned by default when the "
                        "machine has a core per rank thread)")
    p.add_argument("--no-keep-heap", action="store_true",
                   help="let each rank's malloc return freed memory to the kernel (by default it "
                        "keeps it for the next step: fewer page faults per step)")
    ck = p.add_argument_group("checkpoints")
    ck.add_argument("--ckpt", choices=CHECKPOINT_MODES, default=defaults.ckpt,
                    help="checkpoint mode: ours (bubble) or a baseline")
    ck.add_argument("--ckpt-dir", default=defaults.ckpt_dir,
                    help="durable checkpoint root (local path or fsspec URL)")
    ck.add_argument("--ckpt-every", type=int, default=defaults.ckpt_every,
                    help="snapshot every N steps")
    ck.add_argument("--persist-every", type=int, default=defaults.persist_every,
                    help="durable (DCP) checkpoint every K steps; 0: only at the end")
    ck.add_argument("--keep-last", type=int, default=defaults.keep_last,
                    help="durable checkpoints to keep")
    ck.add_argument("--persist-when-busy", choices=("skip", "wait"),
                    default=defaults.persist_when_busy,
                    help="a persist due while the previous one is still being written: skip it "
                         "(training never waits) or wait for it (every due persist is written; "
                         "a snapshot may wait)")
    ck.add_argument("--no-reuse-layout", action="store_true",
                    help="write every persist with dcp.save, instead of replaying the first "
                         "one's files for the later ones (the same files, less CPU)")
    ck.add_argument("--ckpt-chunk-mb", type=float, default=defaults.ckpt_chunk_mb,
                    help="snapshot chunk size in MiB (the most a copy can overrun a bubble)")
    ck.add_argument("--resume", action="store_true",
                    help="start from the newest complete checkpoint (memory tier, then durable)")
    ck.add_argument("--max-restarts", type=int, default=defaults.max_restarts,
                    help="torchrun restarts after a failure; restarted ranks resume")
    ck.add_argument("--fault", help="fault injection: kill RANK at STEP (RANK:STEP[:before|after])")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``bubbleguard`` command."""
    parser = argparse.ArgumentParser(prog="bubbleguard", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="launch pipeline-parallel training on this machine")
    _add_train_arguments(train, TrainConfig())
    demo = sub.add_parser("demo", help="a short default run with a trace and a bubble map")
    demo.add_argument("--out", default="bubbleguard-demo",
                      help="directory for the trace, metrics and bubble map")
    demo.add_argument("--steps", type=int, default=DEMO.steps)
    add_ps_parser(sub)
    inspect = sub.add_parser("inspect", help="list checkpoints on every tier with validity")
    inspect.add_argument("dir", help="the --ckpt-dir of a run (or a memory-tier job directory)")
    inspect.add_argument("--json", action="store_true", help="print JSON records")
    return parser


def run_inspect(ckpt_dir: str, as_json: bool) -> int:
    """Print the durable checkpoints of ``ckpt_dir`` and the memory-tier snapshots of its job."""
    job_dir = shm_job_dir(job_id_for(ckpt_dir))
    has_memory = job_dir.is_dir() and any(job_dir.glob("rank*"))
    records = []
    # The durable root appears with the first persist; until then only the memory tier may
    # hold snapshots, and that is worth showing rather than an error.
    if not has_memory or Path(ckpt_dir).exists() or "://" in ckpt_dir:
        records += describe_checkpoints(ckpt_dir)
    if has_memory:
        records += describe_checkpoints(job_dir)
    if as_json:
        print(json.dumps([dataclasses.asdict(r) for r in records], indent=2))
        return 0
    if not records:
        print(f"no checkpoints in {ckpt_dir} (memory tier: {job_dir})")
        return 0
    print(f"{'tier':<8} {'step':>8} {'size':>10} {'ranks':>5}  status")
    for r in sorted(records, key=lambda r: (r.tier, r.step)):
        status = ("valid, committed" if r.valid and r.committed else "valid" if r.valid
                  else f"INVALID: {r.reason}")
        ranks = "?" if r.num_ranks is None else str(r.num_ranks)
        print(f"{r.tier:<8} {r.step:>8} {r.size_bytes / 2**20:>8.1f}MB {ranks:>5}  {status}")
    return 0


DEMO = TrainConfig(model="gpt", stages=2, microbatches=4, batch_size=32, schedule="1f1b", steps=30,
                   model_options={"d_model": 128, "num_layers": 4}, ckpt="bubble",
                   ckpt_dir="bubbleguard-demo/ckpt", persist_every=10)


def _config_from_args(args: argparse.Namespace) -> TrainConfig:
    names = _MODEL_OPTION_NAMES[args.model]
    options = {names[k]: getattr(args, k) for k in names if getattr(args, k) is not None}
    return TrainConfig(model=args.model, stages=args.stages, replicas=args.replicas,
                       microbatches=args.microbatches, batch_size=args.batch_size,
                       schedule=args.schedule, steps=args.steps, seed=args.seed, lr=args.lr,
                       model_options=options, trace=args.trace, metrics=args.metrics,
                       progress=not args.no_progress, bind_cores=not args.no_bind_cores,
                       keep_heap=not args.no_keep_heap,
                       ckpt=args.ckpt, ckpt_dir=args.ckpt_dir,
                       ckpt_every=args.ckpt_every, persist_every=args.persist_every,
                       keep_last=args.keep_last, persist_when_busy=args.persist_when_busy,
                       reuse_layout=not args.no_reuse_layout, ckpt_chunk_mb=args.ckpt_chunk_mb,
                       resume=args.resume, fault=args.fault,
                       max_restarts=args.max_restarts)


def run_training(cfg: TrainConfig, run_dir: str | None) -> int:
    """Launch ``cfg`` on local ranks, then write the trace and print the bubble map."""
    keep = run_dir is not None
    run_path = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="bubbleguard-run-"))
    run_path.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_path))
    for out in (cfg.trace, cfg.metrics):
        if out:
            Path(out).parent.mkdir(parents=True, exist_ok=True)
    print(f"bubbleguard: {cfg.model}, {cfg.stages} stages x {cfg.replicas} "
          f"replica{'s' if cfg.replicas != 1 else ''}, "
          f"{cfg.schedule}, {cfg.microbatches} microbatches, {cfg.steps} steps", flush=True)
    try:
        run = run_local(cfg)
        events = run.events
        print(f"final loss {run.final_loss:.4f}")
        if cfg.trace:
            write_chrome_trace(cfg.trace, events)
            print(f"trace: {cfg.trace} (open in https://ui.perfetto.dev)")
        if cfg.steps >= 3:
            summary, record = compare_bubbles(
                events, build_schedule(cfg.schedule, cfg.stages, cfg.microbatches))
            print(summary)
            (run_path / "bubbles.json").write_text(json.dumps(record, indent=2))
            ckpt_summary = checkpoint_summary(events)
            if ckpt_summary:
                print(ckpt_summary)
            for plan_file in sorted(run_path.glob("plan-rank*.json")):
                p = json.loads(plan_file.read_text())
                print(f"  plan, stage {p['stage']} (step {p['step']}): {p['chunks_in_bubbles']} of "
                      f"{p['num_chunks']} chunks fit in the bubbles, predicted blocking "
                      f"{p['predicted_blocking_s'] * 1e3:.2f} ms; {_persist_fit(p)}")
    finally:
        if not keep:
            shutil.rmtree(run_path, ignore_errors=True)
    return 0


def _persist_fit(plan: dict[str, Any]) -> str:
    """How often a durable persist fits in the time the copies leave idle, or why not known."""
    free = plan["persist_every_free"]
    if free is not None:
        fit = ("a durable persist fits in the bubbles every "
               + (f"{free} iterations" if free > 1 else "iteration"))
        if plan.get("persist_cpu_s") is None:
            return fit
        return (f"{fit} (it takes {plan['persist_cpu_s'] * 1e3:.0f} ms of CPU time, against "
                f"{plan['leftover_idle_s'] * 1e3:.0f} ms of idle time per iteration left by the "
                f"copies; the last one was committed {plan['persist_elapsed_s']:.2f} s after it "
                "started)")
    if plan["persist_bandwidth_bytes_per_s"] is None:
        return "durable persist fit not known yet (no persist had finished)"
    return "no idle time left for a durable persist"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``bubbleguard`` command; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        if args.command == "train":
            return run_training(_config_from_args(args), args.run_dir)
        if args.command == "ps":
            return run_ps_command(args)
        if args.command == "inspect":
            return run_inspect(args.dir, args.json)
        if args.command == "demo":
            out = Path(args.out)
            cfg = dataclasses.replace(DEMO, steps=args.steps, trace=str(out / "trace.json"),
                                      metrics=str(out / "metrics.jsonl"),
                                      ckpt_dir=str(out / "ckpt"))
            (out / "metrics.jsonl").unlink(missing_ok=True)
            shutil.rmtree(out / "ckpt", ignore_errors=True)  # the demo starts fresh every time
            return run_training(cfg, str(out))
    except (ValueError, OSError) as exc:  # bad options or an unusable path: nothing started
        print(f"bubbleguard: error: {exc}", file=sys.stderr)
        return 2
    except LaunchError as exc:
        print(f"bubbleguard: {exc}", file=sys.stderr)
        return 1
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
