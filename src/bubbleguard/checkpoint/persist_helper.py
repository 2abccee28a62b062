"""The persist helper process: reads committed snapshots from shared memory, writes them with DCP.

Started by :class:`bubbleguard.checkpoint.persist.BackgroundPersister`, one per training rank, as
``python -m bubbleguard.checkpoint.persist_helper CONFIG_JSON FD``; it talks to its rank over the
socket ``FD`` in JSON messages (one per ``send_bytes``):

* from the rank: ``{"kind": "persist", "step": k, "error": null}`` (persist step k; with an
  ``error`` text when the rank lacks the snapshot, so that this helper still takes part in the
  agreement) and ``{"kind": "stop"}``;
* to the rank: ``ready`` once its process group is up, ``released`` (step k's slot has been read
  into private memory and may be reused), ``done`` (a :class:`PersistResult` as JSON) and
  ``fatal`` (a traceback; the helper exits).

The helpers of all ranks form a gloo process group of their own (rendezvous on a TCP store that
rank 0's persister serves), so DCP's collectives never touch the training processes. The helper
runs only in CPU time the ranks leave idle (``SCHED_IDLE``) and dies with its rank
(``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import ctypes
import datetime
import gc
import json
import os
import signal
import sys
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from bubbleguard.checkpoint.errors import CheckpointError
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Get SIGKILL when the rank that started us dies (Linux), and exit if it already has."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):
            pass  # no prctl: the rank's closed socket still ends the loop below
    if os.getppid() != parent_pid:  # the rank died before prctl took effect
        os._exit(1)


def _run_when_idle() -> None:
    """Take CPU time only when no training process wants it.

    ``SCHED_IDLE`` (Linux): any normal task that wakes up, such as a rank whose receive just
    completed, preempts this process at once. Being a process of its own, it holds no lock the
    ranks need (no GIL), so at worst it is starved and the persist finishes later. Where
    ``SCHED_IDLE`` is not available, the lowest nice value.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (OSError, AttributeError):
        pass
    try:
        os.setpriority(os.PRIO_PROCESS, 0, 19)
    except (OSError, AttributeError):
        pass  # keep the default priority where it cannot be lowered


def _agree(ok: bool) -> bool:
    """Whether every helper has its snapshot (MIN over the helper group)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


class _Buffer:
    """The helper's private copy of a snapshot, reused from one persist to the next.

    A fresh buffer per persist costs page faults and the kernel zeroing the pages: reading a
    44 MB stage state took 27 ms of CPU into a fresh buffer and 16 ms into a reused one.
    """

    def __init__(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)

    def at_least(self, num_bytes: int) -> torch.Tensor:
        if self.tensor.numel() < num_bytes:
            self.tensor = torch.empty(num_bytes, dtype=torch.uint8)
        return self.tensor


def _persist(memory: MemoryTier, durable: DurableTier, conn: Connection, buffer: _Buffer,
             step: int, error: str | None) -> dict[str, Any]:
    """One persist: read step's snapshot, release its slot, agree, save. Returns the result.

    Persists run one after the other, so the previous one's tensors (views of ``buffer``) are
    written before the buffer is read into again.
    """
    state: StageState | None = None
    if error is None:
        try:
            record = next((r for r in memory.records() if r.step == step), None)
            out = buffer.at_least(record.layout.total_bytes) if record is not None else None
            state = memory.read(step, out=out)  # a private copy, checksums verified
        except (OSError, ValueError) as e:
            error = str(e)
    conn.send_bytes(json.dumps({"kind": "released", "step": step}).encode())
    result: dict[str, Any] = {"step": step, "persisted": False, "error": error,
                              "num_bytes": 0, "duration_s": 0.0}
    if not _agree(state is not None):
        result["error"] = error or "another rank lacks this snapshot"
        return result
    assert state is not None
    start = time.perf_counter()
    try:
        durable.save(state)
    except (OSError, ValueError, CheckpointError) as e:
        # Storage trouble (full disk, permissions) is reported per step; training goes on.
        result["error"] = str(e)
        return result
    result.update(persisted=True, num_bytes=state.num_bytes,
                  duration_s=time.perf_counter() - start)
    return result


def main(argv: list[str]) -> int:
    """Entry point: ``persist_helper CONFIG_JSON FD`` (see the module docstring)."""
    cfg = json.loads(argv[0])
    conn = Connection(int(argv[1]))
    _die_with_parent(int(cfg["parent_pid"]))
    _run_when_idle()
    torch.set_num_threads(1)
    # DCP writes every tensor with torch.save, which computes a zip CRC32 per record: 29 of the
    # 93 ms a 44 MB stage's save took here. No reader checks it (torch.load, and so dcp.load and
    # dcp_to_torch_save, loads a file with a flipped data byte without a word, as tested), and
    # the snapshot was verified against its own checksums just before; so this process skips it.
    torch.serialization.set_crc32_options(False)
    try:
        if cfg["num_ranks"] > 1:
            timeout = datetime.timedelta(seconds=float(cfg["timeout_s"]))
            store = dist.TCPStore(cfg["store_host"], int(cfg["store_port"]), is_master=False,
                                  timeout=timeout)
            dist.init_process_group("gloo", store=store, rank=int(cfg["rank"]),
                                    world_size=int(cfg["num_ranks"]), timeout=timeout)
        memory = MemoryTier(cfg["job_id"], int(cfg["memory_rank"]),
                            num_ranks=int(cfg["memory_num_ranks"]), root=cfg["shm_root"],
                            create=False)
        durable = DurableTier(cfg["durable_url"], keep_last=int(cfg["keep_last"]))
        buffer = _Buffer()
        # Python's full collections scan every object alive; after importing torch that is
        # hundreds of thousands, and DCP's planning makes enough garbage to trigger one every
        # few persists: 0.4-0.5 s of CPU each here, more than the persists themselves. What
        # exists now lives as long as the process, so later full collections skip it.
        gc.freeze()
        conn.send_bytes(json.dumps({"kind": "ready"}).encode())
        while True:
            try:
                msg = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                return 1  # the rank is gone
            if msg["kind"] == "stop":
                return 0
            result = _persist(memory, durable, conn, buffer, int(msg["step"]),
                              msg.get("error"))
            conn.send_bytes(json.dumps({"kind": "done", **result}).encode())
    except Exception:  # reported to the rank, which re-raises it on its training thread
        try:
            conn.send_bytes(json.dumps({"kind": "fatal",
                                        "error": traceback.format_exc()}).encode())
        except OSError:
            pass
        return 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
