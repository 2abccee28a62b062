"""Parameters split over two shards: a kill of one shard's server leaves the other serving, and
every gradient still lands exactly once on each shard."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from bubbleguard.ps.config import FaultPlan
from bubbleguard.ps.core.metrics import lost_update_ids
from bubbleguard.ps.job import PSJob
from bubbleguard.ps.training.data import DataSplits
from tests.ps.conftest import small_config, train_on_until_recovered

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_killing_one_shard_buffers_only_its_gradients(tmp_path: Path, digits: DataSplits) -> None:
    config = small_config("stateless", num_workers=2, num_shards=2)
    with PSJob(config, workdir=tmp_path, splits=digits) as job:
        job.start()
        job.train(8.0, faults=FaultPlan(num_kills=1, downtime_s=1.5, kill_at_s=(1.0,), shard=1))
        train_on_until_recovered(job, shard=1)  # and the workers hand it their backlog
        recovered = [e for e in job.events if e.kind == "recovered"]
        assert [e.shard for e in recovered] == [1]
        states = job.server_states()
        assert [s.shard for s in states] == [0, 1]
        assert sum(s.params.numel() for s in states) == sum(p.numel() for p in job._eval_model.module.parameters())
        computed = {r.uid for r in job.iterations}
        for state in states:
            applied = Counter(state.applied_uids())
            assert max(applied.values()) == 1 and set(applied) == computed
        # Shard 0 kept acknowledging while shard 1 was down: its gradients were never buffered.
        outcomes = Counter(r.outcomes for r in job.iterations)
        assert outcomes[("acked", "buffered")] > 0 and outcomes[("buffered", "buffered")] == 0
        assert lost_update_ids(job.acks, states) == set()
        # The served model is assembled from both shards.
        assert torch.equal(job.layout.unflatten([s.params for s in states])["fc2.bias"], states[1].params[-10:])
