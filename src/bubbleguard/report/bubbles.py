"""Measured bubble map next to the prediction for the schedule, as a table and a JSON record."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bubbleguard.pipeline.bubbles import (
    BubbleMap,
    closed_form_bubble_fraction,
    measure_bubbles,
    predict_bubbles,
    stage_compute_times,
)
from bubbleguard.pipeline.schedules import PipelineSchedule
from bubbleguard.pipeline.timeline import TimelineEvent

__all__ = ["compare_bubbles"]


def compare_bubbles(events: Sequence[TimelineEvent], schedule: PipelineSchedule,
                    skip_steps: int = 1) -> tuple[str, dict[str, Any]]:
    """Measure the bubble map of a run and predict it from the run's own stage times.

    The prediction times the schedule with each stage's median forward, backward and step times
    (sends free); the closed form assumes equal stages. Returns a printable table and a record
    with all three.
    """
    forward_s, backward_s, step_s = stage_compute_times(events, schedule.num_stages, skip_steps)
    measured = measure_bubbles(events, schedule, skip_steps)
    predicted = predict_bubbles(schedule, forward_s, backward_s, step_s)
    closed = closed_form_bubble_fraction(schedule.num_stages, schedule.num_microbatches)
    rows = [f"bubbles per stage ({schedule.name}, P={schedule.num_stages}, "
            f"M={schedule.num_microbatches}); closed form (P-1)/(M+P-1) = {closed:.1%}",
            f"  {'stage':>5} {'t_f ms':>8} {'t_b ms':>8} {'iter ms':>8} {'measured':>9} "
            f"{'predicted':>9}"]
    for s, (m, p) in enumerate(zip(measured.stages, predicted.stages, strict=True)):
        rows.append(f"  {s:>5} {forward_s[s] * 1e3:8.2f} {backward_s[s] * 1e3:8.2f} "
                    f"{m.iteration_s * 1e3:8.2f} {m.fraction:9.1%} {p.fraction:9.1%}")
    rows.append("  largest measured windows:")
    for st in measured.stages:
        for w in sorted(st.windows, key=lambda w: -w.duration_s)[:3]:
            if w.duration_s > 0:
                rows.append(f"    stage {st.stage}: {w.duration_s * 1e3:7.2f} ms at "
                            f"+{w.offset_s * 1e3:.2f} ms, after {w.after}, waiting for "
                            f"{w.waiting_for}")
    record = {"measured": _as_record(measured), "predicted": _as_record(predicted),
              "closed_form_fraction": closed, "forward_s": forward_s, "backward_s": backward_s,
              "step_s": step_s}
    return "\n".join(rows), record


def _as_record(bmap: BubbleMap) -> dict[str, Any]:
    rec = asdict(bmap)
    for st, stage in zip(rec["stages"], bmap.stages, strict=True):
        st["idle_s"], st["fraction"] = stage.idle_s, stage.fraction
    return rec
