"""The launcher names the rank that caused a failure, not only the first one torchrun noticed."""

from __future__ import annotations

import atexit
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from bubbleguard.elastic import forking
from bubbleguard.elastic.launcher import LaunchError, RankError, describe_failure, launch_local

PEER_GONE = ("RuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:4242. "
             "This is typically caused by a remote worker crashing.")


def _slow_to_exit(hold_s: float) -> None:
    dist.destroy_process_group()  # rank 0 sees its peer go away now...
    time.sleep(hold_s)  # ...while this process is still alive, so torchrun notices rank 0 first


def _rank_one_fails_and_exits_slowly(hold_s: float) -> int:
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        atexit.register(_slow_to_exit, hold_s)
        raise ValueError("checkpoint of step 2 does not match: 24 missing tensor(s) ['blocks.4.x']")
    dist.recv(torch.zeros(1), src=1)  # fails when rank 1's connection closes
    return 0


@pytest.mark.timeout(120)
def test_the_root_cause_is_named_first_although_its_rank_exits_last() -> None:
    with pytest.raises(LaunchError) as info:
        launch_local(_rank_one_fails_and_exits_slowly, (3.0,), 2)
    # torchrun reports only the first failed process it notices: rank 0, whose process ended
    # while rank 1's was still in its exit. Rank 1's own error is still named, and first.
    cause = info.value.__cause__
    assert sorted(cause.failures) == [0], cause.failures  # type: ignore[union-attr]
    message = str(info.value)
    assert message.startswith("training failed: rank 1: ValueError: checkpoint of step 2 does "
                              "not match: 24 missing tensor(s) ['blocks.4.x']; rank 0: "
                              "RuntimeError: "), message
    assert message.endswith("(a consequence: its peer went away)"), message


def test_errors_other_than_a_lost_peer_come_first_oldest_first() -> None:
    recorded = {0: RankError(0, 10.0, PEER_GONE),
                2: RankError(2, 12.0, "OSError: [Errno 28] No space left on device"),
                3: RankError(3, 11.0, "StateMismatchError: 2 missing tensor(s)")}
    agent = {1: RankError(1, 13.0, "Signal 9 (SIGKILL) received by PID 77"),
             0: RankError(0, 9.0, "To enable traceback see: https://pytorch.org")}
    assert describe_failure(recorded, agent) == (
        "training failed: rank 3: StateMismatchError: 2 missing tensor(s); "
        "rank 2: OSError: [Errno 28] No space left on device; "
        "rank 1: Signal 9 (SIGKILL) received by PID 77; "
        f"rank 0: {PEER_GONE} (a consequence: its peer went away)")


def test_only_lost_peers_says_that_a_peer_may_have_been_killed() -> None:
    # A rank killed by SIGKILL writes nothing; if torchrun noticed its peer first, the peer's
    # broken connection is all there is, and the message says what it suggests.
    assert describe_failure({0: RankError(0, 1.0, PEER_GONE)}, {}) == (
        f"training failed: rank 0: {PEER_GONE}; no rank recorded an error of its own: a peer "
        "may have been killed (by a signal, or by the out-of-memory killer)")


def test_a_rank_that_fails_alone_is_reported_with_its_error_text() -> None:
    with pytest.raises(LaunchError, match=r"^training failed: rank 0: KeyError: 'no such step'$"):
        launch_local(_raise_on_rank_zero, (), 1)


def _raise_on_rank_zero() -> None:
    if os.environ["RANK"] == "0":
        raise KeyError("no such step")


def test_launches_leave_nothing_in_the_temporary_directory(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchrun's log directory (made on every launch) and torch's per-rank traceback files
    (made when a rank raises, never deleted by torch) go when the launch ends."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where the launching process makes them
    assert launch_local(_report, ("clean",), 2)[1]["rank"] == "1"
    assert _left_in(scratch) == []
    with pytest.raises(LaunchError, match="KeyError: 'no such step'"):
        launch_local(_raise_on_rank_zero, (), 2, max_restarts=1)  # two attempts fail
    assert _left_in(scratch) == []


def _left_in(directory: Any) -> list[str]:
    # Not the launch's: multiprocessing's directory (the fork server's socket, if this test
    # started the server; removed when the test process exits) and torch's compile cache (one
    # per user, made when torch's log formatter first imports torch._dynamo, to log a failure).
    return sorted(p.name for p in directory.iterdir()
                  if not p.name.startswith(("pymp-", "torchinductor_")))


def _report(tag: str) -> dict[str, Any]:
    rank = os.environ["RANK"]
    print(f"rank {rank} of the {tag} launch writes to the launcher's stderr", file=sys.stderr,
          flush=True)
    return {"rank": rank, "tag": os.environ.get("BG_TEST_TAG"),
            "stale": os.environ.get("BG_TEST_STALE"), "threads": torch.get_num_threads(),
            "parent": os.getppid()}


@pytest.mark.timeout(120)
def test_forked_ranks_see_the_environment_and_stderr_of_their_launch(
        capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ranks fork from one server, started once per process with the environment of its first
    launch; each launch's ranks still get that launch's variables, thread count and stderr."""
    monkeypatch.setenv("BG_TEST_TAG", "first")
    monkeypatch.setenv("BG_TEST_STALE", "set for the first launch only")
    first = launch_local(_report, ("first",), 2)
    monkeypatch.setenv("BG_TEST_TAG", "second")
    monkeypatch.delenv("BG_TEST_STALE")
    second = launch_local(_report, ("second",), 2, threads_per_rank=2)
    assert first == {r: {"rank": str(r), "tag": "first", "stale": "set for the first launch only",
                         "threads": 1, "parent": first[0]["parent"]} for r in (0, 1)}
    assert second == {r: {"rank": str(r), "tag": "second", "stale": None, "threads": 2,
                          "parent": first[0]["parent"]} for r in (0, 1)}
    assert forking._server is not None and first[0]["parent"] == forking._server[0]
    err = capfd.readouterr().err
    for tag in ("first", "second"):
        for rank in (0, 1):
            assert f"rank {rank} of the {tag} launch writes to the launcher's stderr" in err


def _threads(results: Any) -> None:
    results.put(torch.get_num_threads())


@pytest.mark.timeout(120)
def test_a_forked_process_without_omp_num_threads_gets_the_default_thread_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What a process spawned without OMP_NUM_THREADS gets, although the fork server may have
    started during a launch that set it (launch_local sets it for its ranks)."""
    launch_local(_report, ("threads",), 2)  # starts the fork server if no test did yet
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    spawned = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                             capture_output=True, text=True, check=True, timeout=60)
    method, target = forking.process_target(_threads)
    assert method == "forkserver"
    ctx = multiprocessing.get_context(method)
    results = ctx.Queue()
    child = ctx.Process(target=target, args=(results,))
    child.start()
    forked = results.get(timeout=60)
    child.join(60)
    assert forked == int(spawned.stdout)
