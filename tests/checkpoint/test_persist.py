"""Tests for checkpoint/persist.py: background persist on its own gloo group."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from tests.checkpoint.ckpt_testlib import (
    STAGES_OF_2,
    assert_same_tensors,
    persist_worker,
    run_ranks,
)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_background_persist_of_two_stages(tmp_path: Path) -> None:
    run_ranks(persist_worker, 2, str(tmp_path), str(tmp_path))
    durable = DurableTier(tmp_path / "durable")
    assert [(i.step, i.committed) for i in durable.checkpoints()] == [
        (4, True),
        (6, True),
    ]  # keep_last=2
    whole = durable.read(6)
    assert whole.metadata["data_cursor"] == {"batch": 6}
    expected = {}
    for rank in STAGES_OF_2:
        snap = MemoryTier("persist", rank, num_ranks=2, root=tmp_path / "shm", create=False).read(6)
        expected.update(snap.tensors)
        if rank == 0:
            assert_same_tensors(
                dict(durable.read(6, rank=0).local_tensors), dict(snap.local_tensors)
            )
    assert_same_tensors(dict(whole.tensors), expected)


def test_single_process_persist_and_missing_step(tmp_path: Path) -> None:
    from bubbleguard.checkpoint.persist import BackgroundPersister, cpu_bandwidth
    from tests.checkpoint.ckpt_testlib import trained_state

    *_, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024)
    memory.write(state)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    persister.submit(1)
    persister.submit(5)  # not in the memory tier: reported, not fatal
    results = persister.close(timeout_s=30)
    assert [(r.step, r.persisted) for r in results] == [(1, True), (5, False)]
    assert "no complete snapshot of step 5" in (results[1].error or "")
    # The helper's CPU time, where it wrote: the planner prices a persist by it, not by the
    # seconds it took (the helper runs only in idle CPU time).
    assert results[0].cpu_s > 0 and results[1].cpu_s == 0
    assert cpu_bandwidth(results) == results[0].num_bytes / results[0].cpu_s
    assert cpu_bandwidth(results[1:]) is None
    assert DurableTier(tmp_path / "d").latest() == 1
    memory.cleanup()


def test_what_the_helper_persists_loads_with_plain_dcp(tmp_path: Path) -> None:
    # The helper writes without torch.save's zip CRC32s (no reader checks them); plain DCP
    # readers must still read every tensor back exactly.
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from bubbleguard.checkpoint.persist import BackgroundPersister
    from tests.checkpoint.ckpt_testlib import trained_state

    model, _, _, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024)
    memory.write(state)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    persister.submit(1)
    assert [r.persisted for r in persister.close(timeout_s=60)] == [True]
    step_dir = tmp_path / "d" / "step-00000001"
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(step_dir))
    assert_same_tensors(sd, dict(model.state_dict()))
    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert_same_tensors(whole, {k: v.clone() for k, v in state.tensors.items()})
    memory.cleanup()


def test_the_slot_stays_pinned_until_the_helper_has_written_it(tmp_path: Path) -> None:
    # The helper saves straight from the shared memory: while it writes step 1, the rank
    # snapshots steps 2..6 as fast as it can; none may land in step 1's slot before the save
    # is done, or the durable step 1 would mix in later bytes.
    from bubbleguard.checkpoint.persist import BackgroundPersister
    from bubbleguard.checkpoint.state import StageState
    from tests.checkpoint.ckpt_testlib import trained_state

    *_, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024, num_slots=3)
    memory.write(state)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    persister.submit(1)
    for step in range(2, 7):
        later = {k: v + step if v.is_floating_point() else v.clone()
                 for k, v in state.tensors.items()}
        memory.write(StageState(step=step, tensors=later, metadata=dict(state.metadata)))
    results = persister.close(timeout_s=60)
    assert [(r.step, r.persisted) for r in results] == [(1, True)]
    assert_same_tensors(dict(DurableTier(tmp_path / "d").read(1).tensors), dict(state.tensors))
    assert memory.steps()[0] == 6  # the rank never waited for the persist
    memory.cleanup()


def test_the_helper_sees_every_slot_of_its_rank(tmp_path: Path) -> None:
    # The helper opens the tier before the rank has made any slot file: it must still look
    # in all three (it once looked in two, and every persist of a third-slot step failed).
    from bubbleguard.checkpoint.persist import BackgroundPersister
    from bubbleguard.checkpoint.state import StageState
    from tests.checkpoint.ckpt_testlib import trained_state

    *_, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024, num_slots=3)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d", keep_last=3))
    persister.submit(0)  # not there: once it is answered, the helper has opened its tier
    persister.wait(timeout_s=60)
    for step in (1, 2, 3):
        memory.write(StageState(step=step, tensors=state.tensors, metadata=dict(state.metadata)))
        persister.submit(step)
    results = persister.close(timeout_s=60)
    assert [(r.step, r.persisted, r.error) for r in results[1:]] == [
        (1, True, None), (2, True, None), (3, True, None)]
    memory.cleanup()


def test_a_persist_submitted_while_one_is_in_flight_is_skipped_and_the_rank_never_waits(
        tmp_path: Path) -> None:
    # With skip_while_busy (what the bubble checkpointer uses), at most one slot is pinned: a
    # helper starved of CPU time can never leave a three-slot tier without a slot to write.
    from bubbleguard.checkpoint.persist import BackgroundPersister
    from bubbleguard.checkpoint.state import StageState
    from tests.checkpoint.ckpt_testlib import trained_state

    *_, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024, num_slots=3)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"), skip_while_busy=True)
    for step in range(1, 9):
        later = {k: v + step if v.is_floating_point() else v.clone()
                 for k, v in state.tensors.items()}
        memory.write(StageState(step=step, tensors=later, metadata=dict(state.metadata)))
        if step in (1, 2):
            persister.submit(step)  # 2 arrives while the helper (still starting) holds 1
    assert memory.steps()[0] == 8  # every write found a slot at once
    results = persister.close(timeout_s=60)
    assert [(r.step, r.persisted) for r in results] == [(1, True), (2, False)]
    assert results[1].error == ("skipped on rank 0: the persist of step 1 still holds its snapshot "
                                "(the helper runs on idle CPU time)")
    assert DurableTier(tmp_path / "d").latest() == 1
    assert_same_tensors(dict(DurableTier(tmp_path / "d").read(1).tensors),
                        {k: v + 1 if v.is_floating_point() else v
                         for k, v in state.tensors.items()})
    memory.cleanup()


def _proc_state_and_cpu(pid: int) -> tuple[str, int]:
    """(state letter, utime + stime in ticks) of ``pid`` from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return fields[0], int(fields[11]) + int(fields[12])


