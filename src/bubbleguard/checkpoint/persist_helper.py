"""The persist helper process: maps committed snapshots in shared memory, writes them with DCP.

Started by :class:`bubbleguard.checkpoint.persist.BackgroundPersister`, one per training rank, as
``python -c <persist._HELPER_MAIN> CONFIG_JSON FD`` (at ``SCHED_IDLE`` before this module's
imports); it talks to its rank over the
socket ``FD`` in JSON messages (one per ``send_bytes``):

* from the rank: ``{"kind": "persist", "step": k, "error": null}`` (persist step k; with an
  ``error`` text when the rank lacks the snapshot, so that this helper still takes part in the
  agreement) and ``{"kind": "stop"}``;
* to the rank: ``ready`` once its process group is up, ``released`` (step k's slot has been
  written to durable storage, or the persist gave up, and may be reused), ``done`` (a
  :class:`PersistResult` as JSON) and ``fatal`` (a traceback; the helper exits).

The helpers of all ranks form a gloo process group of their own (rendezvous on a TCP store that
rank 0's persister serves), so DCP's collectives never touch the training processes. The helper
runs only in CPU time the ranks leave idle (``SCHED_IDLE``) and dies with its rank
(``PR_SET_PDEATHSIG`` on Linux).
"""

from __future__ import annotations

import contextlib
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


def _persist(memory: MemoryTier, durable: DurableTier, step: int,
             error: str | None) -> dict[str, Any]:
    """One persist: map step's snapshot (checksums verified), agree, save. Returns the result.

    DCP writes the tensors straight from the read-only mapping of the slot file: no private
    copy (a copy of a 44 MB stage cost 9 ms of CPU and as many bytes through the caches of the
    rank's core). The rank keeps the slot pinned until this helper says ``released``, after the
    save (``main``), so it cannot be overwritten meanwhile.
    """
    cpu_start = time.process_time()
    result: dict[str, Any] = {"step": step, "persisted": False, "error": error,
                              "num_bytes": 0, "duration_s": 0.0, "cpu_s": 0.0, "replayed": False}
    with contextlib.ExitStack() as mapping:
        state: StageState | None = None
        if error is None:
            try:
                state = mapping.enter_context(memory.mapped(step))
            except (OSError, ValueError) as e:
                result["error"] = str(e)
        if not _agree(state is not None):
            result["error"] = result["error"] or "another rank lacks this snapshot"
            return result
        assert state is not None
        start = time.perf_counter()
        replayed_before = durable.replayed
        try:
            durable.save(state)
        except (OSError, ValueError, CheckpointError) as e:
            # Storage trouble (full disk, permissions) is reported per step; training goes on.
            result["error"] = str(e)
            return result
        result.update(persisted=True, num_bytes=state.num_bytes,
                      duration_s=time.perf_counter() - start,
                      cpu_s=time.process_time() - cpu_start,
                      replayed=durable.replayed > replayed_before)
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
                            num_slots=int(cfg["memory_num_slots"]), create=False)
        # With the rank's tier's reuse_layout, each persist after the first replays the first
        # one's DCP files (the layout does not change between steps; see tiers/dcp_layout.py).
        durable = DurableTier(cfg["durable_url"], keep_last=int(cfg["keep_last"]),
                              reuse_layout=bool(cfg["reuse_layout"]))
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
            step = int(msg["step"])
            try:
                result = _persist(memory, durable, step, msg.get("error"))
            finally:  # the slot is free again, whatever happened
                conn.send_bytes(json.dumps({"kind": "released", "step": step}).encode())
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
