"""Split a model into pipeline stages at layer boundaries, keeping whole-model parameter names.

A model is split along the order in which it registers its children. With ``layers="blocks"`` the
children registered before ``model.blocks`` go to the first stage, the entries of ``model.blocks``
(an ``nn.ModuleList`` or ``nn.Sequential``) are spread over the stages as evenly as possible, and
the children registered after it go to the last stage. With ``layers=None`` every child is a layer
(``nn.Sequential`` models). The model's forward must be the composition of its children in
registration order, as it is for ``nn.Sequential`` and for the built-in models.

A stage registers its modules under their original dotted names, so ``stage.state_dict()`` and
``stage.named_parameters()`` use the whole model's fully qualified names (``blocks.3.attn.qkv.weight``)
and a checkpoint written with P stages loads into P' stages by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StageModule", "StagePlan", "partition_layers", "plan_stages", "split"]


def partition_layers(num_layers: int, num_stages: int) -> list[range]:
    """Contiguous, as-even-as-possible ranges of layer indices, earlier stages taking the extras.

    Raises:
        ValueError: more stages than layers, or non-positive counts.
    """
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if num_layers < num_stages:
        raise ValueError(f"cannot split {num_layers} layers into {num_stages} stages: "
                         f"each stage needs at least one layer (use --stages <= {num_layers})")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for s in range(num_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class StagePlan:
    """Which whole-model children (by dotted name) each stage holds, in forward order."""

    num_stages: int
    units: tuple[tuple[str, ...], ...]

    def __str__(self) -> str:
        return "\n".join(f"stage {s}: {', '.join(u)}" for s, u in enumerate(self.units))


def _layer_units(model: nn.Module, layers: str | None) -> tuple[list[str], list[str], list[str]]:
    names = [name for name, _ in model.named_children()]
    if layers is None:
        return [], names, []
    if layers not in names:
        raise ValueError(f"model has no child {layers!r} holding its layers; its children are "
                         f"{names}; pass layers=<name> or layers=None for nn.Sequential")
    container = getattr(model, layers)
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise ValueError(f"model.{layers} is a {type(container).__name__}, expected nn.ModuleList "
                         "or nn.Sequential")
    i = names.index(layers)
    inner = [f"{layers}.{n}" for n, _ in container.named_children()]
    return names[:i], inner, names[i + 1:]


def plan_stages(model: nn.Module, num_stages: int, layers: str | None = "blocks") -> StagePlan:
    """Decide which children of ``model`` each of ``num_stages`` stages holds (pure, no copying).

    Raises:
        ValueError: more stages than layers, or ``layers`` does not name a container of layers.
    """
    pre, inner, post = _layer_units(model, layers)
    ranges = partition_layers(len(inner), num_stages)
    units = []
    for s, r in enumerate(ranges):
        mine = [inner[i] for i in r]
        if s == 0:
            mine = pre + mine
        if s == num_stages - 1:
            mine = mine + post
        units.append(tuple(mine))
    return StagePlan(num_stages, tuple(units))


class StageModule(nn.Module):
    """One pipeline stage: a run of the whole model's children under their original names.

    Attributes:
        stage_index: this stage's position in the pipeline.
        num_stages: pipeline depth.
        unit_names: dotted names of the children it runs, in forward order.
    """

    def __init__(self, units: Sequence[tuple[str, nn.Module]], stage_index: int,
                 num_stages: int) -> None:
        super().__init__()
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.unit_names = tuple(name for name, _ in units)
        self._units: list[nn.Module] = []  # plain list: registration happens via _attach
        for name, module in units:
            self._attach(name, module)
            self._units.append(module)

    def _attach(self, dotted: str, module: nn.Module) -> None:
        parent: nn.Module = self
        *path, leaf = dotted.split(".")
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.add_module(leaf, module)

    @property
    def is_first(self) -> bool:
        """Whether this stage reads the model's input."""
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        """Whether this stage produces the model's output (and computes the loss)."""
        return self.stage_index == self.num_stages - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run this stage's children in order."""
        for unit in self._units:
            x = unit(x)
        return x

    def extra_repr(self) -> str:
        return f"stage={self.stage_index}/{self.num_stages}, units={list(self.unit_names)}"


def split(model: nn.Module, num_stages: int, stage_index: int, layers: str | None = "blocks",
          ) -> StageModule:
    """Return stage ``stage_index`` of ``model`` split into ``num_stages`` stages.

    The stage shares its modules with ``model`` (nothing is copied); drop the reference to
    ``model`` to free the other stages' parameters.

    Raises:
        ValueError: ``stage_index`` out of range, more stages than layers, or a model whose
            layers cannot be found (see :func:`plan_stages`).
    """
    if not 0 <= stage_index < num_stages:
        raise ValueError(f"stage_index {stage_index} is outside 0..{num_stages - 1}")
    plan = plan_stages(model, num_stages, layers)
    units = [(name, model.get_submodule(name)) for name in plan.units[stage_index]]
    return StageModule(units, stage_index, num_stages)
