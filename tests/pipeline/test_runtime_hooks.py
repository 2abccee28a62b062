"""The runtime's checkpoint hooks: call order, bubble work only when there is some, detaching."""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bubbleguard.elastic.forking import process_target
from bubbleguard.models import build_model, lm_loss
from bubbleguard.pipeline.runtime import PipelineJob
from bubbleguard.pipeline.schedules import ActionKind
from bubbleguard.pipeline.stage import split

NUM_STEPS = 4


class CountingHooks:
    """Hooks with ``budget`` units of bubble work per step; every call is logged, with the
    thread that made it and whether another call was still running (``overlaps``)."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.left = 0
        self.calls: list[str] = []
        self.finished: list[int] = []
        self.threads: dict[str, set[str]] = {}
        self.overlaps = 0
        self._inside = False
        # Scheduling policies of the helper thread: as run_one sees its own thread, and as the
        # training thread sees it at before_step (after the runtime paused it).
        self.helper_tid: int | None = None
        self.policy_in_run_one: set[int] = set()
        self.policy_at_before_step: set[int] = set()

    @contextlib.contextmanager
    def _call(self, name: str) -> Iterator[None]:
        self.overlaps += self._inside
        self._inside = True
        self.threads.setdefault(name, set()).add(
            "training" if threading.current_thread() is threading.main_thread() else "helper")
        try:
            yield
        finally:
            self._inside = False

    def has_work(self) -> bool:
        with self._call("has_work"):
            self.calls.append("has_work")
            return self.left > 0

    def run_one(self) -> bool:
        with self._call("run_one"):
            self.helper_tid = threading.get_native_id()
            self.policy_in_run_one.add(os.sched_getscheduler(0))
            time.sleep(0.001)  # a unit takes a while: a call overlapping it would show
            if self.left == 0:
                self.calls.append("run_one idle")  # asked once more after the last unit
                return False
            self.calls.append("run_one")
            self.left -= 1
            return True

    def before_step(self) -> None:
        with self._call("before_step"):
            self.calls.append("before_step")
            if self.helper_tid is not None:
                self.policy_at_before_step.add(os.sched_getscheduler(self.helper_tid))
            self.finished.append(self.left)  # the units the bubbles did not hold
            self.left = 0

    def after_step(self, step: int) -> None:
        with self._call("after_step"):
            self.calls.append(f"after_step {step}")
            self.left = self.budget  # a snapshot to copy during the next step


class LongUnitHooks(CountingHooks):
    """One unit of bubble work per step that outlasts any wait of this tiny pipeline."""

    UNIT_S = 0.3

    def __init__(self) -> None:
        super().__init__(1)

    def run_one(self) -> bool:
        if self.left:
            time.sleep(self.UNIT_S)
        return super().run_one()


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 256, (8, 16), generator=g), torch.randint(0, 256, (8,),
                                                                            generator=g))
               for _ in range(NUM_STEPS)]
    results = {}
    # No hooks, hooks without work, hooks with 3 units per step, one unit longer than a wait.
    for budget in (None, 0, 3, "long"):
        stage = split(build_model("mlp", seed=5), 2, rank)
        job = PipelineJob(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lm_loss,
                          schedule="1f1b", num_microbatches=4)
        hooks = (LongUnitHooks() if budget == "long" else
                 CountingHooks(budget) if budget is not None else None)
        if hooks is not None:
            job.attach_hooks(hooks)
        losses, stats = [], []
        for x, y in batches[:2]:
            losses.append(job.step(x, y))
            stats.append(dict(job.last_stats))
        calls_attached = list(hooks.calls) if hooks else []
        job.detach_hooks()
        plain_actions = [a.kind for a in job.actions]
        losses += [job.step(x, y) for x, y in batches[2:]]
        job.close()
        results[str(budget)] = {"losses": losses, "stats": stats, "calls": calls_attached,
                                "threads": {k: sorted(v) for k, v in hooks.threads.items()}
                                if hooks else {},
                                "overlaps": hooks.overlaps if hooks else 0,
                                "policies": (sorted(hooks.policy_in_run_one),
                                             sorted(hooks.policy_at_before_step))
                                if hooks else ([], []),
                                "finished": list(hooks.finished) if hooks else [],
                                "calls_after_detach": list(hooks.calls) if hooks else [],
                                "checkpoint_action_after_detach":
                                    ActionKind.CHECKPOINT in plain_actions}
    dist.barrier()
    dist.destroy_process_group()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def results() -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        method, target = process_target(_worker)
        mp.start_processes(target, args=(os.path.join(tmp, "store"), tmp), nprocs=2,
                           start_method=method)
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=True) for r in (0, 1)]


@pytest.mark.timeout(120)
def test_hooks_are_called_in_order_and_bubble_work_runs_only_while_there_is_some(
        results: list[dict]) -> None:
    for rank in (0, 1):
        for budget in (0, 3):
            calls = results[rank][str(budget)]["calls"]
            # Per step: queries at each receive, bubble work, then before_step and after_step.
            assert [c for c in calls if not c.startswith(("has_work", "run_one"))] == [
                "before_step", "after_step 1", "before_step", "after_step 2"]
            end1, end2 = calls.index("after_step 1"), calls.index("after_step 2")
            step1, step2 = calls[:end1], calls[end1 + 1:end2]
            # Step 1: no snapshot yet, so no work: every receive is waited on directly.
            assert step1 == ["has_work"] * 4 + ["before_step"]  # 1F1B, 2 stages, 4 receives
            # Step 2: has_work once per receive; each unit only after has_work said there was
            # work; the helper may ask once more after the last unit. How many of the 3 units
            # the waits hold depends on when the data lands (a wait can end before the helper
            # ran one); before_step does the rest: together exactly the 3.
            waits, last = step2[:-1], step2[-1]
            assert last == "before_step" and waits.count("has_work") == 4
            assert waits.count("run_one") + results[rank][str(budget)]["finished"][1] == budget
            assert waits.count("run_one idle") <= (1 if budget else 0)
            for i, c in enumerate(waits):
                if c.startswith("run_one"):
                    assert waits[i - 1] in ("has_work", "run_one")


@pytest.mark.timeout(120)
def test_overrun_is_the_time_bubble_work_held_the_stage_after_its_data_arrived(
        results: list[dict]) -> None:
    for rank in (0, 1):
        # Without bubble work the runtime waits directly: nothing overruns.
        for budget in ("None", "0"):
            assert [s["ckpt_overrun_s"] for s in results[rank][budget]["stats"]] == [0.0, 0.0]
        first, second = results[rank]["long"]["stats"]
        assert first["ckpt_overrun_s"] == 0.0  # no snapshot yet in step 1
        assert second["ckpt_bubble_s"] >= LongUnitHooks.UNIT_S
        # The overrun is the unit's tail after the data landed, never the whole wait. Slack:
        # the helper may start the unit just after the data landed, before the training
        # thread's pause reached it (seen: 0.1 ms over the unit's span).
        assert 0.0 < second["ckpt_overrun_s"] <= second["ckpt_bubble_s"] + 0.01
    # Step 2: the unit that starts first (on either stage) sits in a wait that the other stage
    # ends within milliseconds (a forward or backward of this tiny MLP) unless that stage is
    # itself held by its own unit after its data landed; so one of the two stages sat out most
    # of a unit. Which one depends on which helper started first (seen both ways).
    overruns = [results[r]["long"]["stats"][1]["ckpt_overrun_s"] for r in (0, 1)]
    assert max(overruns) > LongUnitHooks.UNIT_S / 2, overruns


@pytest.mark.timeout(120)
def test_detached_hooks_are_not_called_and_training_is_unchanged(results: list[dict]) -> None:
    for rank in (0, 1):
        for budget in ("0", "3"):
            r = results[rank][budget]
            assert r["calls_after_detach"] == r["calls"]  # no call after detach_hooks()
            assert not r["checkpoint_action_after_detach"]
        assert results[rank]["None"]["losses"] == results[rank]["3"]["losses"]
    assert all(isinstance(x, float) for x in results[1]["None"]["losses"])


@pytest.mark.timeout(120)
def test_bubble_work_runs_on_a_helper_thread_never_alongside_another_hook(
        results: list[dict]) -> None:
    for rank in (0, 1):
        r = results[rank]["3"]
        # run_one runs while the training thread blocks in the receive (if a wait lasted long
        # enough for the helper to start one); every other hook runs on the training thread;
        # no two calls ever overlapped.
        threads = dict(r["threads"])
        assert threads.pop("run_one", ["helper"]) == ["helper"]
        assert threads == {"has_work": ["training"], "before_step": ["training"],
                           "after_step": ["training"]}
        assert r["overlaps"] == 0 and results[rank]["0"]["overlaps"] == 0
    # Some unit did run inside a wait (rank 0 waits a whole stage-1 forward and backward for
    # its first gradient): a runtime that left every unit to before_step would fail here.
    assert any("run_one" in results[rank]["3"]["threads"] for rank in (0, 1))


@pytest.mark.timeout(120)
def test_the_helpers_python_code_never_runs_at_idle_priority(results: list[dict]) -> None:
    # Only the native copies lower the helper to SCHED_IDLE (with the GIL released; see
    # bubbleguard.yielding): Python code there holds the GIL, and at idle priority it could be
    # starved while the woken training thread waits for the GIL. So run_one (Python) always runs
    # at normal priority, and the helper is at normal priority whenever the training thread
    # waits for it or moves on.
    seen = 0
    for rank in (0, 1):
        during, after = results[rank]["3"]["policies"]
        if during:
            seen += 1
            assert during == [os.SCHED_OTHER], (rank, during)
            assert after == [os.SCHED_OTHER], (rank, after)
    assert seen >= 1  # some unit ran inside a wait (see the test above)


class FailingHooks(CountingHooks):
    """Bubble work that fails on its first unit."""

    def run_one(self) -> bool:
        raise OSError(28, "No space left on device", "/dev/shm/bubbleguard")


def _failing_worker(rank: int, store_path: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=5))
    stage = split(build_model("mlp", seed=5), 2, rank)
    job = PipelineJob(stage, torch.optim.SGD(stage.parameters(), lr=0.1), lm_loss,
                      schedule="1f1b", num_microbatches=4)
    job.attach_hooks(FailingHooks(1) if rank == 1 else CountingHooks(0))
    x, y = torch.randint(0, 256, (8, 16)), torch.randint(0, 256, (8,))
    job.step(x, y)
    if rank == 0:
        # Rank 1 then waits for step 2's first activation for sure, and runs bubble work in
        # that wait (on a loaded machine the data was sometimes there before it looked).
        time.sleep(0.5)
    outcome = "no error"
    try:
        job.step(x, y)
    except OSError as exc:
        outcome = f"OSError {exc.errno} {exc.strerror} {exc.filename}"
    except RuntimeError as exc:  # rank 0: its peer stopped sending; the receive timed out
        outcome = f"RuntimeError {type(exc).__name__}"
    job.close()
    torch.save({"outcome": outcome, "step_count": job.step_count},
               os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)  # rank 0's sends were never received: do not wait on them in a teardown


@pytest.mark.timeout(120)
def test_an_error_in_bubble_work_is_raised_by_step_on_the_training_thread(
        tmp_path: Path) -> None:
    method, target = process_target(_failing_worker)
    mp.start_processes(target, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method=method)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert r1 == {"outcome": "OSError 28 No space left on device /dev/shm/bubbleguard",
                  "step_count": 2}
    assert r0["outcome"].startswith("RuntimeError")
