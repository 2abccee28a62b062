"""Tests for chain replication on a real Ray cluster: SIGKILL the head or a middle node, and
check the surviving chain against exactly what was acknowledged."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbleguard.ps.config import ChainConfig, FaultPlan
from bubbleguard.ps.core.metrics import lost_update_ids
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.strategies.chain import ChainStrategy
from bubbleguard.ps.training.data import DataSplits
from tests.ps.conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def chain_of(job: PSJob) -> ChainStrategy:
    strategy = job.strategies[0]
    assert isinstance(strategy, ChainStrategy)
    return strategy


def test_after_head_failover_the_parameters_equal_the_last_acknowledged_state(tmp_path: Path, digits: DataSplits) -> None:
    with PSJob(small_config("chain", num_workers=2), workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(1.5)
        last_ack = max(job.acks, key=lambda a: a.state_version)
        old = chain_of(job).view
        before = job.node_states()
        assert all(s.equals(before[old.tail]) for s in before.values())  # per-update: identical replicas
        assert before[old.tail].digest() == last_ack.state_digest
        assert before[old.tail].version == last_ack.state_version

        kill = job.kill("server", downtime_s=0.5)
        job.wait_for_event("recovered", since=kill.time)
        new = chain_of(job).view
        assert new.head == old.nodes[1] and old.head not in new.nodes
        after = job.node_states()
        assert after[new.head].equals(before[old.tail])

        # The replacement joins at the tail with a state transfer.
        job.wait_for_event("rejoined", since=kill.time)
        full = job.node_states()
        assert len(full) == 3 and chain_of(job).view.tail not in old.nodes
        assert all(s.equals(before[old.tail]) for s in full.values())


def test_head_killed_mid_training_loses_no_acknowledged_update(tmp_path: Path, digits: DataSplits) -> None:
    with PSJob(small_config("chain"), workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(5.0, faults=FaultPlan(num_kills=1, downtime_s=1.0, kill_at_s=(1.5,)))
        job.wait_until_serving(full=True)
        final = job.node_states()
        tail = final[chain_of(job).view.tail]
        assert lost_update_ids(job.acks, [tail]) == set()
        assert all(s.equals(tail) for s in final.values())
        last_ack = max(job.acks, key=lambda a: a.state_version)
        assert (tail.version, tail.digest()) == (last_ack.state_version, last_ack.state_digest)
        uids = tail.applied_uids()
        assert len(uids) == len(set(uids))
        kinds = [e.kind for e in sorted(job.events, key=lambda e: e.time)]
        assert kinds == ["kill", "recovered", "rejoined"]


def test_a_failed_middle_node_is_repaired_without_loss(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("chain", num_workers=2, chain=ChainConfig(length=3))
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        old = chain_of(job).view
        job.train(4.0, faults=FaultPlan(num_kills=1, downtime_s=0.5, kill_at_s=(1.0,), target="middle"))
        job.wait_until_serving(full=True)
        view = chain_of(job).view
        assert view.nodes[:2] == (old.head, old.tail) and old.nodes[1] not in view.nodes
        final = job.node_states()
        assert all(s.equals(final[view.tail]) for s in final.values())
        assert lost_update_ids(job.acks, [final[view.tail]]) == set()


def test_periodic_replication_loses_exactly_the_updates_after_the_last_copy(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("chain", num_workers=2, chain=ChainConfig(length=2, replicate_every=25))
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(1.5)
        old = chain_of(job).view
        head = job.node_states()[old.head]
        copied = head.version - head.version % 25

        kill = job.kill("server", downtime_s=0.5)
        job.wait_for_event("recovered", since=kill.time)
        successor = job.node_states()[old.tail]
        assert successor.version == copied
        assert successor.applied_uids() == head.applied_uids()[:copied]
        lost = lost_update_ids(job.acks, [successor])
        assert lost == set(head.applied_uids()[copied:])
