"""Tests for bubbleguard.ps.runtime.faults.FaultSchedule: when kills fire (no Ray needed)."""

from __future__ import annotations

from bubbleguard.ps.config import FaultPlan
from bubbleguard.ps.core.records import Event
from bubbleguard.ps.runtime.faults import FaultSchedule


class Recorder:
    """Collects the kills a schedule asks for."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int, float]] = []

    def __call__(self, target: str, shard: int, worker: int, downtime_s: float) -> Event:
        self.calls.append((target, shard, worker, downtime_s))
        return Event(0.0, "kill", shard, target)


def test_time_triggered_kills_fire_once_each_in_order() -> None:
    kills = Recorder()
    schedule = FaultSchedule(FaultPlan(num_kills=2, downtime_s=1.0), 30.0, start=100.0, kill=kills)
    assert schedule.poll(109.9, 0) == [] and kills.calls == []
    assert len(schedule.poll(110.0, 0)) == 1 and schedule.pending == 1
    assert schedule.poll(115.0, 0) == []
    assert len(schedule.poll(121.0, 0)) == 1 and schedule.poll(500.0, 0) == []
    assert kills.calls == [("server", 0, 0, 1.0)] * 2


def test_update_triggered_kills_follow_progress() -> None:
    kills = Recorder()
    plan = FaultPlan(num_kills=2, downtime_s=0.5, kill_after_updates=100, target="worker", worker=3)
    schedule = FaultSchedule(plan, 60.0, start=0.0, kill=kills)
    assert schedule.poll(50.0, 99) == []
    assert len(schedule.poll(50.0, 100)) == 1
    assert schedule.poll(51.0, 150) == []  # the second kill waits for 200 updates
    assert len(schedule.poll(52.0, 200)) == 1
    assert kills.calls == [("worker", 0, 3, 0.5)] * 2
