"""Pipeline schedules as plain data: one ordered action list per stage.

A schedule says, for every stage, what it does in one training iteration and in which order:
forward and backward passes of microbatches, the sends and receives that connect neighbouring
stages, and the optimizer step. It knows nothing about processes, tensors or clocks, so it can be
checked exhaustively (:func:`validate`, :func:`dry_run`) and timed on paper
(:mod:`bubbleguard.pipeline.bubbles`) before anything runs.

Conventions, shared with the runtime:

* Stage ``s`` receives activations from ``s - 1`` and gradients from ``s + 1``.
* A ``RECV_*`` action is the point where the stage *needs* the data; the time it waits there is
  the stage's idle time (its bubble), which later work fills with checkpoint copies.
* Sends never block the sender (they complete in the background); the runtime drains them before
  ``STEP``.
* ``STEP`` is the last action of every stage's list: gradients of all microbatches are in (and, with
  data-parallel replicas, averaged), then the optimizer steps.
* ``CHECKPOINT`` (added by :func:`with_checkpoint`) sits just before ``STEP``: the snapshot of the
  previous step must be complete before the optimizer changes the state, so whatever the bubbles
  did not copy is copied there, on the critical path.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

__all__ = [
    "SCHEDULE_NAMES",
    "Action",
    "ActionKind",
    "DeadlockError",
    "PipelineSchedule",
    "build_schedule",
    "dry_run",
    "gpipe",
    "one_f_one_b",
    "validate",
    "with_checkpoint",
]


class ActionKind(enum.Enum):
    """What a stage does at one point of its action list."""

    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    CHECKPOINT = "CKPT"
    STEP = "STEP"

    @property
    def is_send(self) -> bool:
        """Whether the action hands data to a neighbouring stage."""
        return self in (ActionKind.SEND_ACT, ActionKind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        """Whether the action waits for data from a neighbouring stage."""
        return self in (ActionKind.RECV_ACT, ActionKind.RECV_GRAD)


@dataclass(frozen=True)
class Action:
    """One entry of a stage's action list.

    Attributes:
        kind: what happens.
        microbatch: the microbatch it concerns; ``None`` for ``STEP``.
        peer: the stage on the other end of a send or receive; ``None`` otherwise.
    """

    kind: ActionKind
    microbatch: int | None = None
    peer: int | None = None

    def __str__(self) -> str:
        if self.microbatch is None:
            return self.kind.value
        arrow = {True: "->", False: "<-"}[self.kind.is_send]
        peer = f"{arrow}{self.peer}" if self.peer is not None else ""
        return f"{self.kind.value}{self.microbatch}{peer}"


@dataclass(frozen=True)
class PipelineSchedule:
    """Per-stage action lists for one training iteration.

    Attributes:
        name: the schedule's name (``"gpipe"``, ``"1f1b"``).
        num_stages: pipeline depth P.
        num_microbatches: microbatches per iteration M.
        stages: ``stages[s]`` is stage ``s``'s ordered action list.
    """

    name: str
    num_stages: int
    num_microbatches: int
    stages: tuple[tuple[Action, ...], ...]

    def __str__(self) -> str:
        rows = [f"{self.name}: {self.num_stages} stages x {self.num_microbatches} microbatches"]
        for s, actions in enumerate(self.stages):
            rows.append(f"  stage {s}: " + " ".join(str(a) for a in actions))
        return "\n".join(rows)


class DeadlockError(RuntimeError):
    """Raised by :func:`dry_run` when no stage can make progress but some are not done."""


def _check_sizes(num_stages: int, num_microbatches: int) -> None:
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_microbatches < 1:
        raise ValueError(f"num_microbatches must be >= 1, got {num_microbatches}")


def _forward(stage: int, num_stages: int, mb: int) -> list[Action]:
    """Receive the input (unless first), run forward, send the output (unless last)."""
    out: list[Action] = []
    if stage > 0:
        out.append(Action(ActionKind.RECV_ACT, mb, stage - 1))
    out.append(Action(ActionKind.FORWARD, mb))
    if stage < num_stages - 1:
        out.append(Action(ActionKind.SEND_ACT, mb, stage + 1))
    return out


def _backward(stage: int, num_stages: int, mb: int) -> list[Action]:
    """Receive the output's gradient (unless last), run backward, send the input's gradient."""
    out: list[Action] = []
    if stage < num_stages - 1:
        out.append(Action(ActionKind.RECV_GRAD, mb, stage + 1))
    out.append(Action(ActionKind.BACKWARD, mb))
    if stage > 0:
        out.append(Action(ActionKind.SEND_GRAD, mb, stage - 1))
    return out


def gpipe(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """GPipe: all forwards, then all backwards (in microbatch order), then the step.

    Peak activation memory holds all M microbatches; the bubble sits between the forward and the
    backward phase.
    """
    _check_sizes(num_stages, num_microbatches)
    stages = []
    for s in range(num_stages):
        actions: list[Action] = []
        for mb in range(num_microbatches):
            actions += _forward(s, num_stages, mb)
        for mb in range(num_microbatches):
            actions += _backward(s, num_stages, mb)
        actions.append(Action(ActionKind.STEP))
        stages.append(tuple(actions))
    return PipelineSchedule("gpipe", num_stages, num_microbatches, tuple(stages))


def one_f_one_b(num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """1F1B (PipeDream-flush): warm-up forwards, alternating forward/backward, cool-down backwards.

    Stage ``s`` runs ``min(P - 1 - s, M)`` warm-up forwards, so it holds at most ``P - s``
    microbatches' activations at a time; the total bubble equals GPipe's.
    """
    _check_sizes(num_stages, num_microbatches)
    stages = []
    for s in range(num_stages):
        num_warmup = min(num_stages - 1 - s, num_microbatches)
        actions: list[Action] = []
        for mb in range(num_warmup):
            actions += _forward(s, num_stages, mb)
        next_backward = 0
        for mb in range(num_warmup, num_microbatches):
            actions += _forward(s, num_stages, mb)
            actions += _backward(s, num_stages, next_backward)
            next_backward += 1
        for mb in range(next_backward, num_microbatches):
            actions += _backward(s, num_stages, mb)
        actions.append(Action(ActionKind.STEP))
        stages.append(tuple(actions))
    return PipelineSchedule("1f1b", num_stages, num_microbatches, tuple(stages))


def with_checkpoint(schedule: PipelineSchedule) -> PipelineSchedule:
    """The same schedule with a ``CHECKPOINT`` action just before every stage's ``STEP``."""
    stages = []
    for actions in schedule.stages:
        if any(a.kind is ActionKind.CHECKPOINT for a in actions):
            stages.append(actions)
        else:
            stages.append((*actions[:-1], Action(ActionKind.CHECKPOINT), actions[-1]))
    return PipelineSchedule(schedule.name, schedule.num_stages, schedule.num_microbatches,
                            tuple(stages))


