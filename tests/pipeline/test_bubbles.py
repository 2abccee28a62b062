"""Bubble prediction against the closed form, and measurement from hand-made timelines."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bubbleguard.pipeline.bubbles import (
    closed_form_bubble_fraction,
    measure_bubbles,
    predict_bubbles,
    stage_compute_times,
)
from bubbleguard.pipeline.schedules import SCHEDULE_NAMES, build_schedule
from bubbleguard.pipeline.timeline import EventKind, TimelineEvent


@given(p=st.integers(1, 8), m=st.integers(1, 16), name=st.sampled_from(SCHEDULE_NAMES),
       tf=st.floats(0.1, 5.0), tb_ratio=st.floats(0.5, 3.0))
def test_equal_stages_match_closed_form(p: int, m: int, name: str, tf: float, tb_ratio: float) -> None:
    tb = tf * tb_ratio
    bmap = predict_bubbles(build_schedule(name, p, m), [tf] * p, [tb] * p)
    for st_ in bmap.stages:
        assert st_.iteration_s == pytest.approx((m + p - 1) * (tf + tb))
        assert st_.idle_s == pytest.approx((p - 1) * (tf + tb))
        assert st_.fraction == pytest.approx(closed_form_bubble_fraction(p, m))


def test_two_stage_1f1b_windows_are_where_the_schedule_says() -> None:
    # P=2, M=4, t_f=1, t_b=2. Stage 0 waits for the first gradient after its warm-up forwards
    # (t_f + t_b) and for the last one after B2 (t_f); stage 1 waits at the top of the iteration:
    # the "end bubble" of the previous iteration merges with the start one (3 in all).
    bmap = predict_bubbles(build_schedule("1f1b", 2, 4), [1.0, 1.0], [2.0, 2.0])
    s0, s1 = bmap.stages
    assert [(w.waiting_for, w.after, w.offset_s, w.duration_s) for w in s0.windows if w.duration_s] \
        == [("RG0<-1", "F1", 2.0, 2.0), ("RG3<-1", "B2", 12.0, 1.0)]
    assert [(w.waiting_for, w.after, w.duration_s) for w in s1.windows if w.duration_s] \
        == [("RA0<-0", "start", 3.0)]
    assert s0.iteration_s == s1.iteration_s == 15.0
    assert "stage 1" in str(bmap)


def test_slow_stage_makes_others_wait() -> None:
    bmap = predict_bubbles(build_schedule("gpipe", 2, 4), [1.0, 3.0], [1.0, 3.0])
    s0, s1 = bmap.stages
    assert s1.idle_s < s0.idle_s
    assert s0.iteration_s == pytest.approx(s1.iteration_s)


def test_time_lists_must_match_stages() -> None:
    with pytest.raises(ValueError, match="forward_s has 1 entries for 2 stages"):
        predict_bubbles(build_schedule("gpipe", 2, 2), [1.0], [1.0, 1.0])


def _events_from_prediction(name: str, p: int, m: int, tf: float, tb: float,
                            num_steps: int) -> list[TimelineEvent]:
    """A synthetic timeline with the waits and computes that a run with these times would record."""
    sched = build_schedule(name, p, m)
    events = []
    bmap = predict_bubbles(sched, [tf] * p, [tb] * p)
    for s, st_ in enumerate(bmap.stages):
        t = 0.0
        wait = {w.action_index: w.duration_s for w in st_.windows}
        for step in range(1, num_steps + 1):
            for i, a in enumerate(sched.stages[s]):
                if i in wait:
                    events.append(TimelineEvent(s, s, 0, step, EventKind.IDLE, f"wait {a}", i,
                                                t, t + wait[i]))
                    t += wait[i]
                dur = {"F": tf, "B": tb}.get(str(a)[0], 0.0) if str(a) != "STEP" else 0.0
                kind = EventKind.STEP if str(a) == "STEP" else EventKind.COMPUTE
                if dur or kind == EventKind.STEP:
                    events.append(TimelineEvent(s, s, 0, step, kind, str(a), i, t, t + dur))
                    t += dur
    return events


def test_measure_recovers_the_windows_of_a_timeline() -> None:
    events = _events_from_prediction("1f1b", 3, 4, 1.0, 2.0, num_steps=4)
    sched = build_schedule("1f1b", 3, 4)
    measured = measure_bubbles(events, sched)
    predicted = predict_bubbles(sched, [1.0] * 3, [2.0] * 3)
    for ms, ps in zip(measured.stages, predicted.stages, strict=True):
        assert ms.iteration_s == pytest.approx(ps.iteration_s)
        assert ms.idle_s == pytest.approx(ps.idle_s)
    tf, tb, _ = stage_compute_times(events, 3)
    assert tf == [1.0] * 3 and tb == [2.0] * 3


def test_one_stalled_step_does_not_make_a_bubble() -> None:
    # Stage 0 of 1f1b P=2 M=4 (t_f=1, t_b=2) waits 2.0 for RG0 and 0 for RG1 in every step; one step
    # (another process took the core) waits 30 for RG1. Averaged, RG1 would look like the largest
    # window (30/5 = 6); the typical iteration still has it at 0.
    sched = build_schedule("1f1b", 2, 4)
    events = _events_from_prediction("1f1b", 2, 4, 1.0, 2.0, num_steps=6)
    stalled = next(i for i, e in enumerate(events) if e.stage == 0 and e.step == 4
                   and e.kind == EventKind.IDLE and e.name == "wait RG1<-1")
    events[stalled] = replace(events[stalled], end_s=events[stalled].start_s + 30.0)
    s0 = measure_bubbles(events, sched).stages[0]
    by_name = {w.waiting_for: w.duration_s for w in s0.windows}
    assert by_name["RG0<-1"] == pytest.approx(2.0)
    assert by_name["RG1<-1"] == 0.0
    assert max(s0.windows, key=lambda w: w.duration_s).waiting_for == "RG0<-1"
    assert s0.iteration_s == pytest.approx(15.0)


def test_measure_needs_steps_after_warmup() -> None:
    events = _events_from_prediction("gpipe", 2, 2, 1.0, 1.0, num_steps=1)
    with pytest.raises(ValueError, match="need recorded steps after step 1"):
        measure_bubbles(events, build_schedule("gpipe", 2, 2))
