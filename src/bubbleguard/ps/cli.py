"""``bubbleguard ps run`` and ``bubbleguard ps experiment``.

``add_ps_parser(subparsers)`` adds the ``ps`` command; ``run_ps_command(args)`` runs it and
returns the exit status. Every configuration and data-set error is reported (exit status 2)
before Ray starts. This module imports neither torch nor Ray until a command runs, so building
the parser stays cheap.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from bubbleguard.ps.config import (
    BACKLOG_POLICIES,
    CONSISTENCY_LEVELS,
    KILL_TARGETS,
    OVERFLOW_POLICIES,
    RECOVERY_STRATEGIES,
    STRATEGIES,
    ChainConfig,
    CheckpointConfig,
    ConsistencyConfig,
    ExperimentConfig,
    FaultPlan,
    ResourceConfig,
    RunConfig,
    StatelessConfig,
    TrainingConfig,
)

if TYPE_CHECKING:
    from bubbleguard.ps.core.records import Sample
    from bubbleguard.ps.experiment.runner import RunResult
    from bubbleguard.ps.runtime.cluster import ClusterConfig
    from bubbleguard.ps.training.data import DataSplits

RUN_OVERHEAD_S = 12.0
"""Rough per-run cost of starting and stopping actors, for the experiment's time estimate."""


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _seeds(text: str) -> tuple[int, ...]:
    """``3`` means seeds 0, 1, 2; ``4,7,9`` means those seeds."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or comma-separated seeds, got {text!r}") from None
    if len(values) == 1 and "," not in text:
        if values[0] < 1:
            raise argparse.ArgumentTypeError(f"need at least one seed, got {values[0]}")
        return tuple(range(values[0]))
    return tuple(values)


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--consistency", choices=CONSISTENCY_LEVELS, default="eventual")
    g.add_argument("--staleness", type=int, default=0, help="clock bound of --consistency bounded")
    g.add_argument("--workers", type=int, default=4)
    g.add_argument("--shards", type=int, default=1, help="servers (or chains) the parameters are split over")
    g.add_argument("--duration", type=float, default=30.0, help="seconds of training per run")
    g.add_argument("--dataset", default="digits", help="digits, npz:PATH, or a registered name")
    g.add_argument("--model", default="cnn")
    g.add_argument("--lr", type=float, default=TrainingConfig.lr)
    g.add_argument("--momentum", type=float, default=0.0)
    g.add_argument("--batch-size", type=int, default=32)
    g.add_argument("--worker-delay", type=_floats, default=(), help="extra seconds per gradient, per worker")
    g.add_argument("--target-accuracy", type=float, default=0.9)
    g.add_argument("--eval-every", type=float, default=0.5, help="seconds between evaluations")
    g = p.add_argument_group("faults")
    g.add_argument("--kills", type=int, default=0)
    g.add_argument("--downtime", type=float, default=5.0, help="seconds a killed actor stays down")
    g.add_argument("--kill-at", type=_floats, default=None, help="kill times in seconds (default: evenly spaced)")
    g.add_argument("--kill-after-updates", type=int, default=None, help="kill after every N updates instead")
    g.add_argument("--kill-target", choices=KILL_TARGETS, default="server")
    g.add_argument("--kill-shard", type=int, default=0)
    g.add_argument("--kill-worker", type=int, default=0)
    g = p.add_argument_group("strategies")
    g.add_argument("--checkpoint-every", type=int, default=CheckpointConfig.every, help="steps between checkpoints")
    g.add_argument("--checkpoint-dir", default=None)
    g.add_argument("--chain-length", type=int, default=ChainConfig.length)
    g.add_argument(
        "--replicate-every", type=int, default=None, help="chain: copy the head's state every N steps (default: per update)"
    )
    g.add_argument("--policy", choices=BACKLOG_POLICIES, default=StatelessConfig.policy, help="stateless backlog policy")
    g.add_argument("--backlog-lr-scale", type=float, default=StatelessConfig.backlog_lr_scale)
    g.add_argument("--buffer-cap", type=int, default=StatelessConfig.buffer_cap, help="stateless: entries per worker")
    g.add_argument("--overflow", choices=OVERFLOW_POLICIES, default=StatelessConfig.overflow)
    g = p.add_argument_group("cluster")
    g.add_argument("--address", default=None, help="join this Ray cluster instead of starting one on 127.0.0.1")
    g.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local cluster")
    g.add_argument("--worker-cpus", type=float, default=ResourceConfig.worker_cpus)
    g.add_argument("--server-cpus", type=float, default=ResourceConfig.server_cpus)
    p.add_argument("--out", default=None, help="output directory")
    p.add_argument("--quiet", action="store_true", help="no per-evaluation progress lines")


def add_ps_parser(subparsers: argparse._SubParsersAction) -> None:
    """Add ``ps run`` and ``ps experiment`` to a CLI's subcommands."""
    ps = subparsers.add_parser("ps", help="parameter server on Ray that trains through failures")
    sub = ps.add_subparsers(dest="ps_command", required=True)
    run = sub.add_parser("run", help="train once with one strategy and show progress")
    run.add_argument("--strategy", choices=STRATEGIES, default="checkpoint")
    run.add_argument("--seed", type=int, default=0)
    _add_common(run)
    exp = sub.add_parser("experiment", help="compare strategies over seeds against a no-failure baseline")
    exp.add_argument(
        "--strategies",
        type=_names,
        default=RECOVERY_STRATEGIES,
        help="comma-separated, from " + ",".join(STRATEGIES) + "; variants: checkpoint:N, chain:N, stateless:POLICY",
    )
    exp.add_argument("--seeds", type=_seeds, default=(0,), help="a count (3 = seeds 0,1,2) or a comma list")
    exp.add_argument("--no-baseline", action="store_true", help="skip the no-failure baseline")
    _add_common(exp)


