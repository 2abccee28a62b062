"""Start local processes by forking them from a server that imported torch once.

A process spawned to run PyTorch code spends ~4 s of CPU importing torch and bubbleguard before
its first line; forked from ``multiprocessing``'s fork server, which imported them when it
started (once per launching process), it spends none. Torchrun restarts, test suites and
benchmarks that launch more than once gain the most (a 2-step, 2-rank ``run_local``: 4.3-6.2 s
spawned, 1.5-2.2 s forked, measured on the 2-core dev machine).

A forked process inherits what the fork server had when it started, not what its launcher has
now, so :func:`process_target` wraps the process's function to put back what a spawned one
would have: the launcher's environment (with variables set for the child on top, as torchrun's
agent sets ``RANK``...), its stdout and stderr (sent as file descriptors), ``OMP_NUM_THREADS``
applied to torch (OpenMP read its thread count once, in the server, which starts without
that variable so that the default is a spawned process's), and ``atexit`` handlers run at the end
(a forked process ends in ``os._exit``). Where the fork server is not ours to control (another
part of the process started it first; its environment is unknown) processes are spawned.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
from collections.abc import Callable
from multiprocessing import context, forkserver, reduction
from typing import Any, Generic, TypeVar

import torch

__all__ = ["PRELOAD", "process_target"]

T = TypeVar("T")

PRELOAD = ["bubbleguard.train"]  # what the fork server imports (torch and the whole runtime)

THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")  # kept out of the server's environment

# (pid, environment) of the fork server this module started, while it runs.
_server: tuple[int, dict[str, str]] | None = None


def process_target(fn: Callable[..., T]) -> tuple[str, Callable[..., T]]:
    """The start method for processes of this machine that run ``fn``, and ``fn`` ready for it.

    ``("forkserver", wrapped fn)`` (see the module docstring), or ``("spawn", fn)`` where the
    fork server is not ours. Call it with the environment the processes should see in place,
    and start them before the environment changes: it is captured now.
    """
    server_environ = _fork_server()
    if server_environ is None:
        return "spawn", fn
    return "forkserver", _AsSpawned(fn, dict(os.environ), server_environ)


class _AsSpawned(Generic[T]):
    """``fn``, run in a forked process as it would run in a spawned one."""

    def __init__(self, fn: Callable[..., T], environ: dict[str, str],
                 server_environ: dict[str, str]) -> None:
        self.fn = fn
        self.environ = environ  # the launcher's, to be the process's
        self.server_environ = server_environ  # what the process inherited
        # torchrun names the job (and its events) after the entrypoint.
        self.__name__ = getattr(fn, "__name__", "entrypoint")
        self.__qualname__ = getattr(fn, "__qualname__", self.__name__)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if context.get_spawning_popen() is not None:  # pickled to start a process
            state["stdio"] = {fd: reduction.DupFd(fd) for fd in (1, 2) if _is_open(fd)}
        return state

    def __call__(self, *args: Any) -> T:
        _restore_environ(self.environ, self.server_environ)
        for fd, dup in getattr(self, "stdio", {}).items():
            new = dup.detach()
            os.dup2(new, fd)
            os.close(new)
        with contextlib.suppress(KeyError, ValueError):
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        try:
            return self.fn(*args)
        finally:
            atexit._run_exitfuncs()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _restore_environ(launcher: dict[str, str], server: dict[str, str]) -> None:
    """Make a forked process's environment the launcher's, plus what was set for the process.

    The process started with the fork server's environment (``server``), onto which its starter
    may have written variables (torchrun's agent: ``RANK``, ``MASTER_PORT``, ...): those are the
    entries that differ from ``server``. (One set to the server's own value is taken from the
    launcher's.)
    """
    own = {k: v for k, v in os.environ.items() if server.get(k) != v}
    os.environ.clear()
    os.environ.update(launcher)
    os.environ.update(own)


def _fork_server() -> dict[str, str] | None:
    """Start (or reuse) the fork server; the environment its children inherit.

    None where processes must be spawned instead: no ``forkserver`` start method here, or a
    fork server that another part of this process started.
    """
    global _server
    server = getattr(forkserver, "_forkserver", None)
    if "forkserver" not in multiprocessing.get_all_start_methods() or server is None:
        return None
    running = getattr(server, "_forkserver_pid", "unknown")  # None: not started yet
    if running is not None and running != (_server[0] if _server else None):
        return None
    if running is None:
        forkserver.set_forkserver_preload(PRELOAD)
    # OpenMP reads its thread count once, when the server loads torch: without these variables
    # it picks the default a spawned process without them would (each child sets its own).
    saved = {k: os.environ.pop(k) for k in THREAD_VARIABLES if k in os.environ}
    try:
        server.ensure_running()  # starts it, or again if it died
        pid = server._forkserver_pid
        if _server is None or _server[0] != pid:
            _server = (pid, dict(os.environ))
    finally:
        os.environ.update(saved)
    return _server[1]
