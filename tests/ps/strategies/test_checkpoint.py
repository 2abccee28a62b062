"""Tests for the checkpoint strategy on a real Ray cluster: SIGKILL the server, Ray restarts
it, and it resumes from exactly the last committed checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from bubbleguard.ps.checkpointing import committed_checkpoints, latest_checkpoint, load_checkpoint
from bubbleguard.ps.config import CheckpointConfig, FaultPlan
from bubbleguard.ps.core.metrics import lost_update_ids
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.training.data import DataSplits
from tests.ps.conftest import small_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_restart_reloads_exactly_the_last_committed_checkpoint(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("checkpoint", checkpoint=CheckpointConfig(every=20))
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(2.0)
        before = job.server_states()[0]
        info = latest_checkpoint(tmp_path / "checkpoints" / job.run_id, 0)
        assert info is not None and info.version == before.version - before.version % 20
        expected = load_checkpoint(info, job.layout)

        kill = job.kill("server", downtime_s=0.5)
        job.wait_for_event("recovered", since=kill.time)
        after = job.server_states()[0]

        assert after.equals(expected)
        assert job.strategies[0].identity.started_from == f"checkpoint:{info.seq}"
        assert job.strategies[0].identity.incarnation == 1
        # Exactly the updates acknowledged after the checkpoint are lost.
        lost = lost_update_ids(job.acks, [after])
        assert lost == set(before.applied_uids()) - set(expected.applied_uids())
        assert len(lost) == before.num_applied - expected.num_applied


def test_workers_wait_out_the_outage_and_only_pre_kill_updates_are_lost(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("checkpoint", checkpoint=CheckpointConfig(every=20, keep=10_000))
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(6.0, faults=FaultPlan(num_kills=1, downtime_s=1.5, kill_at_s=(2.0,)))
        kill = next(e for e in job.events if e.kind == "kill")
        recovered = next(e for e in job.events if e.kind == "recovered")
        assert recovered.time - kill.time >= 1.5
        final = job.server_states()[0]

        # The restarted server started from the checkpoint it names, bit for bit.
        identity = job.strategies[0].identity
        seq = int(identity.started_from.split(":")[1])
        restored = next(i for i in committed_checkpoints(tmp_path / "checkpoints" / job.run_id, 0) if i.seq == seq)
        assert identity.start_digest == load_checkpoint(restored, job.layout).digest()
        assert identity.start_version == restored.version

        # Workers wait: none computes more than the one gradient it had started on.
        for worker in range(config.training.num_workers):
            inside = [
                r for r in job.iterations
                if r.worker == worker and kill.time < r.t_compute_start and r.t_compute_end < recovered.time
            ]
            assert len(inside) <= 1

        # Lost: exactly the acknowledged updates the restored checkpoint lacks. All of them were
        # acknowledged by the killed process (a reply may land a moment after the kill), none
        # by the restarted one.
        lost = lost_update_ids(job.acks, [final])
        acked_at = {uid: a.time for a in job.acks for uid in a.uids}
        assert lost == set(acked_at) - set(final.applied_uids())
        assert all(acked_at[uid] < recovered.time for uid in lost)
        assert not lost & set(restored_ids := load_checkpoint(restored, job.layout).applied_uids())
        assert set(restored_ids) <= set(final.applied_uids())
        assert len(final.applied_uids()) == len(set(final.applied_uids()))
        assert final.num_applied > restored.num_applied  # training went on after the restart


def test_checkpoint_directory_is_per_run(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("checkpoint", checkpoint=CheckpointConfig(every=5, directory=str(tmp_path / "shared")))
    with PSJob(replace(config), workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(1.0)
        assert committed_checkpoints(tmp_path / "shared" / job.run_id, 0)
