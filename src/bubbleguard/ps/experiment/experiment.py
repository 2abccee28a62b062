"""The experiment: every strategy (plus a no-failure baseline) over several seeds, side by side.

For each strategy and seed it runs :func:`run_training` with the same configuration, then
writes to the output directory:

- ``runs.csv``: every evaluation ``(strategy, seed, time_s, updates, steps, accuracy, loss,
  server_state)``; ``events.csv``: every kill and recovery;
- ``summary.json``: one record per strategy with exactly ``strategy``, ``final_accuracy``,
  ``time_to_target_s``, ``lost_updates``, ``worker_busy_during_outage``, ``recovery_s`` and
  ``gradients_computed``, each figure as ``{"mean", "sd", "n"}`` over seeds (``n``: seeds with a
  value, e.g. those that reached the target);
- ``comparison.json``: what ``summary.json`` leaves out: throughput (updates applied and
  gradients computed per second over the run, and updates per second before the first kill),
  accuracy at equal updates (the fewest updates any run made, so strategies with more
  throughput do not win by it), staleness, and every run's metrics;
- ``accuracy_vs_time.png`` and ``accuracy_vs_updates.png`` with kills and recoveries marked;
- ``config.json``: the configuration.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bubbleguard.checkpoint.atomic import atomic_write_bytes
from bubbleguard.ps.config import ExperimentConfig, RunConfig
from bubbleguard.ps.core.metrics import Stat, accuracy_at_updates, update_rate
from bubbleguard.ps.core.records import Sample
from bubbleguard.ps.experiment.runner import (
    EVENT_COLUMNS,
    SAMPLE_COLUMNS,
    RunResult,
    config_dict,
    run_training,
    write_csv,
)
from bubbleguard.ps.training.data import load_dataset

SUMMARY_FIELDS = (
    "strategy",
    "final_accuracy",
    "time_to_target_s",
    "lost_updates",
    "worker_busy_during_outage",
    "recovery_s",
    "gradients_computed",
)
"""The keys of every ``summary.json`` record, in order."""


@dataclass(frozen=True)
class ExperimentResult:
    """The runs and the two JSON documents written."""

    runs: list[RunResult]
    summary: list[dict[str, object]]
    comparison: dict[str, object]


def summarize(runs: list[RunResult]) -> list[dict[str, object]]:
    """One ``summary.json`` record per strategy (keys ``SUMMARY_FIELDS``)."""
    records = []
    for strategy in dict.fromkeys(r.strategy for r in runs):
        ms = [r.metrics for r in runs if r.strategy == strategy]
        records.append(
            {
                "strategy": strategy,
                "final_accuracy": Stat.of([m.final_accuracy for m in ms]).as_dict(),
                "time_to_target_s": Stat.of([m.time_to_target_s for m in ms]).as_dict(),
                "lost_updates": Stat.of([m.lost_updates for m in ms]).as_dict(),
                "worker_busy_during_outage": Stat.of([m.worker_busy_during_outage for m in ms]).as_dict(),
                "recovery_s": Stat.of([m.recovery_s for m in ms]).as_dict(),
                "gradients_computed": Stat.of([m.gradients_computed for m in ms]).as_dict(),
            }
        )
    return records


def compare(runs: list[RunResult]) -> dict[str, object]:
    """Throughput and equal-update accuracy per strategy, plus every run's metrics.

    Fault-free throughput is measured on the same window for every run: from the start to the
    earliest kill of any run (the whole run if nothing was killed).
    """
    equal_updates = min((r.metrics.updates_applied for r in runs), default=0)
    kills = [e.time - r.t0 for r in runs for e in r.events if e.kind == "kill"]
    window_end = min(kills, default=max((r.config.duration_s for r in runs), default=0.0))
    per_strategy = {}
    for strategy in dict.fromkeys(r.strategy for r in runs):
        rs = [r for r in runs if r.strategy == strategy]
        per_strategy[strategy] = {
            "updates_per_s": Stat.of([r.metrics.updates_per_s for r in rs]).as_dict(),
            "updates_per_s_fault_free": Stat.of([update_rate(r.samples, 0.0, window_end) for r in rs]).as_dict(),
            "gradients_per_s": Stat.of([r.metrics.gradients_per_s for r in rs]).as_dict(),
            "updates_applied": Stat.of([r.metrics.updates_applied for r in rs]).as_dict(),
            "accuracy_at_equal_updates": Stat.of([accuracy_at_updates(r.samples, equal_updates) for r in rs]).as_dict(),
            "staleness_mean": Stat.of([r.metrics.staleness_mean for r in rs]).as_dict(),
            "staleness_max": Stat.of([r.metrics.staleness_max for r in rs]).as_dict(),
            "dropped_gradients": Stat.of([r.metrics.dropped_gradients for r in rs]).as_dict(),
            "outage_s": Stat.of([r.metrics.outage_s if r.metrics.num_kills else None for r in rs]).as_dict(),
        }
    return {
        "equal_updates": equal_updates,
        "fault_free_window_s": [0.0, window_end],
        "strategies": per_strategy,
        "runs": [
            {"strategy": r.strategy, "seed": r.seed, "run_id": r.run_id, **asdict(r.metrics)} for r in runs
        ],
    }


def json_safe(value: object) -> object:
    """``value`` with nan and infinities replaced by ``None`` (JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    return value


def write_json(path: Path, value: object) -> None:
    """Write ``value`` as indented JSON atomically, keys in their given order."""
    atomic_write_bytes(path, (json.dumps(json_safe(value), indent=2) + "\n").encode())


def run_experiment(
    config: ExperimentConfig,
    *,
    progress: Callable[[RunConfig, Sample], None] | None = None,
    on_run: Callable[[RunResult], None] | None = None,
) -> ExperimentResult:
    """Run every configuration of ``config`` on the running Ray cluster and write the results.

    Raises:
        ValueError: an invalid configuration or data set (before any run starts).
    """
    configs = config.run_configs()
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Load the data once per seed up front, so a data set that does not load fails before any run.
    splits = {seed: load_dataset(config.base.training.dataset, seed) for seed in config.seeds}
    write_json(
        out / "config.json",
        {
            "base": config_dict(config.base),
            "strategies": list(config.strategies),
            "seeds": list(config.seeds),
            "baseline": config.baseline,
        },
    )
    runs: list[RunResult] = []
    for run_config in configs:
        callback = (lambda sample, c=run_config: progress(c, sample)) if progress is not None else None
        result = run_training(
            run_config, workdir=out / "work", splits=splits[run_config.training.seed], progress=callback
        )
        runs.append(result)
        if on_run is not None:
            on_run(result)
        # Rewrite the tables after every run so a long experiment can be inspected midway.
        write_csv(out / "runs.csv", SAMPLE_COLUMNS, [row for r in runs for row in r.sample_rows()])
        write_csv(out / "events.csv", EVENT_COLUMNS, [row for r in runs for row in r.event_rows()])
    summary = summarize(runs)
    comparison = compare(runs)
    write_json(out / "summary.json", summary)
    write_json(out / "comparison.json", comparison)
    from bubbleguard.ps.experiment.plots import plot_accuracy

    plot_accuracy(runs, out / "accuracy_vs_time.png", x="time")
    plot_accuracy(runs, out / "accuracy_vs_updates.png", x="updates")
    return ExperimentResult(runs, summary, comparison)
