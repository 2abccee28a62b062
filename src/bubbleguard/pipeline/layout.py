"""Where each rank sits in a pipeline-parallel x data-parallel job.

Ranks are laid out stage-fastest: ``rank = replica * num_stages + stage``. With torchrun's
node-major rank order, a replica's consecutive stages then share a node where possible, so the
frequent stage-to-stage traffic stays local and only gradient averaging crosses nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """A ``num_stages`` x ``num_replicas`` grid of ranks.

    Raises:
        ValueError: non-positive sizes.
    """

    num_stages: int
    num_replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {self.num_replicas}")

    @property
    def world_size(self) -> int:
        """Number of ranks the layout needs."""
        return self.num_stages * self.num_replicas

    def rank(self, stage: int, replica: int = 0) -> int:
        """Global rank of ``(stage, replica)``."""
        return replica * self.num_stages + stage

    def stage_of(self, rank: int) -> int:
        """Pipeline stage of a global rank."""
        return rank % self.num_stages

    def replica_of(self, rank: int) -> int:
        """Data-parallel replica of a global rank."""
        return rank // self.num_stages

    def replica_ranks(self, stage: int) -> list[int]:
        """The ranks holding ``stage`` in every replica: its gradient-averaging group."""
        return [self.rank(stage, d) for d in range(self.num_replicas)]
