"""Schedules are checked for every (stages, microbatches) up to 8 x 16."""

from __future__ import annotations

import dataclasses

import pytest

from bubbleguard.pipeline.schedules import (
    SCHEDULE_NAMES,
    Action,
    ActionKind,
    DeadlockError,
    PipelineSchedule,
    build_schedule,
    dry_run,
    gpipe,
    one_f_one_b,
    validate,
    with_checkpoint,
)

ALL_SIZES = [(p, m) for p in range(1, 9) for m in range(1, 17)]


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
def test_every_size_is_valid_and_never_deadlocks(name: str) -> None:
    for p, m in ALL_SIZES:
        sched = build_schedule(name, p, m)
        validate(sched)
        order = dry_run(sched)
        assert len(order) == sum(len(a) for a in sched.stages)
        # In the global order, a microbatch's forward on stage s precedes its forward on s + 1,
        # and its backward on s + 1 precedes its backward on s.
        pos = {(s, a.kind, a.microbatch): i for i, (s, a) in enumerate(order)}
        for s in range(p - 1):
            for mb in range(m):
                assert pos[(s, ActionKind.FORWARD, mb)] < pos[(s + 1, ActionKind.FORWARD, mb)]
                assert pos[(s + 1, ActionKind.BACKWARD, mb)] < pos[(s, ActionKind.BACKWARD, mb)]


def test_one_f_one_b_bounds_in_flight_microbatches() -> None:
    for p, m in ALL_SIZES:
        sched = one_f_one_b(p, m)
        for s, actions in enumerate(sched.stages):
            in_flight = peak = 0
            for a in actions:
                if a.kind is ActionKind.FORWARD:
                    in_flight += 1
                elif a.kind is ActionKind.BACKWARD:
                    in_flight -= 1
                peak = max(peak, in_flight)
            assert peak == min(p - s, m), (p, m, s)


def test_gpipe_holds_all_microbatches() -> None:
    sched = gpipe(3, 4)
    kinds = [a.kind for a in sched.stages[1] if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD)]
    assert kinds == [ActionKind.FORWARD] * 4 + [ActionKind.BACKWARD] * 4


def test_two_stage_1f1b_lists_read_as_expected() -> None:
    sched = one_f_one_b(2, 3)
    assert " ".join(map(str, sched.stages[0])) == (
        "F0 SA0->1 F1 SA1->1 RG0<-1 B0 F2 SA2->1 RG1<-1 B1 RG2<-1 B2 STEP")
    assert " ".join(map(str, sched.stages[1])) == (
        "RA0<-0 F0 B0 SG0->0 RA1<-0 F1 B1 SG1->0 RA2<-0 F2 B2 SG2->0 STEP")


def test_single_stage_has_no_communication() -> None:
    for name in SCHEDULE_NAMES:
        (actions,) = build_schedule(name, 1, 4).stages
        assert not any(a.kind.is_send or a.kind.is_recv for a in actions)


def test_unknown_schedule_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"unknown schedule 'zb'.*gpipe, 1f1b"):
        build_schedule("zb", 2, 2)


@pytest.mark.parametrize("p,m", [(0, 1), (1, 0), (-2, 3)])
def test_non_positive_sizes_are_rejected(p: int, m: int) -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        gpipe(p, m)


def _swap_stage(sched: PipelineSchedule, s: int, actions: list[Action]) -> PipelineSchedule:
    stages = list(sched.stages)
    stages[s] = tuple(actions)
    return dataclasses.replace(sched, stages=tuple(stages))


def test_dry_run_detects_deadlock() -> None:
    sched = one_f_one_b(2, 2)
    # Stage 0 waits for a gradient before sending any activation: nobody can move.
    a0 = list(sched.stages[0])
    recv = a0.index(Action(ActionKind.RECV_GRAD, 0, 1))
    bad = [a0[recv], a0[recv + 1], *a0[:recv], *a0[recv + 2:]]
    with pytest.raises(DeadlockError, match="stage 0 at RG0<-1"):
        dry_run(_swap_stage(sched, 0, bad))


def test_validate_catches_backward_before_forward_and_bad_pairing() -> None:
    sched = gpipe(2, 2)
    a1 = list(sched.stages[1])
    a1[1], a1[4] = a1[4], a1[1]  # F0 <-> B0 on the last stage
    with pytest.raises(ValueError, match="stage 1"):
        validate(_swap_stage(sched, 1, a1))
    a0 = [a for a in sched.stages[0] if a != Action(ActionKind.SEND_ACT, 1, 1)]
    with pytest.raises(ValueError, match="activation sends of stage 0"):
        validate(_swap_stage(sched, 0, a0))
    a0 = [a for a in sched.stages[0] if a.kind is not ActionKind.STEP]
    with pytest.raises(ValueError, match="must end with STEP"):
        validate(_swap_stage(sched, 0, a0))


def test_with_checkpoint_puts_one_checkpoint_before_every_step() -> None:
    for name in SCHEDULE_NAMES:
        sched = with_checkpoint(build_schedule(name, 3, 4))
        validate(sched)
        dry_run(sched)
        for actions in sched.stages:
            assert [str(a) for a in actions[-2:]] == ["CKPT", "STEP"]
        assert with_checkpoint(sched) == sched
