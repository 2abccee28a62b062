"""Tests for the stateless strategy on a real Ray cluster: workers keep computing while the
server is dead, and every buffered gradient is applied exactly once when it is back."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bubbleguard.ps.config import FaultPlan, StatelessConfig
from bubbleguard.ps.core.messages import split_update_id
from bubbleguard.ps.core.metrics import busy_fraction, lost_update_ids, outages
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.training.data import DataSplits
from tests.ps.conftest import small_config, train_on_until_recovered

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

OUTAGE = FaultPlan(num_kills=1, downtime_s=2.0, kill_at_s=(1.5,))
DURATION_S = 8.0
"""Long enough for the replacement to be back before the deadline on a 2-core machine (CI once
saw it miss a 5 s run); where it is not, the run trains on until it is."""


def run_through_outage(tmp_path: Path, digits: DataSplits, stateless: StatelessConfig) -> PSJob:
    job = PSJob(small_config("stateless", num_workers=2, stateless=stateless), workdir=tmp_path, splits=digits)
    job.start()
    job.train(DURATION_S, faults=OUTAGE)
    # Every test below reads what happened after the server came back, and after the workers
    # handed it their backlogs.
    train_on_until_recovered(job)
    (outage,) = outages(job.events)
    assert outage.end is not None
    assert all(r.num_pending == 0 for r in job.reports.values()), job.reports
    return job


def test_every_buffered_gradient_is_applied_exactly_once(tmp_path: Path, digits: DataSplits) -> None:
    with run_through_outage(tmp_path, digits, StatelessConfig(policy="sum-scaled")) as job:
        final = job.server_states()[0]
        applied = Counter(final.applied_uids())
        computed = [r.uid for r in job.iterations]
        buffered = [r.uid for r in job.iterations if r.outcomes == ("buffered",)]
        assert len(buffered) > 20  # the outage was trained through
        assert max(applied.values()) == 1
        assert set(applied) == set(computed)  # count and identity
        assert not any(r.dropped_uids for r in job.reports.values())
        # Buffered gradients were acknowledged in hand-overs, and nothing acknowledged is lost.
        acked = {uid for a in job.acks for uid in a.uids}
        assert set(buffered) <= acked and lost_update_ids(job.acks, [final]) == set()
        # Workers computed through the outage.
        (outage,) = outages(job.events)
        assert outage.end is not None and outage.end - outage.start >= OUTAGE.downtime_s
        busy = busy_fraction(job.iterations, [(outage.start, outage.end)], 2)
        assert busy is not None and busy > 0.5


def test_backlog_past_the_cap_drops_the_oldest_as_documented(tmp_path: Path, digits: DataSplits) -> None:
    with run_through_outage(tmp_path, digits, StatelessConfig(buffer_cap=5, overflow="drop-oldest")) as job:
        final = job.server_states()[0]
        applied = Counter(final.applied_uids())
        dropped = {uid for r in job.reports.values() for uid in r.dropped_uids}
        computed = {r.uid for r in job.iterations}
        assert dropped and max(applied.values()) == 1
        assert set(applied) == computed - dropped and not dropped & set(applied)
        for worker in range(2):
            mine = sorted(r.uid for r in job.iterations if r.worker == worker and r.outcomes == ("buffered",))
            # Per worker, everything but the newest 5 buffered gradients was dropped, except the
            # first if its push had failed (that one is kept apart, sealed: it may be applied).
            dropped_here = {u for u in dropped if split_update_id(u)[0] == worker}
            assert dropped_here in (set(mine[:-5]), set(mine[1:-5]))


def test_backlog_past_the_cap_coalesces_without_losing_a_gradient(tmp_path: Path, digits: DataSplits) -> None:
    config = StatelessConfig(buffer_cap=3, overflow="coalesce", policy="staleness-weighted")
    with run_through_outage(tmp_path, digits, config) as job:
        final = job.server_states()[0]
        applied = Counter(final.applied_uids())
        assert max(applied.values()) == 1
        assert set(applied) == {r.uid for r in job.iterations}
        # Each worker's backlog went in as one step: many gradients share a step version.
        per_step = Counter(final.log[:, 2].tolist())
        assert max(per_step.values()) > 3
