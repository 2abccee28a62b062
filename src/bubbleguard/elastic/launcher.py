"""Launch ranks on this machine through torchrun's machinery (``torch.distributed.launcher``).

The agent, the c10d rendezvous (on 127.0.0.1), the worker environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), restarts and failure reports are torch.distributed.elastic's; this module only
fills in the launch configuration and turns a worker failure into an error that says which rank
failed and why.

torchrun reports the first failed worker it notices, and that is often the wrong one: when rank 1
raises on a bad checkpoint, rank 0 fails a moment later on the connection rank 1's exit closed, and
if rank 0's process ends first, rank 0's "Connection closed by peer" is all the agent reports. So
every rank records the exception it raises (with the time) before its process exits, and the
launcher reports the root cause first: errors that are not a lost peer, oldest first, then the
lost-peer errors they caused.

Ranks are forked from a server that imported torch once (:mod:`bubbleguard.elastic.forking`),
with what a spawned rank would have had: the launcher's environment, stdout and stderr.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import re
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from bubbleguard.elastic.forking import process_target

__all__ = ["LaunchError", "RankError", "describe_failure", "free_port", "launch_local"]

T = TypeVar("T")


class LaunchError(RuntimeError):
    """A rank failed; the message names the rank and its error, the root cause first."""


# What a rank raises when a peer's process went away: a consequence, never the root cause.
PEER_LOST = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Timed out waiting|"
                       r"connection refused", re.IGNORECASE)

_TORCH_ERROR_FILE = re.compile(r"^pytorch-errorfile-[\w-]+\.pickle$")


@dataclass(frozen=True)
class RankError:
    """One rank's failure as the launcher reports it."""

    rank: int
    time: float  # seconds since the epoch, when it was raised (or noticed)
    text: str

    @property
    def peer_lost(self) -> bool:
        return PEER_LOST.search(self.text) is not None


