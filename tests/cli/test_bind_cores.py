"""Pinning local ranks to cores of their own (``bind_local_rank``), in fresh processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Starts a thread before pinning (as gloo and torch do), pins, then reports the cores of every
# thread of the process and of a child process started afterwards (as the persist helper is).
PROBE = """
import json, os, subprocess, sys, threading
from bubbleguard.train import bind_local_rank
stop = threading.Event()
early = threading.Thread(target=stop.wait); early.start()
bound = bind_local_rank(int(sys.argv[1]))
tasks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True, check=True).stdout
stop.set(); early.join()
print(json.dumps({"bound": bound, "tasks": tasks, "child": json.loads(child)}))
"""


def _probe(threads: int, local_rank: int, local_ranks: int) -> dict:
    env = {**os.environ, "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_ranks)}
    out = subprocess.run([sys.executable, "-c", PROBE, str(threads)], env=env,
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return json.loads(out)


CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


@pytest.mark.skipif(len(CORES) < 2, reason="needs 2 cores")
def test_each_local_rank_gets_its_own_core_for_every_thread_and_child() -> None:
    for local_rank in (0, 1):
        got = _probe(threads=1, local_rank=local_rank, local_ranks=2)
        want = [CORES[local_rank]]
        assert got["bound"] == want
        assert len(got["tasks"]) >= 2  # the main thread and the one started before pinning
        assert all(cores == want for cores in got["tasks"].values()), got["tasks"]
        assert got["child"] == want


@pytest.mark.skipif(not CORES, reason="no sched_getaffinity")
def test_an_oversubscribed_node_is_left_to_the_scheduler() -> None:
    got = _probe(threads=1, local_rank=0, local_ranks=len(CORES) + 1)
    assert got["bound"] is None
    assert all(cores == CORES for cores in got["tasks"].values())
    assert got["child"] == CORES