def config_from_args(args: argparse.Namespace, *, strategy: str, seed: int) -> RunConfig:
    """The :class:`RunConfig` the flags describe (not yet validated)."""
    return RunConfig(
        strategy=strategy,  # checked by RunConfig.validate
        training=TrainingConfig(
            dataset=args.dataset,
            model=args.model,
            num_workers=args.workers,
            batch_size=args.batch_size,
            lr=args.lr,
            momentum=args.momentum,
            seed=seed,
            worker_delay_s=tuple(args.worker_delay),
        ),
        consistency=ConsistencyConfig(args.consistency, args.staleness),
        checkpoint=CheckpointConfig(every=args.checkpoint_every, directory=args.checkpoint_dir),
        chain=ChainConfig(length=args.chain_length, replicate_every=args.replicate_every),
        stateless=StatelessConfig(
            policy=args.policy, backlog_lr_scale=args.backlog_lr_scale, buffer_cap=args.buffer_cap, overflow=args.overflow
        ),
        faults=FaultPlan(
            num_kills=args.kills,
            downtime_s=args.downtime,
            kill_at_s=tuple(args.kill_at) if args.kill_at is not None else None,
            kill_after_updates=args.kill_after_updates,
            target=args.kill_target,
            shard=args.kill_shard,
            worker=args.kill_worker,
        ),
        resources=ResourceConfig(worker_cpus=args.worker_cpus, server_cpus=args.server_cpus),
        num_shards=args.shards,
        duration_s=args.duration,
        eval_every_s=args.eval_every,
        target_accuracy=args.target_accuracy,
    )


def _print_sample(prefix: str, sample: Sample) -> None:
    acc = "  -  " if math.isnan(sample.accuracy) else f"{sample.accuracy:.3f}"
    loss = "  -  " if math.isnan(sample.loss) else f"{sample.loss:.3f}"
    print(f"{prefix}t={sample.time:6.1f}s  updates={sample.updates:6d}  acc={acc}  loss={loss}  server={sample.status}", flush=True)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _print_run(result: RunResult) -> None:
    m = result.metrics
    print(
        f"{result.strategy:>10s} seed {result.seed}: acc {_fmt(m.final_accuracy, '.3f')}  "
        f"to-target {_fmt(m.time_to_target_s, '.1f')}s  lost {m.lost_updates}  "
        f"busy-in-outage {_fmt(m.worker_busy_during_outage, '.2f')}  recovery {_fmt(m.recovery_s, '.2f')}s  "
        f"gradients {m.gradients_computed}  updates/s {m.updates_per_s:.0f}",
        flush=True,
    )


def _error(message: str) -> int:
    print(f"bubbleguard ps: error: {message}", file=sys.stderr)
    return 2


