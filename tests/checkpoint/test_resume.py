"""Resume from the memory tier after the training process is SIGKILLed: bit-identical losses."""

from __future__ import annotations

import multiprocessing
import signal
from pathlib import Path

import pytest

from bubbleguard.checkpoint.state import restore_state
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from bubbleguard.elastic.forking import process_target
from tests.checkpoint.ckpt_testlib import (
    make_training,
    seed_all,
    train_step,
    train_with_snapshots_then_die,
)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_killed_run_resumes_with_identical_losses(tmp_path: Path) -> None:
    seed_all(0)
    model, opt, sched = make_training()
    uninterrupted = [train_step(model, opt, sched, s) for s in range(1, 9)]

    method, target = process_target(train_with_snapshots_then_die)
    child = multiprocessing.get_context(method).Process(target=target, args=(str(tmp_path), 6))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL

    # killed in iteration 6 while copying step 5: step 4 is the newest complete snapshot
    tier = MemoryTier("resume", 0, root=tmp_path, create=False)
    assert tier.steps() == [4]
    seed_all(1234)
    model2, opt2, sched2 = make_training(seed=77)
    result = restore_state(tier.read_latest(), model2, opt2, sched2)
    assert result.step == 4 and result.data_cursor == {"batch": 4}
    resumed = [train_step(model2, opt2, sched2, s) for s in range(result.step + 1, 9)]
    assert resumed == uninterrupted[4:]
