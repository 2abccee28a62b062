"""Non-blocking persist: a background thread copies committed memory-tier snapshots to the durable tier.

The thread's collectives (the DCP save, agreement flags) run on a process group of their own, so
they never interleave with the training thread's communication. Call order::

    # init, every rank, after init_process_group and in the same order on all ranks:
    persist_group = dist.new_group(backend="gloo")
    durable = DurableTier(ckpt_dir, process_group=persist_group, keep_last=3)
    persister = BackgroundPersister(memory_tier, durable)

    # every rank, same steps, same order, once step k is committed in the memory tier:
    persister.submit(k)            # returns at once; pins k's slot until the thread copied it

    persister.raise_if_failed()    # any time: re-raises a failed persist on the training thread
    persister.close()              # every rank, at the end: waits for queued persists

``submit`` never fails for a step this rank lacks: the thread still takes part in the agreement, and
every rank skips that step, so no rank is left alone in a collective.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from bubbleguard.checkpoint.errors import CheckpointError
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import MemoryTier


@dataclass(frozen=True)
class PersistResult:
    """Outcome of one persist.

    Attributes:
        step: the step submitted.
        persisted: True once it is committed in the durable tier.
        error: why not, as text (None on success).
        num_bytes: bytes of the state written (0 when not persisted).
        duration_s: time the durable save took (0 when not persisted).
    """

    step: int
    persisted: bool
    error: str | None = None
    num_bytes: int = 0
    duration_s: float = 0.0


class BackgroundPersister:
    """Persist memory-tier snapshots to a durable tier from a daemon thread.

    Args:
        memory: this rank's memory tier.
        durable: the durable tier, built on a process group reserved for persisting (gloo).
    """

    def __init__(self, memory: MemoryTier, durable: DurableTier) -> None:
        self.memory = memory
        self.durable = durable
        self._queue: queue.Queue[tuple[int, contextlib.ExitStack | None, str | None] | None] = (
            queue.Queue()
        )
        self._results: list[PersistResult] = []
        self._failure: BaseException | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="bubbleguard-persist", daemon=True)
        self._thread.start()

    def submit(self, step: int) -> None:
        """Queue the persist of committed memory-tier step ``step`` (every rank, same steps)."""
        self.raise_if_failed()
        stack = contextlib.ExitStack()
        try:
            stack.enter_context(self.memory.hold(step))
            self._queue.put((step, stack, None))
        except FileNotFoundError as e:
            stack.close()
            self._queue.put((step, None, str(e)))

    def results(self) -> list[PersistResult]:
        """Outcomes so far, in submission order."""
        with self._lock:
            return list(self._results)

    def raise_if_failed(self) -> None:
        """Re-raise, on the caller's thread, an exception that stopped the persist thread."""
        with self._lock:
            failure = self._failure
        if failure is not None:
            raise RuntimeError(f"background persist failed: {failure}") from failure

    def close(self, timeout_s: float | None = None) -> list[PersistResult]:
        """Finish the queued persists and stop the thread (every rank)."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        self.raise_if_failed()
        return self.results()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            step, stack, error = item
            state: StageState | None = None
            try:
                if stack is not None:
                    with stack:
                        state = self.memory.read(step)  # a private copy; the slot is free after
            except (OSError, ValueError) as e:
                error = str(e)
            try:
                if not self._agree(state is not None):
                    self._record(
                        PersistResult(step, False, error or "another rank lacks this snapshot")
                    )
                    continue
                assert state is not None
                start = time.perf_counter()
                self.durable.save(state)
                self._record(PersistResult(step, True, num_bytes=state.num_bytes,
                                           duration_s=time.perf_counter() - start))
            except (OSError, ValueError, CheckpointError) as e:
                # Storage trouble (full disk, permissions) is reported per step; training goes on.
                self._record(PersistResult(step, False, str(e)))
            except BaseException as e:  # noqa: BLE001 -- handed to the training thread, not swallowed
                with self._lock:
                    self._failure = e
                return

    def _agree(self, ok: bool) -> bool:
        if not self.durable.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.durable.group)
        return bool(flag.item())

    def _record(self, result: PersistResult) -> None:
        with self._lock:
            self._results.append(result)