def _wait_for_state(pid: int, want: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while _proc_state_and_cpu(pid)[0] != want:
        assert time.monotonic() < deadline, f"helper {pid} never reached state {want}"
        time.sleep(0.01)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_helper_is_stopped_between_persists_and_continued_for_each(tmp_path: Path) -> None:
    # An idle helper would keep its gloo thread waking every 10 ms on the rank's core: it is
    # stopped (state T, no CPU time) once ready and after each persist, and every persist
    # submitted later is still written.
    from bubbleguard.checkpoint.persist import BackgroundPersister
    from bubbleguard.checkpoint.state import StageState
    from tests.checkpoint.ckpt_testlib import trained_state

    *_, state = trained_state(1)
    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024, num_slots=3)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d", keep_last=3))
    pid = persister._proc.pid
    _wait_for_state(pid, "T", 60)  # ready, nothing submitted yet
    for step in (1, 2, 3):
        memory.write(StageState(step=step, tensors={k: v + step if v.is_floating_point() else v
                                                    for k, v in state.tensors.items()},
                                metadata=dict(state.metadata)))
        persister.submit(step)
        assert [(r.step, r.persisted) for r in persister.wait(timeout_s=60)][-1] == (step, True)
        _wait_for_state(pid, "T", 10)
        cpu = _proc_state_and_cpu(pid)[1]
        time.sleep(0.3)
        assert _proc_state_and_cpu(pid) == ("T", cpu)  # stopped: not a tick of CPU meanwhile
    results = persister.close(timeout_s=60)  # continues the stopped helper to stop it
    assert [(r.step, r.persisted) for r in results] == [(1, True), (2, True), (3, True)]
    assert persister._proc.returncode == 0
    assert [i.step for i in DurableTier(tmp_path / "d").checkpoints() if i.committed] == [1, 2, 3]
    memory.cleanup()


_ORPHAN_JOB = """
import sys, time
from pathlib import Path
from bubbleguard.checkpoint.persist import BackgroundPersister
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier
from tests.checkpoint.ckpt_testlib import trained_state

tmp = Path(sys.argv[1])
*_, state = trained_state(1)
memory = MemoryTier("orphan", 0, root=tmp, chunk_bytes=1024)
memory.write(state)
persister = BackgroundPersister(memory, DurableTier(tmp / "d"))
pid = persister._proc.pid
while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
    time.sleep(0.01)
(tmp / "helper_stopped").write_text(str(pid))
while not (tmp / "go").exists():  # the shell that started this job has exited meanwhile
    time.sleep(0.01)
persister.submit(1)
print([(r.step, r.persisted) for r in persister.close(timeout_s=60)], flush=True)
memory.cleanup()
"""


