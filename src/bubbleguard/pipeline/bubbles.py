"""Bubble maps: where each stage's idle time falls in an iteration, predicted and measured.

A :class:`BubbleMap` is plain data. :func:`predict_bubbles` derives one from a schedule and
per-stage forward/backward times by timing the action lists on paper; :func:`measure_bubbles`
derives one from the idle events a real run recorded. Both use the same conventions, so the two can
be compared window by window: an iteration of stage ``s`` starts when its previous ``STEP`` ended,
and an idle window is the wait at one receive action of the list.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from bubbleguard.pipeline.schedules import Action, ActionKind, PipelineSchedule
from bubbleguard.pipeline.timeline import EventKind, TimelineEvent

__all__ = [
    "BubbleMap",
    "IdleWindow",
    "StageBubbles",
    "closed_form_bubble_fraction",
    "measure_bubbles",
    "measure_stage_bubbles",
    "predict_bubbles",
    "stage_compute_times",
]


@dataclass(frozen=True)
class IdleWindow:
    """One wait of a stage within an iteration.

    Attributes:
        action_index: index of the receive action in the stage's list.
        waiting_for: that action, e.g. ``"RA3<-0"``.
        after: the action before the wait (``"start"`` at the top of the list).
        offset_s: start of the wait, seconds after the iteration began.
        duration_s: length of the wait.
    """

    action_index: int
    waiting_for: str
    after: str
    offset_s: float
    duration_s: float


@dataclass(frozen=True)
class StageBubbles:
    """The idle windows of one stage in one (typical) iteration."""

    stage: int
    iteration_s: float
    windows: tuple[IdleWindow, ...]

    @property
    def idle_s(self) -> float:
        """Total idle time per iteration."""
        return sum(w.duration_s for w in self.windows)

    @property
    def fraction(self) -> float:
        """Idle time as a fraction of the iteration."""
        return self.idle_s / self.iteration_s if self.iteration_s > 0 else 0.0


@dataclass(frozen=True)
class BubbleMap:
    """Per-stage idle windows of a schedule."""

    schedule: str
    num_stages: int
    num_microbatches: int
    stages: tuple[StageBubbles, ...]

    def __str__(self) -> str:
        rows = [f"bubble map ({self.schedule}, {self.num_stages} stages, "
                f"{self.num_microbatches} microbatches)"]
        for st in self.stages:
            rows.append(f"  stage {st.stage}: iteration {st.iteration_s * 1e3:.2f} ms, idle "
                        f"{st.idle_s * 1e3:.2f} ms ({st.fraction:.1%})")
            for w in st.windows:
                if w.duration_s > 0:
                    rows.append(f"    +{w.offset_s * 1e3:8.2f} ms  {w.duration_s * 1e3:7.2f} ms  "
                                f"after {w.after}, waiting for {w.waiting_for}")
        return "\n".join(rows)


def closed_form_bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle fraction of every stage for GPipe and 1F1B with equal stage times and free sends.

    Each stage idles ``(P - 1)(t_f + t_b)`` out of an iteration of ``(M + P - 1)(t_f + t_b)``.
    """
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def _preceding(actions: Sequence[Action], index: int) -> str:
    """The last forward, backward or step before ``index`` (sends take no time): "start" if none."""
    for a in reversed(actions[:index]):
        if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.STEP):
            return str(a)
    return "start"


def predict_bubbles(
    schedule: PipelineSchedule,
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    step_s: Sequence[float] | None = None,
    num_iterations: int = 4,
) -> BubbleMap:
    """Time the schedule on paper and return the steady-state bubble map.

    Forward and backward passes of stage ``s`` take ``forward_s[s]`` and ``backward_s[s]``; the
    step takes ``step_s[s]`` (default 0); sends are free and instant. Iterations run back to back
    without a barrier between them, as in the runtime; the windows of the last of
    ``num_iterations`` iterations are returned (the first ones include pipeline fill-up).

    Raises:
        ValueError: a time list does not have one entry per stage.
    """
    p = schedule.num_stages
    steps = list(step_s) if step_s is not None else [0.0] * p
    for label, seq in (("forward_s", forward_s), ("backward_s", backward_s), ("step_s", steps)):
        if len(seq) != p:
            raise ValueError(f"{label} has {len(seq)} entries for {p} stages")
    cost = {ActionKind.FORWARD: forward_s, ActionKind.BACKWARD: backward_s, ActionKind.STEP: steps}
    matching = {ActionKind.RECV_ACT: ActionKind.SEND_ACT, ActionKind.RECV_GRAD: ActionKind.SEND_GRAD}
    clock = [0.0] * p
    iteration_start = [0.0] * p
    cursor = [0] * p
    iteration = [0] * p
    arrivals: dict[tuple[int, int, ActionKind, int, int], float] = {}
    windows: list[list[IdleWindow]] = [[] for _ in range(p)]
    iteration_s = [0.0] * p
    while min(iteration) < num_iterations:
        progressed = False
        for s in range(p):
            actions = schedule.stages[s]
            while iteration[s] < num_iterations:
                a = actions[cursor[s]]
                last = iteration[s] == num_iterations - 1
                if a.kind.is_send:
                    assert a.peer is not None and a.microbatch is not None
                    arrivals[(s, a.peer, a.kind, a.microbatch, iteration[s])] = clock[s]
                elif a.kind.is_recv:
                    assert a.peer is not None and a.microbatch is not None
                    key = (a.peer, s, matching[a.kind], a.microbatch, iteration[s])
                    if key not in arrivals:
                        break
                    ready = max(clock[s], arrivals.pop(key))
                    if last:
                        windows[s].append(IdleWindow(cursor[s], str(a), _preceding(actions, cursor[s]),
                                                     clock[s] - iteration_start[s], ready - clock[s]))
                    clock[s] = ready
                elif a.kind in cost:
                    clock[s] += cost[a.kind][s]
                progressed = True
                cursor[s] += 1
                if cursor[s] == len(actions):
                    if last:
                        iteration_s[s] = clock[s] - iteration_start[s]
                    cursor[s] = 0
                    iteration[s] += 1
                    iteration_start[s] = clock[s]
        assert progressed, "schedule deadlocks; run schedules.dry_run for details"
    return BubbleMap(schedule.name, p, schedule.num_microbatches,
                     tuple(StageBubbles(s, iteration_s[s], tuple(windows[s])) for s in range(p)))