class _Recorded(Generic[T]):
    """The entrypoint, writing any exception it raises to ``error_dir`` before passing it on.

    Written at the moment the exception reaches the entrypoint, before the process's teardown, so
    a rank whose exit is slow still has its error on record when its peers fail because of it.
    """

    def __init__(self, entrypoint: Callable[..., T], error_dir: str) -> None:
        self.entrypoint = entrypoint
        self.error_dir = error_dir
        # torchrun names the job (and its events) after the entrypoint.
        self.__name__ = getattr(entrypoint, "__name__", "entrypoint")
        self.__qualname__ = getattr(entrypoint, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> T:
        try:
            return self.entrypoint(*args)
        except BaseException as exc:
            record = {"time": time.time(), "text": f"{type(exc).__name__}: {exc}",
                      "torch_error_file": _torch_error_file()}
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            name = f"attempt{attempt}-rank{os.environ.get('RANK', '?')}.json"
            with contextlib.suppress(OSError):  # the error itself matters more than its record
                (Path(self.error_dir) / name).write_text(json.dumps(record))
            raise


def _torch_error_file() -> str | None:
    """The file torch's process wrapper writes this process's traceback to once the exception
    leaves the entrypoint (it is the last argument of the process's target, a
    ``pytorch-errorfile-*.pickle`` in the launcher's temporary directory). The launcher reads
    it and torch never deletes it, so the rank names it for the launcher to remove."""
    args = getattr(multiprocessing.current_process(), "_args", ())
    name = args[-1] if args else None
    if isinstance(name, str) and _TORCH_ERROR_FILE.match(os.path.basename(name)):
        return name
    return None


def _remove_torch_error_files(error_dir: str) -> None:
    """Delete the traceback files the failed ranks of every attempt named (read by now)."""
    for path in Path(error_dir).glob("attempt*-rank*.json"):
        try:
            name = json.loads(path.read_text()).get("torch_error_file")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(name, str) and _TORCH_ERROR_FILE.match(os.path.basename(name)):
            with contextlib.suppress(OSError):
                os.unlink(name)


def _recorded_errors(error_dir: str, attempt: int) -> dict[int, RankError]:
    """The errors the ranks of ``attempt`` recorded (unreadable records are skipped)."""
    out = {}
    for path in Path(error_dir).glob(f"attempt{attempt}-rank*.json"):
        try:
            rank = int(path.stem.rsplit("rank", 1)[1])
            record = json.loads(path.read_text())
            out[rank] = RankError(rank, float(record["time"]), str(record["text"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


def _agent_message(message: Any, exitcode: int) -> str:
    """The text of a failure as torchrun's agent saw it (its message may be a JSON object)."""
    if isinstance(message, dict):
        message = message.get("message", "")
    return str(message) or f"exit code {exitcode}"


def describe_failure(recorded: dict[int, RankError], agent: dict[int, RankError]) -> str:
    """Every failed rank's error, root cause first.

    ``recorded`` are the exceptions the ranks wrote down; ``agent`` are what torchrun's agent
    noticed (exit codes, signals), used for ranks without a record (a rank killed by a signal
    records nothing). Errors other than a lost peer come first, oldest first; the lost-peer
    errors follow, marked as such.
    """
    errors = {**agent, **recorded}
    ordered = sorted(errors.values(), key=lambda e: (e.peer_lost, e.time, e.rank))
    parts = [f"rank {e.rank}: {e.text}" + (" (a consequence: its peer went away)"
                                           if e.peer_lost and i else "")
             for i, e in enumerate(ordered)]
    if ordered and all(e.peer_lost for e in ordered):
        parts.append("no rank recorded an error of its own: a peer may have been killed "
                     "(by a signal, or by the out-of-memory killer)")
    return "training failed: " + "; ".join(parts)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables (unless the user set them) for the block, then restore them."""
    saved = {k: os.environ.get(k) for k in values}
    for k, v in values.items():
        os.environ.setdefault(k, v)
    try:
        yield
    finally:
        for k, old in saved.items():
            if old is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = old


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch_local(entrypoint: Callable[..., T], args: tuple[Any, ...], num_ranks: int, *,
                 max_restarts: int = 0, run_id: str | None = None,
                 threads_per_rank: int = 1) -> dict[int, T]:
    """Run ``entrypoint(*args)`` on ``num_ranks`` local ranks; return each rank's result.

    Args:
        entrypoint: a module-level function (ranks are forked from a fork server, or
            spawned: :func:`bubbleguard.elastic.forking.process_target`).
        args: its arguments (picklable).
        num_ranks: processes to start.
        max_restarts: times torchrun restarts the whole group after a failure.
        run_id: rendezvous id; a fresh one by default.
        threads_per_rank: ``OMP_NUM_THREADS`` for the ranks.

    Raises:
        LaunchError: a rank failed after the allowed restarts.
    """
    # By default the ranks share the agent's rendezvous store across restarts, and a restarted
    # group then reads the dead group's gloo addresses (stale keys: "connection refused"). With
    # sharing off, rank 0 of every attempt hosts a fresh store on a fresh port.
    env = {"OMP_NUM_THREADS": str(threads_per_rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # The ranks' error records and torchrun's log directory (made on every launch, which would
    # otherwise leave a torchelastic_* directory behind each time) live and go with the launch.
    launch_dir = tempfile.mkdtemp(prefix="bubbleguard-launch-")
    error_dir = os.path.join(launch_dir, "errors")
    os.mkdir(error_dir)
    try:
        with _environment(env):  # the ranks get it; the caller's process gets it back
            start_method, target = process_target(_Recorded(entrypoint, error_dir))
            config = LaunchConfig(
                min_nodes=1,
                max_nodes=1,
                nproc_per_node=num_ranks,
                run_id=run_id or uuid.uuid4().hex[:12],
                rdzv_backend="c10d",
                rdzv_endpoint=f"127.0.0.1:{free_port()}",
                rdzv_configs={"is_host": True},
                max_restarts=max_restarts,
                monitor_interval=0.1,
                local_addr="127.0.0.1",
                start_method=start_method,
                logs_specs=DefaultLogsSpecs(log_dir=os.path.join(launch_dir, "logs")),
            )
            return elastic_launch(config, target)(*args)
    except ChildFailedError as exc:
        # The group gave up after max_restarts restarts: the last attempt's errors are the story.
        agent = {rank: RankError(rank, float(f.timestamp), _agent_message(f.message, f.exitcode))
                 for rank, f in exc.failures.items()}
        recorded = _recorded_errors(error_dir, attempt=max_restarts)
        raise LaunchError(describe_failure(recorded, agent)) from exc
    finally:
        _remove_torch_error_files(error_dir)
        shutil.rmtree(launch_dir, ignore_errors=True)
