"""What a run is judged by, computed from its records (pure functions).

Definitions (times in seconds):

- **outage**: from a server kill to the first ``recovered`` event of the same shard after it
  (the shard serves again: restarted, replaced, or failed over to the chain's successor).
- **recovery_s**: length of an outage; for a worker kill, until the worker is restarted.
- **worker_busy_during_outage**: the time workers spent computing gradients inside outages,
  divided by ``num_workers`` times the total outage length.
- **lost_updates**: ids acknowledged to a worker by a shard and absent from that shard's final
  state (counted once per id, over all shards).
- **time_to_target_s**: time of the first evaluation at or above the target accuracy.
- **staleness** of an applied gradient: ``step_version - read_version`` from the final state's
  log (updates applied between the read of the weights and the step that applied it).
- **update rate**: updates per second over a window of evaluations; over the window before the
  first kill of an experiment it is each strategy's fault-free throughput.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from bubbleguard.ps.core.records import AckRecord, Event, IterationRecord, Sample
from bubbleguard.ps.core.state import ShardState


@dataclass(frozen=True)
class Outage:
    """A server kill and the recovery that ended it (``end`` is ``None`` if none came)."""

    shard: int
    actor: str
    start: float
    end: float | None

    def length(self, horizon: float) -> float:
        """Seconds down, counting an unrecovered outage until ``horizon``."""
        return (self.end if self.end is not None else horizon) - self.start


def outages(events: Sequence[Event]) -> list[Outage]:
    """Server kills paired with the first recovery of their shard after them."""
    ordered = sorted(events, key=lambda e: e.time)
    out = []
    for i, event in enumerate(ordered):
        if event.kind != "kill" or event.shard < 0:
            continue
        end = next(
            (e.time for e in ordered[i + 1 :] if e.kind == "recovered" and e.shard == event.shard), None
        )
        out.append(Outage(event.shard, event.actor, event.time, end))
    return out


def recovery_times(events: Sequence[Event]) -> list[float]:
    """Seconds from every kill to its recovery (server: ``recovered``; worker: restarted).

    Kills that never recovered are left out.
    """
    ordered = sorted(events, key=lambda e: e.time)
    times = []
    for i, event in enumerate(ordered):
        if event.kind != "kill":
            continue
        for later in ordered[i + 1 :]:
            server_back = event.shard >= 0 and later.kind == "recovered" and later.shard == event.shard
            worker_back = event.shard < 0 and later.kind == "worker_restarted" and later.actor == event.actor
            if server_back or worker_back:
                times.append(later.time - event.time)
                break
    return times


def busy_fraction(
    iterations: Sequence[IterationRecord], windows: Sequence[tuple[float, float]], num_workers: int
) -> float | None:
    """Fraction of worker time inside ``windows`` spent computing gradients (``None`` if the
    windows are empty)."""
    total = sum(max(end - start, 0.0) for start, end in windows) * num_workers
    if total <= 0:
        return None
    busy = 0.0
    for r in iterations:
        for start, end in windows:
            busy += max(0.0, min(r.t_compute_end, end) - max(r.t_compute_start, start))
    return busy / total


def lost_update_ids(acks: Sequence[AckRecord], final_states: Sequence[ShardState]) -> set[int]:
    """Ids acknowledged by a shard and missing from its final state."""
    held = [set(s.applied_uids()) for s in final_states]
    lost: set[int] = set()
    for ack in acks:
        lost.update(uid for uid in ack.uids if uid not in held[ack.shard])
    return lost


def staleness_values(final_states: Sequence[ShardState]) -> list[int]:
    """Staleness of every gradient in the final states."""
    values: list[int] = []
    for state in final_states:
        values.extend(int(v) for v in (state.log[:, 2] - state.log[:, 1]).tolist())
    return values


def time_to_target(samples: Sequence[Sample], target: float) -> float | None:
    """Time of the first sample with accuracy >= ``target``."""
    return next((s.time for s in samples if not math.isnan(s.accuracy) and s.accuracy >= target), None)


def accuracy_at_updates(samples: Sequence[Sample], updates: int) -> float | None:
    """Accuracy of the last evaluated sample with at most ``updates`` updates.

    Scanning from the end keeps to the final lineage of a run whose state rolled back.
    """
    for s in reversed(samples):
        if s.updates <= updates and not math.isnan(s.accuracy):
            return s.accuracy
    return None


def update_rate(samples: Sequence[Sample], start_s: float, end_s: float) -> float | None:
    """Updates per second between the first sample at or after ``start_s`` and the last one at
    or before ``end_s`` (``None`` if fewer than two samples fall in the window)."""
    inside = [s for s in samples if start_s <= s.time <= end_s]
    if len(inside) < 2 or inside[-1].time <= inside[0].time:
        return None
    return (inside[-1].updates - inside[0].updates) / (inside[-1].time - inside[0].time)


def final_accuracy(samples: Sequence[Sample]) -> tuple[float, float]:
    """Accuracy and loss of the last evaluated sample (``nan`` if none)."""
    for s in reversed(samples):
        if not math.isnan(s.accuracy):
            return s.accuracy, s.loss
    return math.nan, math.nan


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation over ``n`` values (``None`` when ``n == 0``)."""

    mean: float | None
    sd: float | None
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Stat:
        """Statistics of the values that are not ``None`` or nan."""
        kept = [float(v) for v in values if v is not None and not math.isnan(v)]
        if not kept:
            return cls(None, None, 0)
        sd = statistics.stdev(kept) if len(kept) > 1 else 0.0
        return cls(statistics.fmean(kept), sd, len(kept))

    def as_dict(self) -> dict[str, float | int | None]:
        """``{"mean", "sd", "n"}``."""
        return {"mean": self.mean, "sd": self.sd, "n": self.n}