def run_ps_command(args: argparse.Namespace) -> int:
    """Run ``ps run`` or ``ps experiment``; the exit status (2: bad input, nothing started)."""
    # Validate everything before importing or starting Ray.
    try:
        if args.ps_command == "run":
            configs = [config_from_args(args, strategy=args.strategy, seed=args.seed)]
        else:
            base = config_from_args(args, strategy="baseline", seed=args.seeds[0])
            experiment = ExperimentConfig(
                base=base,
                strategies=tuple(args.strategies),
                seeds=tuple(args.seeds),
                out_dir=args.out or "ps-experiment",
                baseline=not args.no_baseline,
            )
            configs = experiment.run_configs()
        for config in configs:
            config.validate()
        from bubbleguard.ps.training.data import load_dataset

        splits = load_dataset(args.dataset, configs[0].training.seed)
    except (ValueError, FileNotFoundError) as e:
        return _error(str(e))

    from bubbleguard.ps.runtime.cluster import ClusterConfig, RayCluster

    cluster = ClusterConfig(address=args.address, num_cpus=args.num_cpus)
    if args.ps_command == "run":
        return _run_once(args, configs[0], splits, cluster)
    estimate = len(configs) * (configs[0].duration_s + RUN_OVERHEAD_S)
    print(f"{len(configs)} runs of {configs[0].duration_s:g} s each; about {estimate / 60:.1f} minutes", flush=True)
    from bubbleguard.ps.experiment.experiment import run_experiment

    start = time.time()
    with RayCluster(cluster):
        result = run_experiment(
            experiment,
            progress=None if args.quiet else (lambda c, s: _print_sample(f"[{c.name} seed {c.training.seed}] ", s)),
            on_run=_print_run,
        )
    print(f"\nwall time {time.time() - start:.0f} s; results in {experiment.out_dir}")
    _print_table(result.summary, result.comparison)
    return 0


def _run_once(args: argparse.Namespace, config: RunConfig, splits: DataSplits, cluster: ClusterConfig) -> int:
    from bubbleguard.ps.experiment.experiment import compare, summarize, write_json
    from bubbleguard.ps.experiment.runner import (
        EVENT_COLUMNS,
        SAMPLE_COLUMNS,
        config_dict,
        run_training,
        write_csv,
    )
    from bubbleguard.ps.runtime.cluster import RayCluster

    out = Path(args.out) if args.out else None
    with RayCluster(cluster):
        result = run_training(
            config,
            workdir=out / "work" if out else None,
            splits=splits,
            progress=None if args.quiet else (lambda s: _print_sample("", s)),
        )
    for row in result.event_rows():
        print(f"  event t={row['time_s']:7.2f}s  {row['kind']:<16s} {row['actor']}  {row['detail']}")
    _print_run(result)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        write_csv(out / "runs.csv", SAMPLE_COLUMNS, result.sample_rows())
        write_csv(out / "events.csv", EVENT_COLUMNS, result.event_rows())
        write_json(out / "summary.json", summarize([result]))
        write_json(out / "comparison.json", compare([result]))
        write_json(out / "config.json", config_dict(config))
        print(f"results in {out}")
    return 0


def _print_table(summary: list[dict[str, object]], comparison: dict[str, object]) -> None:
    def cell(record: dict[str, object], key: str, spec: str) -> str:
        stat = record[key]
        assert isinstance(stat, dict)
        mean, sd = stat["mean"], stat["sd"]
        return "-" if mean is None else f"{format(mean, spec)}±{format(sd, spec)}"

    strategies = comparison["strategies"]
    assert isinstance(strategies, dict)
    print(f"{'strategy':>10s} {'final acc':>13s} {'to target s':>12s} {'lost':>9s} {'busy/outage':>11s} "
          f"{'recovery s':>11s} {'gradients':>13s} {'updates/s':>10s} {'acc@' + str(comparison['equal_updates']) + ' upd':>14s}")
    for record in summary:
        name = str(record["strategy"])
        extra = strategies[name]
        print(
            f"{name:>10s} {cell(record, 'final_accuracy', '.3f'):>13s} {cell(record, 'time_to_target_s', '.1f'):>12s} "
            f"{cell(record, 'lost_updates', '.0f'):>9s} {cell(record, 'worker_busy_during_outage', '.2f'):>11s} "
            f"{cell(record, 'recovery_s', '.2f'):>11s} {cell(record, 'gradients_computed', '.0f'):>13s} "
            f"{cell(extra, 'updates_per_s', '.0f'):>10s} {cell(extra, 'accuracy_at_equal_updates', '.3f'):>14s}"
        )
