"""Tests for bubbleguard.models.mlp, and the MLP side of the registry in bubbleguard.models."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from bubbleguard.models import (
    MODEL_NAMES,
    MLPConfig,
    build_model,
    lm_loss,
    model_config,
    model_seq_len,
    model_target,
)
from bubbleguard.models.mlp import MLP

CFG = MLPConfig()


def make_mlp(seed: int = 0, cfg: MLPConfig = CFG) -> MLP:
    torch.manual_seed(seed)
    return MLP(cfg)


def random_batch(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, CFG.context + 1), generator=gen)
    return ids[:, :-1], ids[:, -1]


def test_children_are_embed_blocks_head_in_order() -> None:
    model = make_mlp()
    assert [name for name, _ in model.named_children()] == ["embed", "blocks", "head"]
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == CFG.num_layers
    assert all(n.split(".")[0] in {"embed", "blocks", "head"} for n, _ in model.named_parameters())


def test_running_children_in_order_equals_forward() -> None:
    model = make_mlp()
    ids, _ = random_batch(5)
    x = model.embed(ids)
    assert x.shape == (5, CFG.hidden)
    for block in model.blocks:
        x = block(x)
        assert x.shape == (5, CFG.hidden)
    logits = model.head(x)
    assert logits.shape == (5, CFG.vocab_size)
    assert torch.equal(logits, model(ids))


def test_wrong_context_length_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"ids must have shape \(B, 16\).*got \(2, 15\)"):
        make_mlp()(torch.zeros(2, 15, dtype=torch.long))


def test_same_seed_same_weights_other_seed_other_weights() -> None:
    a, b, c = make_mlp(7), make_mlp(7), make_mlp(8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.proj.weight"], sc["embed.proj.weight"])


def test_initial_loss_is_near_uniform_and_training_lowers_it() -> None:
    model = make_mlp()
    ids, targets = random_batch(32)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        loss = lm_loss(model(ids), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert abs(losses[0] - math.log(256)) < 0.1
    assert losses[-1] < 0.7 * losses[0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"context": 0}, r"context must be a positive int, got 0"),
        ({"hidden": -4}, r"hidden must be a positive int, got -4"),
        ({"num_layers": 1.0}, r"num_layers must be a positive int, got 1.0"),
    ],
)
def test_invalid_config_is_rejected(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        MLPConfig(**kwargs)


# --- registry (bubbleguard.models) ---


def test_build_model_mlp_is_seeded_and_applies_overrides() -> None:
    model = build_model("mlp", seed=2, context=8, num_layers=2)
    assert isinstance(model, MLP)
    assert model.cfg == MLPConfig(context=8, num_layers=2)
    again = build_model("mlp", seed=2, context=8, num_layers=2).state_dict()
    assert all(torch.equal(v, again[k]) for k, v in model.state_dict().items())


def test_mlp_data_shape_helpers() -> None:
    cfg = model_config("mlp", context=12)
    assert model_seq_len(cfg) == 12
    assert model_target(cfg) == "last_token"


def test_unknown_model_name_lists_accepted_names() -> None:
    assert MODEL_NAMES == ("gpt", "mlp")
    with pytest.raises(ValueError, match=r"unknown model 'rnn'; accepted: gpt, mlp"):
        build_model("rnn", seed=0)


def test_unknown_override_lists_accepted_fields() -> None:
    with pytest.raises(
        ValueError,
        match=r"unknown option\(s\) seq_len for model 'mlp'; accepted: vocab_size, context",
    ):
        model_config("mlp", seq_len=4)


def test_invalid_override_value_is_rejected_by_the_config() -> None:
    with pytest.raises(ValueError, match=r"hidden must be a positive int, got 0"):
        build_model("mlp", seed=0, hidden=0)