def stage_compute_times(
    events: Sequence[TimelineEvent], num_stages: int, skip_steps: int = 1,
) -> tuple[list[float], list[float], list[float]]:
    """Median forward, backward and step time per stage from a recorded timeline.

    The first ``skip_steps`` steps are left out (warm-up: allocations, first-touch costs).

    Raises:
        ValueError: some stage has no recorded forward or backward after the skipped steps.
    """
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for e in events:
        if e.step <= skip_steps:
            continue
        if e.kind == EventKind.COMPUTE:
            samples[(e.stage, e.name[0])].append(e.duration_s)
        elif e.kind == EventKind.STEP:
            samples[(e.stage, "S")].append(e.duration_s)
    out: tuple[list[float], list[float], list[float]] = ([], [], [])
    for s in range(num_stages):
        for lst, key in zip(out, "FBS", strict=True):
            vals = samples.get((s, key))
            if not vals:
                raise ValueError(f"no {key!r} events for stage {s} after step {skip_steps}; "
                                 "run more steps")
            lst.append(statistics.median(vals))
    return out


def measure_stage_bubbles(
    events: Sequence[TimelineEvent], schedule: PipelineSchedule, stage: int,
    skip_steps: int = 1,
) -> StageBubbles:
    """Typical idle windows of one stage (replica 0) over the recorded steps after ``skip_steps``.

    Each window's duration and offset, and the iteration time, are medians over the steps, so one
    step stalled by something outside the schedule (another process taking the core) does not make
    a bubble the plan would count on. The idle events must carry the action index of the receive
    they waited for, as the runtime records them. A rank can call this on its own timeline alone.

    Raises:
        ValueError: fewer than two recorded steps remain after skipping (an iteration's start is
            the end of the previous step).
    """
    mine = [e for e in events if e.stage == stage and e.replica == 0]
    step_end = {e.step: e.end_s for e in mine if e.kind == EventKind.STEP}
    steps = [k for k in sorted(step_end) if k > skip_steps and k - 1 in step_end]
    if not steps:
        raise ValueError(f"stage {stage}: need recorded steps after step {skip_steps} "
                         f"(have {sorted(step_end)})")
    per_window: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in mine:
        if e.kind == EventKind.IDLE and e.step in steps:
            per_window[e.action_index].append((e.start_s - step_end[e.step - 1], e.duration_s))
    actions = schedule.stages[stage]
    windows = []
    for idx in sorted(per_window):
        offs, durs = zip(*per_window[idx], strict=True)
        # A window missing in some steps waited 0 there: those steps count as zeros.
        zeros = [0.0] * (len(steps) - len(durs))
        windows.append(IdleWindow(idx, str(actions[idx]), _preceding(actions, idx),
                                  statistics.median(offs), statistics.median([*durs, *zeros])))
    iteration = statistics.median(step_end[k] - step_end[k - 1] for k in steps)
    return StageBubbles(stage, iteration, tuple(windows))


def measure_bubbles(
    events: Sequence[TimelineEvent], schedule: PipelineSchedule, skip_steps: int = 1,
) -> BubbleMap:
    """Typical bubble map of the recorded steps after the first ``skip_steps``, all stages.

    Only replica 0's ranks are used (replicas of a stage run the same list).

    Raises:
        ValueError: a stage has fewer than two recorded steps after skipping.
    """
    stages = tuple(measure_stage_bubbles(events, schedule, s, skip_steps)
                   for s in range(schedule.num_stages))
    return BubbleMap(schedule.name, schedule.num_stages, schedule.num_microbatches, stages)