@pytest.mark.timeout(120)
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_stopped_helper_does_not_get_the_job_hung_up_when_its_shell_exits(
        tmp_path: Path) -> None:
    # A job put in the background by a shell with job control (its own process group), the
    # shell then exiting: the job's group is orphaned. Had the stopped helper been in that
    # group, the kernel would send SIGHUP to the group and end the job (seen in a benchmark
    # run); the helper has a process group of its own, so the job goes on and persists.
    import subprocess
    import sys

    script = tmp_path / "job.py"
    script.write_text(_ORPHAN_JOB)
    out = tmp_path / "out.txt"
    repo = Path(__file__).resolve().parents[2]
    shell = subprocess.Popen(
        ["bash", "-c", f'set -m; "{sys.executable}" "{script}" "{tmp_path}" > "{out}" 2>&1 & '
                       f'while [ ! -e "{tmp_path}/helper_stopped" ] && kill -0 $!; do sleep 0.05; '
                       'done; exit 0'],
        cwd=repo, start_new_session=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(repo), os.environ.get("PYTHONPATH")) if p)})
    assert shell.wait(timeout=90) == 0  # the job's group is now orphaned, its helper stopped
    assert (tmp_path / "helper_stopped").exists(), out.read_text()
    (tmp_path / "go").touch()
    deadline = time.monotonic() + 60
    while "[(1, True)]" not in (out.read_text() if out.exists() else ""):
        assert time.monotonic() < deadline, out.read_text() if out.exists() else "no output"
        time.sleep(0.05)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not Path("/proc/self/maps").exists(),
                    reason="Linux scheduling and /proc")
def test_the_helper_is_at_idle_priority_before_it_loads_torch(tmp_path: Path) -> None:
    # Its start-up (importing torch) is seconds of CPU on the rank's core: it must already run
    # at SCHED_IDLE then. The first time the helper is seen at SCHED_IDLE (policy 5, field 41 of
    # /proc/PID/stat), libtorch must not be mapped yet.
    from bubbleguard.checkpoint.persist import BackgroundPersister

    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    pid = persister._proc.pid
    deadline = time.monotonic() + 60
    while True:
        with open(f"/proc/{pid}/stat") as f:
            policy = int(f.read().rsplit(")", 1)[1].split()[38])
        if policy == os.SCHED_IDLE:
            with open(f"/proc/{pid}/maps") as f:
                maps = f.read()
            break
        assert time.monotonic() < deadline, "the helper never reached SCHED_IDLE"
        time.sleep(0.001)
    assert "libtorch" not in maps
    assert persister.close(timeout_s=60) == []
    memory.cleanup()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_the_helper_has_its_own_process_group_but_the_ranks_session(tmp_path: Path) -> None:
    # Its own group keeps a stopped helper from getting the ranks' group hung up; the rank's
    # session keeps it in the rank's autogroup, where SCHED_IDLE ranks it below the training
    # threads (in a session of its own it competed with them as an equal group).
    from bubbleguard.checkpoint.persist import BackgroundPersister

    memory = MemoryTier("g", 0, root=tmp_path, chunk_bytes=1024)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    pid = persister._proc.pid
    try:
        deadline = time.monotonic() + 60
        while os.getpgid(pid) != pid:
            assert time.monotonic() < deadline, "the helper never left the rank's group"
            time.sleep(0.01)
        assert os.getsid(pid) == os.getsid(0)
        # With CONFIG_SCHED_AUTOGROUP the file names the task's autogroup; it reads empty where
        # the task sits in a cgroup of its own instead (containers), and then autogroups do not
        # apply and the session check above is all there is to test.
        helper = Path(f"/proc/{pid}/autogroup")
        own = Path("/proc/self/autogroup")
        if helper.exists() and own.exists() and own.read_text().strip():
            assert helper.read_text().split()[0] == own.read_text().split()[0]
    finally:
        assert persister.close(timeout_s=60) == []
        memory.cleanup()


@pytest.mark.timeout(120)
def test_wait_ready_returns_once_the_helper_is_up_and_names_a_helper_that_died(
        tmp_path: Path) -> None:
    import shutil

    from bubbleguard.checkpoint.persist import BackgroundPersister, PersistHelperError

    memory = MemoryTier("p", 0, root=tmp_path, chunk_bytes=1024)
    persister = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    assert not persister.ready  # it has only just been started
    persister.wait_ready(timeout_s=60)
    assert persister.ready
    assert persister.close(timeout_s=30) == []

    # A helper that cannot open the memory tier (its directory is gone) fails at start-up:
    # wait_ready says so instead of training on without a durable tier.
    shutil.rmtree(memory.job_dir)
    broken = BackgroundPersister(memory, DurableTier(tmp_path / "d"))
    with pytest.raises(PersistHelperError, match="persist helper failed"):
        broken.wait_ready(timeout_s=60)
    assert not broken.ready
    with pytest.raises(PersistHelperError):
        broken.close(timeout_s=30)
