"""Whether the bubble helper may copy at ``SCHED_IDLE``: the probe, as root and as a user."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading

import pytest

from bubbleguard import yielding

linux_sched = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux scheduling only")


def _may_leave_idle() -> bool:
    """What the kernel's rule predicts for this process: root / CAP_SYS_NICE, or a nice limit
    that covers nice 0 (``RLIMIT_NICE`` >= 20)."""
    import resource

    with open("/proc/self/status") as f:
        cap_eff = int(next(line for line in f if line.startswith("CapEff:")).split()[1], 16)
    cap_sys_nice = 23
    return bool(cap_eff >> cap_sys_nice & 1) or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20


@linux_sched
def test_the_probe_agrees_with_the_kernel_rule_and_priority_is_restored() -> None:
    assert yielding.idle_priority_is_reversible() is _may_leave_idle()
    if not yielding.idle_priority_is_reversible():
        pytest.skip("this process may not leave SCHED_IDLE (covered by the user test below)")
    seen: list[int] = []
    go, done = threading.Event(), threading.Event()

    def thread_body() -> None:
        go.wait()
        seen.append(os.sched_getscheduler(0))
        done.set()

    t = threading.Thread(target=thread_body)
    t.start()
    assert t.native_id is not None
    os.sched_setscheduler(t.native_id, os.SCHED_IDLE, os.sched_param(0))  # as the copy does
    assert os.sched_getscheduler(t.native_id) == os.SCHED_IDLE
    yielding.restore_normal_priority(t.native_id)
    go.set()
    done.wait(10)
    t.join()
    assert seen == [os.SCHED_OTHER]  # the thread itself runs at normal priority again


@linux_sched
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to run the probe as an unprivileged user")
def test_an_unprivileged_user_is_told_no_and_keeps_normal_priority() -> None:
    # As nobody (no CAP_SYS_NICE; RLIMIT_NICE 0 unless raised), a thread may enter SCHED_IDLE
    # but not leave it: the probe says False and the calling thread's policy is untouched.
    import resource

    if resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20:
        pytest.skip("RLIMIT_NICE lets every user leave SCHED_IDLE here")
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                 "-c"]
    reach = subprocess.run([*as_nobody, "import bubbleguard.yielding"], capture_output=True,
                           text=True, timeout=60)
    if reach.returncode != 0:  # e.g. a checkout or venv under a directory only root may read
        pytest.skip(f"nobody cannot import bubbleguard here: {reach.stderr.strip()[-200:]}")
    code = ("import os; from bubbleguard.yielding import idle_priority_is_reversible as f; "
            "print(f(), os.sched_getscheduler(0) == os.SCHED_OTHER)")
    out = subprocess.run([*as_nobody, code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True"]


def test_a_yield_flag_holds_its_mode_while_set_and_zero_otherwise() -> None:
    import ctypes

    for mode in (yielding.YIELD, yielding.ENTER_KERNEL):
        flag = yielding.YieldFlag(mode)
        cell = ctypes.c_int.from_address(flag.address)  # what the C copy reads
        assert cell.value == 0
        flag.set(True)
        assert cell.value == mode
        flag.set(False)
        assert cell.value == 0
    with pytest.raises(ValueError, match="mode must be YIELD or ENTER_KERNEL"):
        yielding.YieldFlag(3)
