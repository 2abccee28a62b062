"""One run, start to finish: :func:`run_training` and the :class:`RunResult` it returns.

A run is a :class:`PSJob` started, trained for ``config.duration_s`` under ``config.faults``,
read out (the final state of every shard) and closed. Everything a report needs is in the
result: evaluation samples, fault events, every worker iteration and acknowledgement, the final
states, and the :class:`RunMetrics` computed from them.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from bubbleguard.ps.config import RunConfig
from bubbleguard.ps.core.metrics import RunMetrics, run_metrics
from bubbleguard.ps.core.records import AckRecord, Event, IterationRecord, Sample
from bubbleguard.ps.core.state import ShardState
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.training.data import DataSplits

SAMPLE_COLUMNS = ("strategy", "seed", "time_s", "updates", "steps", "accuracy", "loss", "server_state")
EVENT_COLUMNS = ("strategy", "seed", "time_s", "kind", "shard", "actor", "detail")


@dataclass(frozen=True)
class RunResult:
    """Everything one run produced.

    Attributes:
        config: the configuration it ran with.
        run_id: its actors' name prefix.
        t0: ``time.time()`` when training started; event and iteration times are absolute,
            sample times are relative to it.
        samples: evaluations of the served model.
        events: kills and recoveries.
        iterations: every gradient computed.
        acks: every acknowledgement a worker received.
        final_states: every shard's served state at the end.
        metrics: the run's figures.
    """

    config: RunConfig
    run_id: str
    t0: float
    samples: list[Sample]
    events: list[Event]
    iterations: list[IterationRecord]
    acks: list[AckRecord]
    final_states: list[ShardState]
    metrics: RunMetrics

    @property
    def strategy(self) -> str:
        """The run's name in reports: the strategy, or the variant's label."""
        return self.config.name

    @property
    def seed(self) -> int:
        """The seed."""
        return self.config.training.seed

    def sample_rows(self) -> list[dict[str, object]]:
        """One CSV row per sample (columns ``SAMPLE_COLUMNS``)."""
        return [
            {
                "strategy": self.strategy,
                "seed": self.seed,
                "time_s": round(s.time, 3),
                "updates": s.updates,
                "steps": s.steps,
                "accuracy": s.accuracy,
                "loss": s.loss,
                "server_state": s.status,
            }
            for s in self.samples
        ]

    def event_rows(self) -> list[dict[str, object]]:
        """One CSV row per event, times relative to the start (columns ``EVENT_COLUMNS``)."""
        return [
            {
                "strategy": self.strategy,
                "seed": self.seed,
                "time_s": round(e.time - self.t0, 3),
                "kind": e.kind,
                "shard": e.shard,
                "actor": e.actor,
                "detail": e.detail,
            }
            for e in sorted(self.events, key=lambda e: e.time)
        ]


def run_training(
    config: RunConfig,
    *,
    workdir: str | Path | None = None,
    splits: DataSplits | None = None,
    progress: Callable[[Sample], None] | None = None,
    on_event: Callable[[Event], None] | None = None,
) -> RunResult:
    """Train once with ``config`` on the running Ray cluster and measure it.

    Args:
        config: the run (validated before anything starts).
        workdir: where checkpoints go (a temporary directory if ``None``).
        splits: the data, if already loaded.
        progress: called with every evaluation sample.
        on_event: called with every kill and recovery once the run is over.

    Raises:
        ValueError: invalid configuration or data set.
        RuntimeError: Ray is not running, or a strategy lost every server of a shard.
    """
    with PSJob(config, workdir=workdir, splits=splits, progress=progress) as job:
        job.start()
        job.train(config.duration_s, faults=config.faults)
        end_time = job.t0 + config.duration_s if job.t0 is not None else 0.0
        final_states = job.server_states()
        reports = job.reports.values()
        metrics = run_metrics(
            samples=job.samples,
            events=job.events,
            iterations=job.iterations,
            acks=job.acks,
            final_states=final_states,
            num_workers=config.training.num_workers,
            duration_s=config.duration_s,
            end_time=end_time,
            target_accuracy=config.target_accuracy,
            dropped_gradients=sum(len(r.dropped_uids) for r in reports),
            pending_gradients=sum(r.num_pending for r in reports),
        )
        assert job.t0 is not None
        result = RunResult(
            config, job.run_id, job.t0, list(job.samples), list(job.events), list(job.iterations),
            list(job.acks), final_states, metrics,
        )
    if on_event is not None:
        for event in sorted(result.events, key=lambda e: e.time):
            on_event(event)
    return result


def write_csv(path: Path, columns: tuple[str, ...], rows: list[dict[str, object]]) -> None:
    """Write ``rows`` with a header line."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)


def config_dict(config: RunConfig) -> dict[str, object]:
    """The configuration as plain JSON-able data."""
    return json.loads(json.dumps(asdict(config)))