_BUILDERS = {"gpipe": gpipe, "1f1b": one_f_one_b}
SCHEDULE_NAMES: tuple[str, ...] = tuple(_BUILDERS)


def build_schedule(name: str, num_stages: int, num_microbatches: int) -> PipelineSchedule:
    """Build a schedule by name.

    Raises:
        ValueError: unknown name (the accepted ones are listed) or non-positive sizes.
    """
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(
            f"unknown schedule {name!r}; choose one of {', '.join(SCHEDULE_NAMES)}"
        ) from None
    return builder(num_stages, num_microbatches)


def validate(schedule: PipelineSchedule) -> None:
    """Check the structural invariants of a schedule.

    Every stage runs forward and backward of every microbatch exactly once, each forward before its
    backward, ends with exactly one ``STEP``; each receive directly precedes the compute that needs
    it; sends and receives pair up across neighbouring stages in the same order on both ends.

    Raises:
        ValueError: naming the stage and action that break an invariant.
    """
    p, m = schedule.num_stages, schedule.num_microbatches
    if len(schedule.stages) != p:
        raise ValueError(f"schedule has {len(schedule.stages)} action lists for {p} stages")
    for s, actions in enumerate(schedule.stages):
        if not actions or actions[-1].kind is not ActionKind.STEP:
            raise ValueError(f"stage {s}: the action list must end with STEP")
        if sum(a.kind is ActionKind.STEP for a in actions) != 1:
            raise ValueError(f"stage {s}: exactly one STEP expected")
        num_ckpt = sum(a.kind is ActionKind.CHECKPOINT for a in actions)
        if num_ckpt > 1 or (num_ckpt and actions[-2].kind is not ActionKind.CHECKPOINT):
            raise ValueError(f"stage {s}: at most one CHECKPOINT, directly before STEP")
        done_forward: set[int | None] = set()
        done_backward: set[int | None] = set()
        for i, a in enumerate(actions):
            if a.kind is ActionKind.FORWARD:
                if a.microbatch in done_forward:
                    raise ValueError(f"stage {s}: forward of microbatch {a.microbatch} twice")
                done_forward.add(a.microbatch)
            elif a.kind is ActionKind.BACKWARD:
                if a.microbatch not in done_forward:
                    raise ValueError(f"stage {s}: backward {a.microbatch} before its forward")
                if a.microbatch in done_backward:
                    raise ValueError(f"stage {s}: backward of microbatch {a.microbatch} twice")
                done_backward.add(a.microbatch)
            elif a.kind.is_recv:
                consumer = ActionKind.FORWARD if a.kind is ActionKind.RECV_ACT else ActionKind.BACKWARD
                nxt = actions[i + 1] if i + 1 < len(actions) else None
                if nxt is None or nxt.kind is not consumer or nxt.microbatch != a.microbatch:
                    raise ValueError(f"stage {s}: {a} is not directly followed by its consumer")
        expected: set[int | None] = set(range(m))
        if done_forward != expected or done_backward != expected:
            raise ValueError(f"stage {s}: forwards {sorted(map(str, done_forward))}, backwards "
                             f"{sorted(map(str, done_backward))}; expected each of 0..{m - 1} once")

    def microbatches(stage: int, kind: ActionKind) -> list[int | None]:
        return [a.microbatch for a in schedule.stages[stage] if a.kind is kind]

    for s in range(p - 1):
        if microbatches(s, ActionKind.SEND_ACT) != microbatches(s + 1, ActionKind.RECV_ACT):
            raise ValueError(f"activation sends of stage {s} do not pair with receives of {s + 1}")
        if microbatches(s + 1, ActionKind.SEND_GRAD) != microbatches(s, ActionKind.RECV_GRAD):
            raise ValueError(f"gradient sends of stage {s + 1} do not pair with receives of {s}")
    for s, actions in enumerate(schedule.stages):
        for a in actions:
            if (a.kind.is_send or a.kind.is_recv) and a.peer not in (s - 1, s + 1):
                raise ValueError(f"stage {s}: {a} talks to stage {a.peer}, not a neighbour")


