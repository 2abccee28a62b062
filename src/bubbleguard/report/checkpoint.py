"""Where checkpoint time went, per stage: inside bubbles or on the critical path."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from bubbleguard.pipeline.timeline import EventKind, TimelineEvent

__all__ = ["checkpoint_summary"]


def checkpoint_summary(events: Sequence[TimelineEvent], skip_steps: int = 1) -> str | None:
    """Per stage (replica 0): median per-step checkpoint time in bubbles and blocking.

    Blocking time is what the ``CKPT begin`` / ``CKPT finish`` hooks took on the training thread
    (on a GPU also ``CKPT pause``: waiting for the helper thread's unit in flight); bubble time
    is the chunk copies made while waiting on receives. Returns None when the run recorded no
    checkpoint work.
    """
    per: dict[tuple[int, int], dict[str, float]] = defaultdict(lambda: {"bubble": 0.0,
                                                                        "blocking": 0.0})
    step_end: dict[tuple[int, int], float] = {}
    for e in events:
        if e.replica != 0 or e.step <= skip_steps:
            continue
        if e.kind == EventKind.CHECKPOINT:
            per[(e.stage, e.step)]["bubble" if e.name == "ckpt chunk" else "blocking"] += (
                e.duration_s)
        elif e.kind == EventKind.STEP:
            step_end[(e.stage, e.step)] = e.end_s
    if not per:
        return None
    rows = ["checkpoint time per step (median; every step snapshotted into shared memory):",
            f"  {'stage':>5} {'in bubbles ms':>13} {'blocking ms':>11} {'of step':>8}"]
    for stage in sorted({s for s, _ in per}):
        steps = sorted(k for s, k in per if s == stage)
        bubble = statistics.median(per[(stage, k)]["bubble"] for k in steps)
        blocking = statistics.median(per[(stage, k)]["blocking"] for k in steps)
        durations = [step_end[(stage, k)] - step_end[(stage, k - 1)] for k in steps
                     if (stage, k - 1) in step_end and (stage, k) in step_end]
        share = blocking / statistics.median(durations) if durations else float("nan")
        rows.append(f"  {stage:>5} {bubble * 1e3:13.2f} {blocking * 1e3:11.2f} {share:8.1%}")
    return "\n".join(rows)
