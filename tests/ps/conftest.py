"""Shared fixtures: one real Ray cluster on loopback for the whole test session, and small
configurations that keep each Ray test to a few seconds on two cores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from bubbleguard.ps.config import RunConfig, TrainingConfig
from bubbleguard.ps.training.data import DataSplits, load_dataset


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """A local Ray cluster bound to 127.0.0.1, shared by every test that asks for it."""
    from bubbleguard.ps.runtime.cluster import ClusterConfig, RayCluster

    with RayCluster(ClusterConfig(num_cpus=2)):
        yield


@pytest.fixture(scope="session")
def digits() -> DataSplits:
    """The digits data set, loaded once."""
    return load_dataset("digits", 0)


def small_config(strategy: str, *, num_workers: int = 3, **overrides: Any) -> RunConfig:
    """A short run with few workers; ``overrides`` replace fields of :class:`RunConfig`."""
    config = RunConfig(
        strategy=strategy,  # type: ignore[arg-type]
        training=TrainingConfig(num_workers=num_workers, seed=0),
        duration_s=4.0,
        eval_every_s=0.25,
    )
    return replace(config, **overrides)
