"""Tests for bubbleguard.ps.core.metrics: the figures a run is judged by."""

from __future__ import annotations

import math

import pytest
import torch

from bubbleguard.ps.core.metrics import (
    Stat,
    accuracy_at_updates,
    busy_fraction,
    lost_update_ids,
    outages,
    recovery_times,
    staleness_values,
    time_to_target,
    update_rate,
)
from bubbleguard.ps.core.records import AckRecord, Event, IterationRecord, Sample
from bubbleguard.ps.core.state import ShardState


def ev(t: float, kind: str, shard: int = 0, actor: str = "s") -> Event:
    return Event(t, kind, shard, actor)  # type: ignore[arg-type]


def test_outages_pair_each_kill_with_the_next_recovery_of_its_shard() -> None:
    events = [ev(1, "kill"), ev(2, "kill", shard=1), ev(3, "recovered", shard=1), ev(4, "recovered"), ev(6, "kill")]
    found = outages(events)
    assert [(o.shard, o.start, o.end) for o in found] == [(0, 1, 4), (1, 2, 3), (0, 6, None)]
    assert found[2].length(10.0) == 4.0


def test_recovery_times_cover_servers_and_workers() -> None:
    events = [
        ev(1, "kill"),
        ev(3.5, "recovered"),
        ev(5, "kill", shard=-1, actor="w1"),
        ev(6, "worker_restarted", shard=-1, actor="w0"),
        ev(7, "worker_restarted", shard=-1, actor="w1"),
    ]
    assert recovery_times(events) == [2.5, 2.0]


def it(worker: int, compute: tuple[float, float]) -> IterationRecord:
    return IterationRecord(worker, 0, 0, 0, compute[0], compute[0], compute[0], compute[1], compute[1], 0.0, (0,), ("buffered",))


def test_busy_fraction_counts_compute_overlapping_the_outage() -> None:
    iterations = [it(0, (0.0, 2.0)), it(0, (2.5, 4.0)), it(1, (1.0, 1.5))]
    # Window [1, 3] for two workers = 4 worker-seconds; compute inside: 1 + 0.5 + 0.5.
    assert busy_fraction(iterations, [(1.0, 3.0)], 2) == pytest.approx(2.0 / 4.0)
    assert busy_fraction(iterations, [], 2) is None


def test_lost_updates_are_acknowledged_ids_missing_from_the_final_state() -> None:
    log = torch.tensor([[10, 0, 0], [11, 0, 1]], dtype=torch.int64)
    final = [ShardState(0, torch.zeros(1), torch.zeros(0), 2, log)]
    acks = [
        AckRecord(0, 0, 1.0, (10,), 1, "d"),
        AckRecord(0, 0, 2.0, (11, 12), 3, "d"),
        AckRecord(1, 0, 3.0, (13,), 4, "d"),
    ]
    assert lost_update_ids(acks, final) == {12, 13}
    assert staleness_values(final) == [0, 1]


def sample(t: float, updates: int, acc: float) -> Sample:
    return Sample(t, updates, updates, acc, 0.0, "up")


def test_time_to_target_and_accuracy_at_equal_updates_follow_the_final_lineage() -> None:
    samples = [sample(0, 0, 0.1), sample(1, 100, 0.5), sample(2, 200, math.nan), sample(3, 60, 0.4), sample(4, 150, 0.92)]
    assert time_to_target(samples, 0.9) == 4
    assert time_to_target(samples, 0.95) is None
    # After the rollback to 60 updates, the last evaluation at or below 100 updates is at t=3.
    assert accuracy_at_updates(samples, 100) == 0.4
    assert accuracy_at_updates(samples, 200) == 0.92


def test_stat_ignores_missing_values() -> None:
    assert Stat.of([1.0, None, 3.0, math.nan]) == Stat(2.0, pytest.approx(math.sqrt(2)), 2)
    assert Stat.of([None]) == Stat(None, None, 0)
    assert Stat.of([5.0]).as_dict() == {"mean": 5.0, "sd": 0.0, "n": 1}


def test_update_rate_over_a_window() -> None:
    samples = [sample(0, 0, 0.1), sample(1, 100, 0.2), sample(3, 500, 0.3), sample(4, 500, math.nan)]
    assert update_rate(samples, 0.5, 3.5) == pytest.approx(200.0)
    assert update_rate(samples, 0.0, 0.5) is None
