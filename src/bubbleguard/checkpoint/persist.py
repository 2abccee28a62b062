"""Non-blocking persist: a helper process per rank copies committed memory-tier snapshots to DCP.

Why a process and not a thread: a persist is mostly Python (DCP's planning, serialisation, file
writes). As a thread of the training process it would hold the training thread's GIL for
milliseconds at a time, and at a low CPU priority it could be preempted while holding it,
stalling training outright; measured on the 2-core dev machine, a persist every 10 steps as a
thread slowed the next four steps by 105 ms in all (4% of training time). The snapshot is
already in shared memory, so a helper process maps it from there and DCP writes it from the
mapping: only step numbers cross the process boundary, and no byte is copied before the write. See :mod:`bubbleguard.checkpoint.persist_helper` for the helper's side.

Call order (every rank, same order)::

    # once, after init_process_group (collective on `group`, default: the default group):
    persister = BackgroundPersister(memory_tier, DurableTier(ckpt_dir, keep_last=3))
    persister.wait_ready()         # optional: until the helpers' group is up (a few s of CPU)

    # every rank, same steps, same order, once step k is committed in the memory tier:
    persister.submit(k)            # returns at once; k's slot stays pinned until the helper
                                   # has written it (the helper saves straight from the shared
                                   # memory), so the rank cannot overwrite it meanwhile: give
                                   # the memory tier three slots, or a snapshot may wait for it
                                   # (skip_while_busy: skipped while an earlier one pins a slot)

    persister.raise_if_failed()    # any time: a dead helper is re-raised on the training thread
    persister.wait()               # block until every submitted persist is done (flush)
    persister.close()              # every rank, at the end: finishes queued persists

``submit`` never fails for a step this rank lacks: the helper still takes part in the agreement,
and every rank skips that step, so no helper is left alone in a collective.

Between persists the helper is stopped (``SIGSTOP``, state ``T`` in ``ps``): a gloo process group
keeps a thread that wakes every 10 ms (its event loop's poll timeout) for as long as the group
lives, and on the ranks' cores that thread's wake-ups delay the training threads (measured with
``perf sched``: 21 and 19 ms in ~25 steps of the overhead benchmark's layout). The rank stops
its helper once every submitted persist is done and continues it (``SIGCONT``) before each
message, under one lock, so a stop never lands after the continue of a newer message. A helper
is only stopped after it reported its last persist done, when it has left every collective
(gloo's collectives return once their sends are in the kernel's socket buffers). It runs in a
process group of its own: the kernel sends SIGHUP to a process group that is orphaned while one
of its members is stopped (seen: a benchmark started in the background by a shell that then
exited lost its helper, and would have lost the ranks). Not in a session of its own: with
autogroup scheduling (``kernel.sched_autogroup_enabled``, on by default in many distributions)
every session is a task group of its own, which competes with the ranks' group as an equal, so
``SCHED_IDLE`` then only ranks the helper inside its own group: a helper in its own session
took up to half of the ranks' cores, in 4-12 ms slices (``perf sched``: ~5 s of waiting for
the training threads during its start-up, 150-380 ms per persist).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier

_CAN_STOP = hasattr(signal, "SIGSTOP") and hasattr(signal, "SIGCONT")

_HELPER_MAIN = """\
import os, sys
try:  # a process group of its own, in the rank's session (see the module docstring)
    os.setpgid(0, 0)
except (AttributeError, OSError):
    pass
