"""Where each parameter lives: shards by contiguous key range, flat buffers per shard.

Parameters are keyed by their fully qualified name in the whole model (``conv1.weight``), in the
model's registration order. Shard ``k`` holds one contiguous range of those keys, chosen so the
shards hold about the same number of values; within a shard the parameters are concatenated
into one flat float32 buffer, which is what servers store and workers push and pull.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ParamSlot:
    """One parameter: its name, shape, shard and offset in that shard's flat buffer."""

    name: str
    shape: tuple[int, ...]
    shard: int
    offset: int

    @property
    def numel(self) -> int:
        """Number of values."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ParamLayout:
    """The split of a model's parameters into ``num_shards`` flat buffers."""

    slots: tuple[ParamSlot, ...]
    num_shards: int

    @classmethod
    def from_shapes(cls, shapes: Sequence[tuple[str, tuple[int, ...]]], num_shards: int) -> ParamLayout:
        """Split ``(name, shape)`` pairs, in order, into contiguous key ranges.

        A range is closed before the parameter that would take it further past its fair share of
        the values left than stopping short leaves it, and no shard is empty.

        Raises:
            ValueError: fewer parameters than shards, or a repeated name.
        """
        if num_shards < 1:
            raise ValueError(f"num_shards must be >= 1, got {num_shards}")
        if len(shapes) < num_shards:
            raise ValueError(f"cannot split {len(shapes)} parameters into {num_shards} shards")
        names = [n for n, _ in shapes]
        if len(set(names)) != len(names):
            raise ValueError("parameter names must be unique")
        sizes = [ParamSlot(n, tuple(s), 0, 0).numel for n, s in shapes]
        slots: list[ParamSlot] = []
        shard, offset = 0, 0
        remaining = sum(sizes)  # values from the current parameter on
        for i, ((name, shape), size) in enumerate(zip(shapes, sizes, strict=True)):
            shards_left = num_shards - shard - 1
            if offset and shards_left:
                fair_share = (offset + remaining) / (shards_left + 1)
                # Start the next shard before this parameter if that ends the current one
                # nearer its fair share, or if every later shard needs one of the rest.
                overshoot = offset + size - fair_share > fair_share - offset
                if overshoot or len(shapes) - i == shards_left:
                    shard, offset = shard + 1, 0
            slots.append(ParamSlot(name, tuple(shape), shard, offset))
            offset += size
            remaining -= size
        return cls(tuple(slots), num_shards)

    @classmethod
    def from_module(cls, module: torch.nn.Module, num_shards: int) -> ParamLayout:
        """The layout of ``module``'s parameters."""
        return cls.from_shapes(
            [(n, tuple(p.shape)) for n, p in module.named_parameters()], num_shards
        )

    def slots_of(self, shard: int) -> tuple[ParamSlot, ...]:
        """The parameters of ``shard``, in order."""
        return tuple(s for s in self.slots if s.shard == shard)

    def shard_numel(self, shard: int) -> int:
        """Values in ``shard``'s flat buffer."""
        return sum(s.numel for s in self.slots_of(shard))

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> list[torch.Tensor]:
        """One flat float32 tensor per shard from named tensors (every name must be present)."""
        missing = [s.name for s in self.slots if s.name not in tensors]
        if missing:
            raise KeyError(f"missing parameters {missing}")
        return [
            torch.cat([tensors[s.name].detach().reshape(-1).to(torch.float32) for s in self.slots_of(k)])
            for k in range(self.num_shards)
        ]

    def unflatten(self, flats: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Named views into the per-shard flat tensors (no copy)."""
        if len(flats) != self.num_shards:
            raise ValueError(f"expected {self.num_shards} flat tensors, got {len(flats)}")
        return {
            s.name: flats[s.shard][s.offset : s.offset + s.numel].view(s.shape) for s in self.slots
        }

    def named_of(self, shard: int, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into one shard's flat tensor (for checkpoints keyed by name)."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.slots_of(shard)}

    def flatten_shard(self, shard: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """One shard's flat tensor from its named tensors."""
        return torch.cat(
            [tensors[s.name].reshape(-1).to(torch.float32) for s in self.slots_of(shard)]
        )
