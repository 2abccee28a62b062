"""Tests for bubbleguard.ps.core.optim: the SGD step and the three backlog policies."""

from __future__ import annotations

import pytest
import torch

from bubbleguard.ps.core.messages import BacklogEntry
from bubbleguard.ps.core.optim import backlog_gradient, sgd_step


def test_plain_sgd_of_a_sum_equals_sequential_steps() -> None:
    # Why strict consistency may apply a clock's gradients one by one.
    g1, g2 = torch.tensor([1.0, -2.0]), torch.tensor([0.5, 4.0])
    a, b = torch.zeros(2), torch.zeros(2)
    buf = torch.zeros(0)
    sgd_step(a, buf, g1, 0.1, 0.0)
    sgd_step(a, buf, g2, 0.1, 0.0)
    sgd_step(b, buf, g1 + g2, 0.1, 0.0)
    assert torch.allclose(a, b)


def test_momentum_matches_torch_sgd() -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    ours, buf = torch.tensor([1.0, 2.0]), torch.zeros(2)
    for g in (torch.tensor([1.0, 1.0]), torch.tensor([-2.0, 0.5]), torch.tensor([0.3, 0.3])):
        p.grad = g.clone()
        opt.step()
        sgd_step(ours, buf, g, 0.1, 0.9)
    assert torch.allclose(ours, p.detach())


def _entries() -> list[BacklogEntry]:
    # Two single gradients read at version 8 and one coalesced pair read at version 6.
    return [
        BacklogEntry((1,), 8, torch.tensor([1.0, 0.0])),
        BacklogEntry((2,), 8, torch.tensor([0.0, 2.0])),
        BacklogEntry((3, 4), 6, torch.tensor([4.0, 4.0])),
    ]


def test_sum_scaled_is_the_scaled_sum() -> None:
    got = backlog_gradient(_entries(), policy="sum-scaled", version=10, backlog_lr_scale=0.1)
    assert torch.allclose(got, torch.tensor([0.5, 0.6]))


def test_mean_divides_by_the_number_of_gradients_not_entries() -> None:
    got = backlog_gradient(_entries(), policy="mean", version=10, backlog_lr_scale=0.1)
    assert torch.allclose(got, torch.tensor([5.0, 6.0]) / 4)


def test_staleness_weighted_uses_sequential_staleness() -> None:
    # Gradient i at position p was read at version r: weight 1 / (1 + (10 - r) + p).
    got = backlog_gradient(_entries(), policy="staleness-weighted", version=10, backlog_lr_scale=0.1)
    w1, w2 = 1 / (1 + 2 + 0), 1 / (1 + 2 + 1)
    w34 = (1 / (1 + 4 + 2) + 1 / (1 + 4 + 3)) / 2  # the pair shares its positions' mean weight
    expected = w1 * torch.tensor([1.0, 0.0]) + w2 * torch.tensor([0.0, 2.0]) + w34 * torch.tensor([4.0, 4.0])
    assert torch.allclose(got, expected)


def test_staleness_weighted_grows_like_a_logarithm_not_linearly() -> None:
    n = 1000
    entries = [BacklogEntry((i,), 0, torch.ones(1)) for i in range(n)]
    total = backlog_gradient(entries, policy="staleness-weighted", version=0, backlog_lr_scale=0.1)
    harmonic = sum(1 / (1 + i) for i in range(n))
    assert total.item() == pytest.approx(harmonic, rel=1e-5)
    assert total.item() < 8


def test_backlog_rejects_unknown_policy_and_empty_backlog() -> None:
    with pytest.raises(ValueError, match="unknown backlog policy"):
        backlog_gradient(_entries(), policy="median", version=0, backlog_lr_scale=0.1)
    with pytest.raises(ValueError, match="at least one entry"):
        backlog_gradient([], policy="mean", version=0, backlog_lr_scale=0.1)