@dataclass(frozen=True)
class RunMetrics:
    """The figures of one run (see the module docstring for definitions)."""

    final_accuracy: float
    final_loss: float
    time_to_target_s: float | None
    lost_updates: int
    worker_busy_during_outage: float | None
    recovery_s: float | None
    gradients_computed: int
    updates_applied: int
    steps: int
    updates_per_s: float
    gradients_per_s: float
    staleness_mean: float | None
    staleness_max: int | None
    dropped_gradients: int
    pending_gradients: int
    num_kills: int
    outage_s: float


def run_metrics(
    *,
    samples: Sequence[Sample],
    events: Sequence[Event],
    iterations: Sequence[IterationRecord],
    acks: Sequence[AckRecord],
    final_states: Sequence[ShardState],
    num_workers: int,
    duration_s: float,
    end_time: float,
    target_accuracy: float,
    dropped_gradients: int = 0,
    pending_gradients: int = 0,
) -> RunMetrics:
    """All of a run's figures from its records (times absolute except ``samples``)."""
    accuracy, loss = final_accuracy(samples)
    found = outages(events)
    windows = [(o.start, o.end if o.end is not None else end_time) for o in found]
    recoveries = recovery_times(events)
    staleness = staleness_values(final_states)
    applied = min((s.num_applied for s in final_states), default=0)
    return RunMetrics(
        final_accuracy=accuracy,
        final_loss=loss,
        time_to_target_s=time_to_target(samples, target_accuracy),
        lost_updates=len(lost_update_ids(acks, final_states)),
        worker_busy_during_outage=busy_fraction(iterations, windows, num_workers),
        recovery_s=statistics.fmean(recoveries) if recoveries else None,
        gradients_computed=len(iterations),
        updates_applied=applied,
        steps=min((s.version for s in final_states), default=0),
        updates_per_s=applied / duration_s,
        gradients_per_s=len(iterations) / duration_s,
        staleness_mean=statistics.fmean(staleness) if staleness else None,
        staleness_max=max(staleness) if staleness else None,
        dropped_gradients=dropped_gradients,
        pending_gradients=pending_gradients,
        num_kills=sum(1 for e in events if e.kind == "kill"),
        outage_s=sum(end - start for start, end in windows),
    )
