"""A parameter server on Ray that trains through failures.

Workers compute gradients on their shard of the data; servers hold the parameters (optionally
split by key range over several shards) and apply them under strict, bounded-stale or eventual
consistency. When a server dies, one of three strategies carries on: ``checkpoint`` (restart
and reload), ``chain`` (chain replication) or ``stateless`` (state outside the server; workers
keep computing and hand their gradients over when it returns). ``baseline`` is the same system
without fault tolerance.

Typical use::

    from bubbleguard.ps import FaultPlan, RayCluster, RunConfig, run_training

    config = RunConfig(strategy="chain", duration_s=30, faults=FaultPlan(num_kills=1, downtime_s=5))
    with RayCluster():
        result = run_training(config)
    print(result.metrics)

:class:`PSJob` gives step-by-step control (train, kill, inspect states); :func:`run_experiment`
compares strategies over seeds. Names are imported lazily, so ``import bubbleguard.ps`` (and the
CLI's parser) does not pull in torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from bubbleguard.ps.config import (
    ChainConfig,
    CheckpointConfig,
    ConsistencyConfig,
    ExperimentConfig,
    FaultPlan,
    ResourceConfig,
    RunConfig,
    StatelessConfig,
    TrainingConfig,
)

if TYPE_CHECKING:
    from bubbleguard.ps.core.metrics import RunMetrics
    from bubbleguard.ps.core.state import ShardState
    from bubbleguard.ps.experiment.experiment import (
        ExperimentConfig,
        ExperimentResult,
        run_experiment,
    )
    from bubbleguard.ps.experiment.runner import RunResult, run_training
    from bubbleguard.ps.job import PSJob
    from bubbleguard.ps.runtime.cluster import ClusterConfig, RayCluster
    from bubbleguard.ps.strategies import STRATEGY_CLASSES, ShardClient, Strategy
    from bubbleguard.ps.training.data import DataSplits, load_dataset, register_dataset
    from bubbleguard.ps.training.model import register_model

_LAZY = {
    "ClusterConfig": "bubbleguard.ps.runtime.cluster",
    "RayCluster": "bubbleguard.ps.runtime.cluster",
    "PSJob": "bubbleguard.ps.job",
    "RunResult": "bubbleguard.ps.experiment.runner",
    "run_training": "bubbleguard.ps.experiment.runner",
    "ExperimentResult": "bubbleguard.ps.experiment.experiment",
    "run_experiment": "bubbleguard.ps.experiment.experiment",
    "RunMetrics": "bubbleguard.ps.core.metrics",
    "ShardState": "bubbleguard.ps.core.state",
    "STRATEGY_CLASSES": "bubbleguard.ps.strategies",
    "ShardClient": "bubbleguard.ps.strategies",
    "Strategy": "bubbleguard.ps.strategies",
    "DataSplits": "bubbleguard.ps.training.data",
    "load_dataset": "bubbleguard.ps.training.data",
    "register_dataset": "bubbleguard.ps.training.data",
    "register_model": "bubbleguard.ps.training.model",
}


def __getattr__(name: str) -> Any:
    """Import the public names that need torch or Ray on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ChainConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConsistencyConfig",
    "DataSplits",
    "ExperimentConfig",
    "ExperimentResult",
    "FaultPlan",
    "PSJob",
    "RayCluster",
    "ResourceConfig",
    "RunConfig",
    "RunMetrics",
    "RunResult",
    "STRATEGY_CLASSES",
    "ShardClient",
    "ShardState",
    "StatelessConfig",
    "Strategy",
    "TrainingConfig",
    "load_dataset",
    "register_dataset",
    "register_model",
    "run_experiment",
    "run_training",
]
