"""The model workers train, built from a registry by name, and the two things done with it:
computing a gradient from flat per-shard weights, and evaluating served weights.

The built-in ``cnn`` is small on purpose (about 14k parameters for 8x8 digits): the subject is
the parameter server, not the model. Register another with :func:`register_model`; the factory
receives the data set's input shape and class count and must be picklable (Ray ships it to
the workers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn import functional as F

from bubbleguard.ps.core.layout import ParamLayout

ModelFactory = Callable[[tuple[int, int, int], int], nn.Module]
_REGISTRY: dict[str, ModelFactory] = {}


class SmallCNN(nn.Module):
    """conv(16) -> pool -> conv(32) -> adaptive pool 2x2 -> fc(64) -> fc(classes).

    The adaptive pool lets the same network take 8x8 digits and 28x28 images.
    """

    def __init__(self, input_shape: tuple[int, int, int], num_classes: int) -> None:
        super().__init__()
        channels = input_shape[0]
        self.conv1 = nn.Conv2d(channels, 16, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(32 * 2 * 2, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for a batch ``[B, C, H, W]``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def register_model(name: str, factory: ModelFactory) -> None:
    """Make ``name`` buildable; ``factory(input_shape, num_classes)`` returns the module."""
    if not name:
        raise ValueError("model names must be non-empty")
    _REGISTRY[name] = factory


register_model("cnn", SmallCNN)


def model_factory(name: str) -> ModelFactory:
    """The factory registered as ``name``.

    Raises:
        ValueError: no such model.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(sorted(_REGISTRY))}") from None


def build_model(factory: ModelFactory, input_shape: tuple[int, int, int], num_classes: int, seed: int) -> nn.Module:
    """The model with its initial weights fixed by ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory(input_shape, num_classes)


class FlatModel:
    """A model whose parameters are loaded from per-shard flat tensors.

    Args:
        module: the model (its parameters are overwritten by :meth:`load`).
        layout: where each parameter lives.
    """

    def __init__(self, module: nn.Module, layout: ParamLayout) -> None:
        self.module = module
        self.layout = layout
        self._params = dict(module.named_parameters())

    def load(self, flats: Sequence[torch.Tensor]) -> None:
        """Copy the per-shard flat weights into the module."""
        with torch.no_grad():
            for name, value in self.layout.unflatten(flats).items():
                self._params[name].copy_(value)

    def gradient(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, list[torch.Tensor]]:
        """Loss and per-shard flat gradients of one minibatch at the loaded weights."""
        self.module.zero_grad(set_to_none=False)
        loss = F.cross_entropy(self.module(x), y)
        loss.backward()
        grads = {n: p.grad if p.grad is not None else torch.zeros_like(p) for n, p in self._params.items()}
        return float(loss.item()), self.layout.flatten(grads)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Accuracy and mean cross-entropy at the loaded weights."""
        logits = self.module(x)
        accuracy = float((logits.argmax(dim=1) == y).float().mean().item())
        return accuracy, float(F.cross_entropy(logits, y).item())
