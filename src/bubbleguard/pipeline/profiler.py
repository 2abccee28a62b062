"""Plan checkpoint copies from a stage's own recent timeline (profile -> bubble map -> plan).

The runtime copies chunks greedily, in id order, while it waits on receives; the plan says what
that will achieve on the bubbles measured so far: which chunks fit in which window, how much is
left for the blocking copy before the step, and how often a durable persist fits in the time that
remains. Re-planned on the last steps only, it follows bubbles that drift.
"""

from __future__ import annotations

from collections.abc import Sequence

from bubbleguard.checkpoint.planner import CheckpointPlan, IdleWindow, plan_checkpoint
from bubbleguard.pipeline.bubbles import measure_stage_bubbles
from bubbleguard.pipeline.schedules import PipelineSchedule
from bubbleguard.pipeline.timeline import TimelineEvent

__all__ = ["plan_from_timeline"]


def plan_from_timeline(
    events: Sequence[TimelineEvent],
    schedule: PipelineSchedule,
    stage: int,
    chunk_sizes: Sequence[int],
    copy_bandwidth_bytes_per_s: float,
    *,
    persist_bandwidth_bytes_per_s: float | None = None,
    last_steps: int = 10,
) -> CheckpointPlan:
    """Plan one stage's snapshot copies on the bubbles of its last ``last_steps`` steps.

    Raises:
        ValueError: fewer than two recorded steps, or a non-positive bandwidth.
    """
    newest = max((e.step for e in events if e.stage == stage), default=0)
    bubbles = measure_stage_bubbles(events, schedule, stage,
                                    skip_steps=max(1, newest - last_steps))
    windows = [IdleWindow(w.action_index, w.after, w.duration_s) for w in bubbles.windows]
    return plan_checkpoint(windows, chunk_sizes, copy_bandwidth_bytes_per_s,
                           persist_bandwidth_bytes_per_s=persist_bandwidth_bytes_per_s)
