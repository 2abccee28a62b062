"""Tests for bubbleguard.ps.core.state: applying, deduplicating and freezing a shard's state."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbleguard.ps.core.messages import BacklogEntry, Gradient, make_update_id
from bubbleguard.ps.core.state import LiveShardState, ShardState


def live(numel: int = 4, *, momentum: float = 0.0, lr: float = 0.1) -> LiveShardState:
    initial = ShardState.initial(0, torch.arange(numel, dtype=torch.float32), momentum=momentum > 0)
    return LiveShardState(initial, lr=lr, momentum=momentum)


def grad(worker: int, seq: int, read_version: int = 0, value: float = 1.0, numel: int = 4) -> Gradient:
    return Gradient(make_update_id(worker, 0, seq), read_version, torch.full((numel,), value))


def test_apply_steps_logs_and_acknowledges() -> None:
    state = live()
    ack = state.apply(grad(0, 0))
    assert ack.applied_uids == (make_update_id(0, 0, 0),) and ack.duplicate_uids == ()
    assert ack.step_version == 0 and ack.state_version == 1
    assert torch.allclose(state.params, torch.arange(4.0) - 0.1)
    frozen = state.freeze()
    assert frozen.num_applied == 1 and frozen.log.tolist() == [[make_update_id(0, 0, 0), 0, 0]]
    assert ack.state_digest == frozen.digest()


def test_a_resent_gradient_is_acknowledged_but_not_applied_again() -> None:
    state = live()
    state.apply(grad(0, 0))
    before = state.freeze()
    ack = state.apply(grad(0, 0, value=100.0))
    assert ack.applied_uids == () and ack.duplicate_uids == (make_update_id(0, 0, 0),)
    assert ack.step_version is None and state.freeze().equals(before)


def test_dedup_is_per_writer_and_survives_freeze_and_reload() -> None:
    state = live()
    for seq in range(3):
        state.apply(grad(0, seq))
    state.apply(grad(1, 0))
    reloaded = LiveShardState(state.freeze(), lr=0.1, momentum=0.0)
    assert reloaded.holds(make_update_id(0, 0, 2)) and reloaded.holds(make_update_id(1, 0, 0))
    assert not reloaded.holds(make_update_id(0, 0, 3))
    assert not reloaded.holds(make_update_id(0, 1, 0))  # a restarted worker is a new writer


def test_staleness_is_recorded_per_gradient() -> None:
    state = live()
    state.apply(grad(0, 0, read_version=0))
    state.apply(grad(1, 0, read_version=0))  # read before the first step: staleness 1
    log = state.freeze().log
    assert (log[:, 2] - log[:, 1]).tolist() == [0, 1]


def test_backlog_is_one_step_each_id_once_and_a_repeat_is_skipped() -> None:
    state = live()
    entries = [
        BacklogEntry((make_update_id(0, 0, 0),), 0, torch.ones(4)),
        BacklogEntry((make_update_id(0, 0, 1), make_update_id(0, 0, 2)), 0, torch.full((4,), 2.0)),
    ]
    ack = state.apply_backlog(entries, policy="mean", backlog_lr_scale=0.1)
    assert state.version == 1 and state.num_applied == 3
    assert ack.step_version == 0 and len(ack.applied_uids) == 3
    assert torch.allclose(state.params, torch.arange(4.0) - 0.1 * 1.0)  # mean of 1, 1, 1
    again = state.apply_backlog(entries, policy="mean", backlog_lr_scale=0.1)
    assert again.applied_uids == () and len(again.duplicate_uids) == 3 and state.version == 1


def test_backlog_entry_straddling_the_watermark_is_rejected() -> None:
    state = live()
    state.apply(grad(0, 0))
    mixed = BacklogEntry((make_update_id(0, 0, 0), make_update_id(0, 0, 1)), 0, torch.ones(4))
    with pytest.raises(ValueError, match="mixes applied and new"):
        state.apply_backlog([mixed], policy="mean", backlog_lr_scale=0.1)


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="gradient of shape"):
        live().apply(grad(0, 0, numel=5))


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 5)), min_size=1, max_size=40))
def test_any_push_sequence_applies_each_id_once(pushes: list[tuple[int, int]]) -> None:
    # Workers push in increasing order; re-sends repeat the latest id.
    state = live(momentum=0.5)
    next_seq = {w: 0 for w in range(3)}
    sent = []
    for worker, repeat in pushes:
        seq = next_seq[worker]
        for _ in range(1 + repeat % 2):
            state.apply(grad(worker, seq))
        sent.append(make_update_id(worker, 0, seq))
        next_seq[worker] += 1
    applied = state.freeze().applied_uids()
    assert sorted(applied) == sorted(sent) and len(set(applied)) == len(applied)
    assert state.version == len(sent)


def test_frozen_state_pickles_bitwise_and_log_grows_past_its_first_capacity() -> None:
    state = live(momentum=0.9)
    for seq in range(1500):
        state.apply(grad(0, seq, value=0.001))
    frozen = state.freeze()
    assert frozen.num_applied == 1500
    copy = pickle.loads(pickle.dumps(frozen))
    assert copy.equals(frozen) and copy.digest() == frozen.digest()
    assert state.log_since(1498).tolist() == frozen.log[1498:].tolist()


def test_digest_changes_with_parameters_momentum_and_version() -> None:
    base = ShardState.initial(0, torch.zeros(3), momentum=True)
    variants = [
        ShardState(0, torch.tensor([0.0, 0.0, 1e-7]), base.momentum, 0, base.log),
        ShardState(0, base.params, torch.tensor([0.0, 1.0, 0.0]), 0, base.log),
        ShardState(0, base.params, base.momentum, 1, base.log),
    ]
    assert len({base.digest(), *(v.digest() for v in variants)}) == 4
