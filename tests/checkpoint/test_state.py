"""Tests for checkpoint/state.py: capture, restore, reshard, mismatches."""

from __future__ import annotations

import pytest
import torch

from bubbleguard.checkpoint.errors import StateMismatchError
from bubbleguard.checkpoint.state import StageState, capture_state, restore_state, stage_selector
from tests.checkpoint.ckpt_testlib import assert_same_tensors, make_training, seed_all, train_step


def _trained(steps: int, blocks=range(4)):
    seed_all(0)
    model, opt, sched = make_training(blocks)
    for s in range(1, steps + 1):
        train_step(model, opt, sched, s)
    return model, opt, sched


def test_restore_continues_bit_identically() -> None:
    model, opt, sched = _trained(3)
    saved = capture_state(model, opt, sched, step=3, data_cursor={"batch": 3}).clone()
    expected = [train_step(model, opt, sched, s) for s in range(4, 7)]
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}

    seed_all(123)  # different RNG states and a different init: all must be overwritten
    model2, opt2, sched2 = make_training(seed=7)
    result = restore_state(saved, model2, opt2, sched2)
    assert result.step == 3 and result.data_cursor == {"batch": 3}
    assert [train_step(model2, opt2, sched2, s) for s in range(4, 7)] == expected
    assert_same_tensors(expected_params, model2.state_dict())
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    assert sched2.state_dict() == sched.state_dict()


def test_capture_references_parameters_and_clones_buffers() -> None:
    model, opt, sched = _trained(1)
    state = capture_state(model, opt, sched, step=1)
    w = model.blocks["0"].lin.weight
    assert state.tensors["blocks.0.lin.weight"].data_ptr() == w.data_ptr()
    exp_avg = opt.state[w]["exp_avg"]
    assert state.tensors["optim.blocks.0.lin.weight.exp_avg"].data_ptr() == exp_avg.data_ptr()
    assert state.tensors["optim.blocks.0.lin.weight.step"].item() == 1.0
    assert state.tensors["blocks.0.scale"].data_ptr() != model.blocks["0"].scale.data_ptr()
    assert set(state.local_tensors) == {"rng.torch"}
    assert state.local_tensors["rng.torch"].dtype == torch.uint8
    groups = state.metadata["optimizer"]["param_groups"]
    assert groups[0]["params"][0] == "blocks.0.lin.weight" and groups[0]["weight_decay"] == 0.1


def test_stage_of_another_split_loads_only_its_names() -> None:
    model, opt, sched = _trained(2)
    whole = capture_state(model, opt, sched, step=2).clone()
    stage, stage_opt, stage_sched = make_training(blocks=[2, 3], seed=5)
    result = restore_state(whole, stage, stage_opt, stage_sched)
    assert result.unexpected == tuple(
        sorted(k for k in model.state_dict() if k.startswith(("blocks.0", "blocks.1")))
    )
    for name, t in stage.state_dict().items():
        assert torch.equal(t, model.state_dict()[name]), name
    for fqn, p in stage.named_parameters():
        original = dict(model.named_parameters())[fqn]
        assert torch.equal(stage_opt.state[p]["exp_avg_sq"], opt.state[original]["exp_avg_sq"])
    # and the restored stage trains exactly like the same blocks of the whole model would
    assert stage_opt.param_groups[0]["weight_decay"] == 0.1


def test_stage_selector_picks_model_and_optimizer_entries() -> None:
    model, opt, sched = _trained(1)
    whole = capture_state(model, opt, sched, step=1)
    stage, _, _ = make_training(blocks=[1])
    chosen = sorted(n for n in whole.tensors if stage_selector(stage)(n))
    assert chosen and all(n.startswith(("blocks.1.", "optim.blocks.1.")) for n in chosen)
    assert len(chosen) == len(stage.state_dict()) + 3 * len(list(stage.parameters()))


def test_different_model_names_missing_and_unexpected() -> None:
    model, opt, sched = _trained(1, blocks=[0, 1])
    state = capture_state(model, opt, sched, step=1)
    other, other_opt, _ = make_training(blocks=[2])
    with pytest.raises(StateMismatchError) as e:
        restore_state(state, other, other_opt)
    msg = str(e.value)
    assert "missing" in msg and "'blocks.2.lin.weight'" in msg
    assert "unexpected" in msg and "'blocks.0.lin.weight'" in msg


def test_strict_mode_rejects_other_stages_keys() -> None:
    model, opt, sched = _trained(1)
    state = capture_state(model, opt, sched, step=1)
    stage, stage_opt, _ = make_training(blocks=[0])
    with pytest.raises(StateMismatchError, match="blocks.1.lin.weight"):
        restore_state(state, stage, stage_opt, allow_unexpected=False)


def test_shape_mismatch_names_the_tensor() -> None:
    model, opt, sched = _trained(1)
    state = capture_state(model, opt, sched, step=1)
    tensors = dict(state.tensors)
    tensors["blocks.0.lin.bias"] = torch.zeros(3)
    bad = StageState(1, tensors, state.local_tensors, state.metadata)
    with pytest.raises(StateMismatchError, match=r"blocks.0.lin.bias.*\(3,\)"):
        restore_state(bad, make_training()[0])


def test_unjsonable_metadata_is_named() -> None:
    model, opt, sched = _trained(1)
    with pytest.raises(ValueError, match="data_cursor.sampler"):
        capture_state(model, opt, sched, step=1, data_cursor={"sampler": object()})


def test_optimizer_parameter_outside_module_is_rejected() -> None:
    model, _, _ = make_training(blocks=[0])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(ValueError, match="not a parameter of the stage module"):
        capture_state(model, opt, step=0)


def test_begin_capture_takes_at_the_boundary_what_may_change_before_the_next_step() -> None:
    import random

    import numpy as np

    from bubbleguard.checkpoint.state import begin_capture

    model, opt, sched = _trained(2)
    expected = capture_state(model, opt, sched, step=2, data_cursor={"batch": 2}).clone()
    cursor = {"batch": 2}
    pending = begin_capture(model, opt, sched, step=2, data_cursor=cursor)
    # What happens between the boundary and complete(): a forward pass changes a buffer, the
    # RNGs advance, the scheduler moves the learning rate, the data cursor moves on.
    with torch.no_grad():
        model.blocks["0"].scale.mul_(2)
    torch.rand(3), random.random(), np.random.rand()
    sched.step()
    cursor["batch"] = 3
    got = pending.complete()
    assert_same_tensors(dict(got.tensors), dict(expected.tensors))
    assert_same_tensors(dict(got.local_tensors), dict(expected.local_tensors))
    assert got.metadata == expected.metadata


def test_begin_capture_references_parameters_and_optimizer_state() -> None:
    from bubbleguard.checkpoint.state import begin_capture

    model, opt, sched = _trained(1)
    state = begin_capture(model, opt, sched, step=1).complete()
    w = model.blocks["0"].lin.weight
    assert state.tensors["blocks.0.lin.weight"].data_ptr() == w.data_ptr()
    assert state.tensors["optim.blocks.0.lin.weight.exp_avg"].data_ptr() == (
        opt.state[w]["exp_avg"].data_ptr())
    assert not state.tensors["blocks.0.lin.weight"].requires_grad
