"""Shared fixtures: one real Ray cluster on loopback for the whole test session, and small
configurations that keep each Ray test to a few seconds on two cores."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import pytest

from bubbleguard.ps.config import RunConfig, TrainingConfig
from bubbleguard.ps.job import PSJob
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


def train_on_until_recovered(job: PSJob, *, shard: int = 0, more_s: float = 3.0) -> None:
    """After a training window with a server kill: if ``shard`` has not recovered yet, wait for
    it and train ``more_s`` seconds more, so that the workers reach the replacement.

    A replacement can take seconds to start on a loaded machine (once 4.4 s after the kill; a
    worker's restart took over 7 s in CI), longer than a fixed window leaves. What the tests
    assert about the outage does not depend on when it ended.
    """
    if not any(e.kind == "recovered" and e.shard == shard for e in job.events):
        job.wait_for_event("recovered", since=job.t0 or 0.0, shard=shard, timeout_s=120.0)
        job.train(more_s)