def dry_run(schedule: PipelineSchedule) -> list[tuple[int, Action]]:
    """Execute the action lists symbolically and return the global order in which actions ran.

    Sends deposit a message in the (sender, receiver, kind) channel; a receive proceeds only when
    its message is at the head of that channel (point-to-point order is FIFO, as on a real link).
    Stages are advanced round-robin as far as they can go.

    Raises:
        DeadlockError: when no stage can advance and some have actions left, naming where each
            stage is stuck.
        ValueError: a receive would consume a message for another microbatch.
    """
    p = schedule.num_stages
    cursor = [0] * p
    channels: dict[tuple[int, int, ActionKind], deque[int | None]] = {}
    order: list[tuple[int, Action]] = []
    matching = {ActionKind.RECV_ACT: ActionKind.SEND_ACT, ActionKind.RECV_GRAD: ActionKind.SEND_GRAD}
    total = sum(len(a) for a in schedule.stages)
    while len(order) < total:
        progressed = False
        for s in range(p):
            actions = schedule.stages[s]
            while cursor[s] < len(actions):
                a = actions[cursor[s]]
                if a.kind.is_send:
                    assert a.peer is not None
                    channels.setdefault((s, a.peer, a.kind), deque()).append(a.microbatch)
                elif a.kind.is_recv:
                    assert a.peer is not None
                    queue = channels.get((a.peer, s, matching[a.kind]))
                    if not queue:
                        break
                    got = queue.popleft()
                    if got != a.microbatch:
                        raise ValueError(f"stage {s}: {a} would receive microbatch {got}")
                order.append((s, a))
                cursor[s] += 1
                progressed = True
        if not progressed:
            stuck = ", ".join(
                f"stage {s} at {schedule.stages[s][cursor[s]]}"
                for s in range(p) if cursor[s] < len(schedule.stages[s])
            )
            raise DeadlockError(f"{schedule.name} deadlocks: {stuck}")
    return order
