"""Tests for bubbleguard.models.gpt, and the GPT side of the registry in bubbleguard.models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bubbleguard.models import (
    MODEL_NAMES,
    build_model,
    model_config,
    model_seq_len,
    model_target,
)
from bubbleguard.models.gpt import GPT, GPTConfig, lm_loss

TINY = GPTConfig(seq_len=16, d_model=32, num_layers=2, num_heads=4)


def tiny_gpt(seed: int = 0, cfg: GPTConfig = TINY) -> GPT:
    torch.manual_seed(seed)
    return GPT(cfg)


def random_ids(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (batch, length), generator=gen)


# --- structure: the contract the pipeline splitter relies on ---


def test_children_are_embed_blocks_head_in_order() -> None:
    model = tiny_gpt()
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "head"]
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == TINY.num_layers


def test_every_parameter_lives_under_a_child() -> None:
    names = [name for name, _ in tiny_gpt().named_parameters()]
    assert names
    assert all(n.split(".")[0] in {"embed", "blocks", "head"} for n in names)


@pytest.mark.parametrize("length", [1, 7, TINY.seq_len])
def test_running_children_in_order_equals_forward(length: int) -> None:
    model = tiny_gpt()
    ids = random_ids(3, length)
    x = model.embed(ids)
    for block in model.blocks:
        x = block(x)
        assert x.shape == (3, length, TINY.d_model)
    assert torch.equal(model.head(x), model(ids))


# --- behaviour ---


def test_logits_shape_and_dtype() -> None:
    logits = tiny_gpt()(random_ids(2, 10))
    assert logits.shape == (2, 10, TINY.vocab_size)
    assert logits.dtype == torch.float32


def test_sequence_longer_than_seq_len_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"sequence length 17 exceeds the model's seq_len=16"):
        tiny_gpt()(random_ids(1, 17))


def test_changing_a_later_token_leaves_earlier_logits_unchanged() -> None:
    model = tiny_gpt()
    ids = random_ids(2, TINY.seq_len)
    changed = ids.clone()
    j = 9
    changed[:, j] = (changed[:, j] + 1) % 256
    before, after = model(ids), model(changed)
    assert torch.equal(before[:, :j], after[:, :j])
    # The change is visible from position j on, so the comparison above is not vacuous.
    assert not torch.allclose(before[:, j:], after[:, j:])


def test_forward_is_deterministic_in_train_mode() -> None:
    model = tiny_gpt().train()
    ids = random_ids(2, 12)
    assert torch.equal(model(ids), model(ids))


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = tiny_gpt(seed=3), tiny_gpt(seed=3), tiny_gpt(seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["blocks.0.attn.qkv.weight"], sc["blocks.0.attn.qkv.weight"])


def test_initial_loss_is_near_uniform() -> None:
    model = tiny_gpt()
    ids = random_ids(8, TINY.seq_len)
    loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
    assert abs(loss.item() - math.log(256)) < 0.1


def test_a_few_steps_fit_a_fixed_batch() -> None:
    model = tiny_gpt()
    ids = random_ids(4, TINY.seq_len)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = lm_loss(model(ids[:, :-1]), ids[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0]


def test_d_ff_defaults_to_four_times_d_model() -> None:
    assert GPTConfig(d_model=32, num_heads=4).ff_dim == 128
    assert GPTConfig(d_model=32, num_heads=4, d_ff=40).ff_dim == 40
    model = tiny_gpt(cfg=GPTConfig(seq_len=8, d_model=32, num_layers=1, num_heads=2, d_ff=40))
    assert model.blocks[0].mlp[0].out_features == 40


# --- config validation ---


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"d_model": 30, "num_heads": 4}, r"d_model=30 is not divisible by num_heads=4"),
        ({"num_layers": 0}, r"num_layers must be a positive int, got 0"),
        ({"vocab_size": -1}, r"vocab_size must be a positive int, got -1"),
        ({"seq_len": 2.5}, r"seq_len must be a positive int, got 2.5"),
        ({"num_heads": True}, r"num_heads must be a positive int, got True"),
        ({"d_ff": 0}, r"d_ff must be a positive int, got 0"),
    ],
)
def test_invalid_config_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTConfig(**kwargs)


# --- lm_loss ---


def test_lm_loss_matches_cross_entropy_for_both_layouts() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=gen)
    targets = torch.randint(0, 7, (2, 5), generator=gen)
    expected = F.cross_entropy(logits.permute(0, 2, 1), targets)
    torch.testing.assert_close(lm_loss(logits, targets), expected)
    torch.testing.assert_close(
        lm_loss(logits[:, -1], targets[:, -1]), F.cross_entropy(logits[:, -1], targets[:, -1])
    )


def test_lm_loss_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match=r"logits \(2, 5, 7\) do not match targets \(2, 4\)"):
        lm_loss(torch.zeros(2, 5, 7), torch.zeros(2, 4, dtype=torch.long))


# --- registry (bubbleguard.models) ---


def test_build_model_gpt_is_seeded_and_applies_overrides() -> None:
    a = build_model("gpt", seed=5, num_layers=2, seq_len=8)
    b = build_model("gpt", seed=5, num_layers=2, seq_len=8)
    assert isinstance(a, GPT)
    assert a.cfg == GPTConfig(num_layers=2, seq_len=8)
    assert len(a.blocks) == 2
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # Same weights as seeding by hand and constructing directly.
    torch.manual_seed(5)
    direct = GPT(GPTConfig(num_layers=2, seq_len=8)).state_dict()
    assert all(torch.equal(sa[k], direct[k]) for k in sa)


def test_build_model_leaves_global_rng_untouched() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("gpt", seed=0, num_layers=1)
    assert torch.equal(torch.rand(3), expected)


def test_unknown_override_lists_accepted_fields() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown option\(s\) depth for model 'gpt'; accepted: vocab_size, seq_len",
    ):
        build_model("gpt", seed=0, depth=3)


def test_gpt_data_shape_helpers() -> None:
    assert "gpt" in MODEL_NAMES
    cfg = model_config("gpt", seq_len=32)
    assert model_seq_len(cfg) == 32
    assert model_target(cfg) == "next_token"
