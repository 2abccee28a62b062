"""Tests for bubbleguard.ps.training.model: seeded models, flat weights, gradients."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.training.model import FlatModel, SmallCNN, build_model, model_factory


def test_same_seed_same_weights_and_the_cnn_takes_larger_images() -> None:
    a = build_model(SmallCNN, (1, 8, 8), 10, seed=4)
    b = build_model(SmallCNN, (1, 8, 8), 10, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert SmallCNN((1, 28, 28), 10)(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


def test_flat_gradient_equals_autograd_on_the_module() -> None:
    torch.manual_seed(0)
    module = build_model(SmallCNN, (1, 8, 8), 10, seed=0)
    reference = build_model(SmallCNN, (1, 8, 8), 10, seed=0)
    layout = ParamLayout.from_module(module, 2)
    flats = layout.flatten(dict(reference.named_parameters()))
    model = FlatModel(module, layout)
    model.load(flats)
    x, y = torch.rand(5, 1, 8, 8), torch.randint(0, 10, (5,))
    loss, grads = model.gradient(x, y)
    ref_loss = F.cross_entropy(reference(x), y)
    ref_loss.backward()
    expected = layout.flatten({n: p.grad for n, p in reference.named_parameters() if p.grad is not None})
    assert loss == pytest.approx(ref_loss.item())
    assert all(torch.allclose(g, e) for g, e in zip(grads, expected, strict=True))
    accuracy, _ = model.evaluate(x, y)
    assert 0.0 <= accuracy <= 1.0


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model 'resnet'"):
        model_factory("resnet")
