"""Plans made from a stage's own timeline."""

from __future__ import annotations

import pytest

from bubbleguard.pipeline.bubbles import predict_bubbles
from bubbleguard.pipeline.profiler import plan_from_timeline
from bubbleguard.pipeline.schedules import build_schedule
from bubbleguard.pipeline.timeline import EventKind, TimelineEvent


def _timeline(stage: int, waits_ms: list[float], num_steps: int) -> list[TimelineEvent]:
    """Stage 1 of 2-stage 1F1B, M=2: it waits at RA0 (index 0) and RA1 (index 4) every step."""
    events, t = [], 0.0
    for step in range(1, num_steps + 1):
        for index, wait in zip((0, 4), waits_ms, strict=True):
            events.append(TimelineEvent(stage, stage, 0, step, EventKind.IDLE, "wait", index,
                                        t, t + wait / 1e3))
            t += wait / 1e3 + 0.005
        events.append(TimelineEvent(stage, stage, 0, step, EventKind.STEP, "STEP", 8, t, t))
    return events


def test_chunks_fill_the_measured_windows_and_the_rest_blocks() -> None:
    sched = build_schedule("1f1b", 2, 2)
    events = _timeline(1, [4.0, 1.0], num_steps=6)
    # 1 GB/s: a 4 ms window holds 4 MB minus the 10% margin = 3.6 MB: three 1 MB chunks;
    # the 1 ms window holds 0.9 MB: none; two of the six chunks block.
    plan = plan_from_timeline(events, sched, 1, [1_000_000] * 6, 1e9)
    assert [a.chunk_ids for a in plan.assignments] == [(0, 1, 2), ()]
    assert plan.blocking_chunk_ids == (3, 4, 5)
    assert plan.blocking_s == pytest.approx(3e-3)


def test_replanning_follows_drifting_bubbles() -> None:
    sched = build_schedule("1f1b", 2, 2)
    early = _timeline(1, [1.0, 1.0], num_steps=20)
    late = [TimelineEvent(e.rank, e.stage, e.replica, e.step + 20, e.kind, e.name,
                          e.action_index, e.start_s + 1.0, e.end_s + 1.0)
            for e in _timeline(1, [10.0, 10.0], num_steps=20)]
    plan = plan_from_timeline(early + late, sched, 1, [1_000_000] * 6, 1e9, last_steps=10)
    assert plan.blocking_chunk_ids == ()  # only the recent, wide bubbles count


def test_prediction_and_measurement_agree_on_window_positions() -> None:
    sched = build_schedule("1f1b", 2, 2)
    predicted = predict_bubbles(sched, [1.0, 1.0], [2.0, 2.0])
    assert [w.action_index for w in predicted.stages[1].windows] == [0, 4]
