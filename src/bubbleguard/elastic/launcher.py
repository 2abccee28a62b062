"""Launch ranks on this machine through torchrun's machinery (``torch.distributed.launcher``).

The agent, the c10d rendezvous (on 127.0.0.1), the worker environment (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``...), restarts and failure reports are torch.distributed.elastic's; this module only
fills in the launch configuration and turns a worker failure into an error that says which rank
failed and why.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["LaunchError", "free_port", "launch_local"]

T = TypeVar("T")


class LaunchError(RuntimeError):
    """A rank failed; the message names the rank and its error."""


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
        entrypoint: a module-level function (ranks are started with the ``spawn`` method).
        args: its arguments (picklable).
        num_ranks: processes to start.
        max_restarts: times torchrun restarts the whole group after a failure.
        run_id: rendezvous id; a fresh one by default.
        threads_per_rank: ``OMP_NUM_THREADS`` for the ranks.

    Raises:
        LaunchError: a rank failed after the allowed restarts.
    """
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
        start_method="spawn",
        local_addr="127.0.0.1",
    )
    # By default the ranks share the agent's rendezvous store across restarts, and a restarted
    # group then reads the dead group's gloo addresses (stale keys: "connection refused"). With
    # sharing off, rank 0 of every attempt hosts a fresh store on a fresh port.
    env = {"OMP_NUM_THREADS": str(threads_per_rank), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    try:
        with _environment(env):  # the ranks inherit it; the caller's process gets it back
            return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as exc:
        failures = "; ".join(
            f"rank {rank}: {failure.message or f'exit code {failure.exitcode}'}"
            for rank, failure in sorted(exc.failures.items())
        )
        raise LaunchError(f"training failed: {failures}") from exc