try:  # before any import of torch: the imports alone are ~2 s of CPU on the ranks' cores
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    pass  # the helper lowers its priority in other ways once started
from bubbleguard.checkpoint.persist_helper import main
sys.exit(main(sys.argv[1:]))
"""
"""The helper's command (``python -c``): its own process group and idle priority first, then
the helper's own imports (measured with ``-m``: for ~2 s after the first persist was due, each
training thread lost ~4 ms of every ~8 ms to the helper importing torch at normal priority)."""

HELPER_TIMEOUT_S = 600.0
"""How long a helper waits for its peers (rendezvous, DCP collectives) before it gives up."""


@dataclass(frozen=True)
class PersistResult:
    """Outcome of one persist.

    Attributes:
        step: the step submitted.
        persisted: True once it is committed in the durable tier.
        error: why not, as text (None on success).
        num_bytes: bytes of the state written (0 when not persisted).
        duration_s: time the durable save took, start to commit (0 when not persisted). The
            helper runs only in CPU time the ranks leave idle, so this is mostly the ranks'
            busy time in between, not what the persist costs.
        cpu_s: CPU time the helper process spent on the persist, all its threads, from
            mapping the snapshot to the commit: the idle time it took (0 when not persisted).
        replayed: written by replaying the previous save's file layout rather than by
            ``dcp.save`` (see ``tiers/dcp_layout.py``): the same files, less CPU.
    """

    step: int
    persisted: bool
    error: str | None = None
    num_bytes: int = 0
    duration_s: float = 0.0
    cpu_s: float = 0.0
    replayed: bool = False


def cpu_bandwidth(results: list[PersistResult]) -> float | None:
    """Bytes per second of helper CPU time of the newest persist that wrote something, or None.

    What a persist takes from the bubbles is its CPU time: the helper runs only when the ranks
    leave a core idle. Its elapsed time is mostly the ranks' busy time in between: on the dev VM
    a 44 MB stage's persist took 0.7-1.4 s and 60-90 ms of CPU; priced by its elapsed time, the
    plan said a persist fits in the bubbles every 23 iterations, by its CPU time every 1-2.
    """
    done = [r for r in results if r.persisted and r.cpu_s > 0]
    return done[-1].num_bytes / done[-1].cpu_s if done else None


class PersistHelperError(RuntimeError):
    """The persist helper process failed or exited (the message says how)."""


class BackgroundPersister:
    """Persist memory-tier snapshots to a durable tier from a helper process.

    Args:
        memory: this rank's memory tier (the helper reads the same directory).
        durable: where to persist: its URL and ``keep_last`` are handed to the helper, which
            writes with a process group of its own (the tier's own group is not used).
        group: the training processes' group the helpers' rendezvous address is shared on
            (collective); default: the default group, or none in a single process.
        skip_while_busy: skip a persist submitted while an earlier one still holds its
            snapshot, instead of queueing it. The helper only gets CPU time nothing else wants;
            on a busy machine it can fall behind for good, and each queued persist pins one more
            memory-tier slot, until the next ``MemoryTier.begin`` finds none to write into and
            the training thread waits for the starved helper (seen: 15-20 s steps, two busy
            processes beside a run with three slots and a persist every 10 steps). Skipping keeps
            at most one slot pinned, so training never waits for a persist; the durable tier
            falls behind instead, and the results say so. Call :meth:`wait` before a
            :meth:`submit` that must not be skipped.

    Raises:
        ValueError: a ``memory://`` durable tier, which lives inside one process only.
    """

    def __init__(self, memory: MemoryTier, durable: DurableTier, *,
                 group: dist.ProcessGroup | None = None, skip_while_busy: bool = False) -> None:
        if durable.url.startswith("memory://"):
            raise ValueError(f"cannot persist to {durable.url!r}: a memory:// filesystem lives in "
                             "one process, and the persist runs in a helper process; use a local "
                             "path or a shared fsspec URL")
        self.memory = memory
        self.skip_while_busy = skip_while_busy
        self._cond = threading.Condition()
        self._results: list[PersistResult] = []
        self._pins: list[tuple[int, contextlib.ExitStack]] = []
        self._num_submitted = 0
        self.ready = False  # the helper has imported torch and joined its peers
        self._failure: BaseException | None = None
        self._closing = False
        # Held while the helper is stopped or continued, with the message that follows a continue
        # (see the module docstring); never taken while holding self._cond.
        self._signal_lock = threading.Lock()
        distributed = dist.is_initialized() and dist.get_world_size(group) > 1
        rank = dist.get_rank(group) if distributed else 0
        num_ranks = dist.get_world_size(group) if distributed else 1
        self._store: dist.TCPStore | None = None
        host, port = self._rendezvous(group) if distributed else ("", 0)
        parent_end, child_end = socket.socketpair()
        config = {
            "parent_pid": os.getpid(), "rank": rank, "num_ranks": num_ranks,
            "store_host": host, "store_port": port, "timeout_s": HELPER_TIMEOUT_S,
            "job_id": memory.job_dir.name, "shm_root": str(memory.job_dir.parent.parent),
            "memory_rank": memory.rank, "memory_num_ranks": memory.num_ranks,
            "memory_num_slots": memory.num_slots,
            "durable_url": durable.url, "keep_last": durable.keep_last,
            "reuse_layout": durable.reuse_layout,
        }
        env = dict(os.environ)
        # The helper imports this very package, wherever it was imported from (src/ here).
        package_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _HELPER_MAIN, json.dumps(config), str(child_end.fileno())],
            # It moves to a process group of its own first thing (_HELPER_MAIN): a stopped
            # process in the ranks' group would make the kernel send SIGHUP to the whole group
            # (the ranks included) when that group is orphaned, e.g. when the shell that
            # started the job in the background exits. Its session stays the rank's.
            pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL, env=env)
        child_end.close()
        self._conn = Connection(parent_end.detach())
        self._reader = threading.Thread(target=self._read_loop, name="bubbleguard-persist-reader",
                                        daemon=True)
        self._reader.start()

    def _rendezvous(self, group: dist.ProcessGroup | None) -> tuple[str, int]:
        """Rank 0 serves a TCP store for the helpers' group; every rank learns its address.

        The store listens on ``MASTER_ADDR`` (127.0.0.1 when unset), the address torchrun gives
        rank 0's node.
        """
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = torch.zeros(1, dtype=torch.int64)
        if dist.get_rank(group) == 0:
            try:
                listener = socket.create_server((host, 0))
            except OSError as e:
                raise OSError(e.errno, f"cannot serve the persist helpers' rendezvous on "
                                       f"MASTER_ADDR={host}: {e.strerror}") from e
            port[0] = listener.getsockname()[1]
            self._store = dist.TCPStore(host, int(port[0]), is_master=True,
                                        wait_for_workers=False,
                                        master_listen_fd=listener.detach())
        dist.broadcast(port, src=dist.get_global_rank(group, 0) if group is not None else 0,
                       group=group)
        return host, int(port[0])

    # ------------------------------------------------------------------ training thread

    def submit(self, step: int) -> None:
        """Queue the persist of committed memory-tier step ``step`` (every rank, same steps).

        With ``skip_while_busy``, a persist submitted while an earlier one of this rank still
        holds its snapshot is skipped (every rank's helper skips it; its result says why).
        """
        self.raise_if_failed()
        stack = contextlib.ExitStack()
        error: str | None = None
        with self._cond:
            in_flight = self._pins[0][0] if self._pins else None
        if in_flight is not None and self.skip_while_busy:
            error = (f"skipped on rank {self.memory.rank}: the persist of step {in_flight} still "
                     "holds its snapshot (the helper runs on idle CPU time)")
        else:
            try:
                stack.enter_context(self.memory.hold(step))
            except FileNotFoundError as e:
                stack.close()
                error = str(e)
        with self._cond:
            if error is None:
                self._pins.append((step, stack))
            self._num_submitted += 1
        self._send({"kind": "persist", "step": step, "error": error})

    def wait_ready(self, timeout_s: float | None = HELPER_TIMEOUT_S) -> None:
        """Block until the helper is up (torch imported, its process group formed).

        A helper starts in idle CPU time only: beside a busy rank, its 2-3 s of start-up CPU
        took 18-20 s on the dev VM, and the first persist waited for it while the later ones
        were skipped (the first durable checkpoint came some 270 steps in). Waiting here, while
        the rank leaves the CPU idle, costs those seconds once, before training.

        Raises:
            PersistHelperError: the helper failed, or was not up within ``timeout_s``.
        """
        with self._cond:
            self._cond.wait_for(lambda: self.ready or self._failure is not None, timeout_s)
            ready = self.ready
        self.raise_if_failed()
        if not ready:
            raise PersistHelperError(f"persist helper (pid {self._proc.pid}) was not up within "
                                     f"{timeout_s} s")

    def results(self, start: int = 0) -> list[PersistResult]:
        """Outcomes so far, in submission order, from the ``start``-th on."""
        with self._cond:
            return self._results[start:]

    def raise_if_failed(self) -> None:
        """Re-raise, on the caller's thread, a failure of the helper process."""
        with self._cond:
            failure = self._failure
        if failure is not None:
            raise PersistHelperError(f"background persist failed: {failure}") from failure

    def wait(self, timeout_s: float | None = None) -> list[PersistResult]:
        """Block until every submitted persist is done (or the helper failed); the results."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._results) >= self._num_submitted
                                or self._failure is not None, timeout_s)
        self.raise_if_failed()
        return self.results()

    def close(self, timeout_s: float | None = None) -> list[PersistResult]:
        """Finish the queued persists and stop the helper (every rank)."""
        self._closing = True
        with contextlib.suppress(OSError):
            self._send({"kind": "stop"})
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
            self._fail(PersistHelperError(f"persist helper did not finish within {timeout_s} s; "
                                          "killed it"))
        self._reader.join()
        self._conn.close()
        self._store = None
        self.raise_if_failed()
        return self.results()

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            with self._signal_lock:
                if _CAN_STOP:
                    self._proc.send_signal(signal.SIGCONT)  # no-op for an exited helper
                self._conn.send_bytes(json.dumps(msg).encode())
        except OSError as e:  # the helper is gone; the reader reports why
            self._fail(PersistHelperError(f"cannot reach the persist helper: {e}"))
            raise

    def _stop_if_idle(self) -> None:
        """Stop the helper if every submitted persist is done (reader thread; see the module
        docstring). Its next message continues it."""
        if not _CAN_STOP:
            return
        with self._signal_lock:
            with self._cond:
                idle = len(self._results) >= self._num_submitted and not self._closing
            if idle:
                self._proc.send_signal(signal.SIGSTOP)

    # ------------------------------------------------------------------ reader thread

    def _read_loop(self) -> None:
        while True:
            try:
                msg = json.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            kind = msg.pop("kind")
            if kind == "released":
                self._release(int(msg["step"]))
            elif kind == "done":
                with self._cond:
                    self._results.append(PersistResult(**msg))
                    self._cond.notify_all()
                self._stop_if_idle()
            elif kind == "ready":
                with self._cond:
                    self.ready = True
                    self._cond.notify_all()
                self._stop_if_idle()
            elif kind == "fatal":
                self._fail(PersistHelperError(f"persist helper failed:\n{msg['error']}"))
        code = self._proc.wait()
        with self._cond:
            unfinished = len(self._results) < self._num_submitted
        if code != 0 or (unfinished and not self._closing):
            self._fail(PersistHelperError(
                f"persist helper (pid {self._proc.pid}) exited with code {code}"
                + (f" with {self._num_submitted - len(self._results)} persist(s) unfinished"
                   if unfinished else "")))
        self._release_all()

    def _release(self, step: int) -> None:
        with self._cond:
            index = next((i for i, (s, _) in enumerate(self._pins) if s == step), None)
            pin = self._pins.pop(index)[1] if index is not None else None
        if pin is not None:
            pin.close()

    def _release_all(self) -> None:
        with self._cond:
            pins, self._pins = self._pins, []
        for _, pin in pins:
            pin.close()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            if self._failure is None:
                self._failure = error
            self._cond.notify_all()
