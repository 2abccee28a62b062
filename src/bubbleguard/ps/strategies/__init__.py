"""Recovery strategies: what the system does when a parameter server dies.

Each strategy is a driver-side :class:`Strategy` (builds and supervises one shard's servers)
plus a worker-side :class:`ShardClient`; see :mod:`bubbleguard.ps.strategies.base` for the
call order. ``STRATEGY_CLASSES`` maps the configuration's names to them.
"""

from __future__ import annotations

from bubbleguard.ps.strategies.base import ShardClient, ShardContext, Strategy
from bubbleguard.ps.strategies.baseline import BaselineStrategy
from bubbleguard.ps.strategies.chain import ChainStrategy
from bubbleguard.ps.strategies.checkpoint import CheckpointStrategy
from bubbleguard.ps.strategies.stateless import StatelessStrategy

STRATEGY_CLASSES: dict[str, type[Strategy]] = {
    cls.name: cls for cls in (BaselineStrategy, CheckpointStrategy, ChainStrategy, StatelessStrategy)
}

__all__ = [
    "STRATEGY_CLASSES",
    "BaselineStrategy",
    "ChainStrategy",
    "CheckpointStrategy",
    "ShardClient",
    "ShardContext",
    "StatelessStrategy",
    "Strategy",
]
