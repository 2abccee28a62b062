"""Stale-synchronous parallel on a real Ray cluster: with a straggler, no worker ever runs more
than the bound ahead of the slowest, judged from the workers' own timestamps."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbleguard.ps.config import ConsistencyConfig, TrainingConfig
from bubbleguard.ps.core.consistency import clock_leads
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.training.data import DataSplits
from tests.ps.conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STRAGGLER = TrainingConfig(num_workers=3, worker_delay_s=(0.03, 0.0, 0.0))


@pytest.mark.parametrize(
    ("consistency", "bound"),
    [(ConsistencyConfig("bounded", 2), 2), (ConsistencyConfig("strict"), 0)],
)
def test_no_worker_runs_more_than_the_bound_ahead(
    tmp_path: Path, digits: DataSplits, consistency: ConsistencyConfig, bound: int
) -> None:
    config = small_config("baseline", training=STRAGGLER, consistency=consistency)
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(2.5)
        leads = clock_leads(job.iterations, 3)
        assert len(leads) > 60
        assert max(leads) == bound  # never more, and the fast workers did reach it
        clocks = job.clocks()
        assert max(clocks) - min(clocks) <= bound + 1


def test_eventual_consistency_lets_the_fast_workers_run_ahead(tmp_path: Path, digits: DataSplits) -> None:
    # The same straggler without a bound: the check above would fail here.
    config = small_config("baseline", training=STRAGGLER, consistency=ConsistencyConfig("eventual"))
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(2.5)
        assert max(clock_leads(job.iterations, 3)) > 10
        final = job.server_states()[0]
        staleness = (final.log[:, 2] - final.log[:, 1]).tolist()
        assert min(staleness) >= 0 and max(staleness) >= 1
