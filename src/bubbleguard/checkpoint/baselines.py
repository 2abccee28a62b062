"""The baseline checkpoint modes, measured in the same harness and with the same flags as ``bubble``.

Every mode takes a snapshot after optimizer step k when ``k % every == 0`` and makes one durable
every ``persist_every`` steps (see each class for what "durable" means there). What differs is
where the work runs -- and so what the training thread waits for:

* ``sync`` (:class:`SyncSave`): ``torch.save`` of the stage's state to a per-rank file under
  ``ckpt_dir``, written atomically and fsynced, at the step boundary. Training waits for all of it.
  The file *is* durable (fsynced, under ``ckpt_dir``), so ``persist_every`` adds nothing: every
  snapshot is also a persist. The files are per rank and layout (no reshard).
* ``background`` (:class:`BackgroundSnapshot`, CheckFreq style): right after the step a helper
  thread copies the state into preallocated CPU buffers while the next iteration's forward and
  backward run; the training thread waits for that copy just before the next optimizer step (the
  state must not change under it). Every ``persist_every`` steps a second thread writes the copy
  to the durable tier (DCP) on the persist process group.
* ``dcp-async`` (:class:`DcpAsyncSave`): ``torch.distributed.checkpoint.async_save`` of the
  stage's tensors (keyed by whole-model FQN) every ``every`` steps, into the durable tier's layout
  so that it is a regular durable checkpoint. ``async_save`` stages (copies) the state on the
  calling thread and uploads in a thread; one save is in flight at a time, so the next snapshot
  first waits for the previous one. Every snapshot is durable, as with ``sync``.

Resume (``Checkpointer.resume``) reads what the modes leave behind: the durable tier
(``background``, ``dcp-async``) and the per-rank ``torch.save`` files (``sync``, via
:class:`TorchSaveFiles`). A ``background`` snapshot lives in process memory only and dies with the
process, as in CheckFreq.

Call order: the :class:`~bubbleguard.checkpoint.checkpointer.Checkpointer` builds the strategy with
:func:`make_baseline` and calls its hooks on the training thread (``after_step(k)`` after optimizer
step k, ``run_one()`` inside waits, ``before_step()`` just before the next step, ``close()`` once
at the end, on every rank).
"""

from __future__ import annotations

import json
import re
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from io import BytesIO
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

from bubbleguard.checkpoint.atomic import atomic_write_bytes
from bubbleguard.checkpoint.checkpointer import SnapshotStrategy
from bubbleguard.checkpoint.errors import CheckpointError, CorruptSnapshotError
from bubbleguard.checkpoint.manifest import is_local, write_json
from bubbleguard.checkpoint.persist import PersistResult
from bubbleguard.checkpoint.state import StageState

# The durable tier's per-rank JSON format; its tensor encoder is private to durable.py (the
# format has one writer, so we borrow it rather than write a second one).
from bubbleguard.checkpoint.tiers.durable import RANK_FORMAT, DurableTier
from bubbleguard.checkpoint.tiers.durable import _encode as encode_tensor

if TYPE_CHECKING:
    from bubbleguard.checkpoint.checkpointer import Checkpointer

__all__ = [
    "BackgroundSnapshot",
    "DcpAsyncSave",
    "SyncSave",
    "TorchSaveFiles",
    "make_baseline",
]

TORCHSAVE_FORMAT = "bubbleguard-torchsave/1"
TORCHSAVE_DIR = "torchsave"
_STEP_FILE = re.compile(r"^step-(\d{8})\.pt$")


def make_baseline(owner: Checkpointer) -> SnapshotStrategy:
    """The strategy of ``owner.config.mode`` (``sync``, ``background`` or ``dcp-async``).

    Raises:
        ValueError: any other mode (``bubble`` and ``none`` are built by the Checkpointer).
    """
    mode = owner.config.mode
    if mode == "sync":
        return SyncSave(owner)
    if mode == "background":
        return BackgroundSnapshot(owner)
    if mode == "dcp-async":
        return DcpAsyncSave(owner)
    raise ValueError(f"no baseline named {mode!r}; the baselines are sync, background, dcp-async")


def _durable(owner: Checkpointer) -> DurableTier:
    assert owner.durable is not None, "the Checkpointer builds the durable tier for every mode"
    return owner.durable


def _release_memory_tier(owner: Checkpointer) -> None:
    """Remove the (unused) memory-tier directory the Checkpointer made, unless it holds snapshots.

    Snapshots there come from an earlier ``bubble`` run on the same ``ckpt_dir``; they stay.
    """
    memory = owner.memory
    if memory is None:
        return
    if memory.records():
        memory.close()
    else:
        memory.cleanup()


# --------------------------------------------------------------------------------------- sync


class TorchSaveFiles:
    """Per-rank ``torch.save`` checkpoints of the ``sync`` mode, on a local path.

    Layout (the rank count is part of the path, so a run of another size never picks them up)::

        <ckpt_dir>/torchsave/ranks-<W>/rank-<r>/step-<k:08d>.pt

    Each file holds ``{"format", "step", "tensors", "local_tensors", "metadata" (JSON text)}``:
    plain tensors, ints and strings only, so it loads with ``weights_only=True``. A file is
    written atomically (temp + fsync + rename), so it is either complete or absent; which step
    *every* rank holds is agreed at resume time (``manifest.agree_newest_step``), as for the
    memory tier. The newest ``keep_last`` files stay (at least two, so that a crash between two
    ranks' writes still leaves a common step).

    Args:
        ckpt_dir: the run's checkpoint root; must be a local path.
        rank: this process's rank.
        num_ranks: ranks of the run.
        keep_last: files to keep per rank (raised to 2).
        create: make the directory (writers); readers pass False.

    Raises:
        ValueError: ``ckpt_dir`` is a URL.
        PermissionError / NotADirectoryError / OSError: the directory cannot be created (names it).
    """

    def __init__(self, ckpt_dir: str, rank: int, num_ranks: int, *, keep_last: int = 3,
                 create: bool = True) -> None:
        if "://" in ckpt_dir:
            raise ValueError(f"--ckpt sync writes local files with torch.save; --ckpt-dir must be "
                             f"a local path, got {ckpt_dir!r} (use dcp-async or bubble for URLs)")
        self.dir = Path(ckpt_dir) / TORCHSAVE_DIR / f"ranks-{num_ranks}" / f"rank-{rank:05d}"
        self.keep_last = max(2, keep_last)
        if create:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise type(e)(e.errno, f"cannot create the sync checkpoint directory {self.dir}: "
                                       f"{e.strerror}") from e

    def path(self, step: int) -> Path:
        """File of ``step``."""
        return self.dir / f"step-{step:08d}.pt"

    def write(self, state: StageState) -> Path:
        """``torch.save`` ``state`` atomically, then drop files beyond ``keep_last``.

        Raises:
            OSError: the write failed (full disk, permissions); the previous files are kept.
        """
        buf = BytesIO()
        torch.save({"format": TORCHSAVE_FORMAT, "step": state.step,
                    "tensors": dict(state.tensors), "local_tensors": dict(state.local_tensors),
                    "metadata": json.dumps(dict(state.metadata))}, buf)
        target = self.path(state.step)
        try:
            atomic_write_bytes(target, buf.getvalue())
        except OSError as e:
            kept = self.steps()
            raise type(e)(e.errno, f"writing sync checkpoint {target} failed: {e.strerror}; "
                                   f"kept steps {kept}") from e
        for old in self.steps()[self.keep_last:]:
            self.path(old).unlink(missing_ok=True)
        return target

    def steps(self) -> list[int]:
        """Steps with a file, newest first (contents not checked)."""
        if not self.dir.is_dir():
            return []
        found = (_STEP_FILE.match(p.name) for p in self.dir.iterdir())
        return sorted((int(m.group(1)) for m in found if m), reverse=True)

    def read(self, step: int) -> StageState:
        """Load the file of ``step`` (``weights_only=True``).

        Raises:
            FileNotFoundError: no file of ``step``.
            CorruptSnapshotError: the file does not load or is not in this format (names it).
        """
        path = self.path(step)
        if not path.exists():
            raise FileNotFoundError(f"no sync checkpoint of step {step}: {path} does not exist "
                                    f"(this rank holds {self.steps()})")
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True)
            if obj.get("format") != TORCHSAVE_FORMAT or obj["step"] != step:
                raise ValueError(f"format {obj.get('format')!r}, step {obj.get('step')!r}")
            return StageState(step=step, tensors=obj["tensors"],
                              local_tensors=obj["local_tensors"],
                              metadata=json.loads(obj["metadata"]))
        except (RuntimeError, ValueError, KeyError, TypeError, AttributeError,
                EOFError) as e:
            raise CorruptSnapshotError(f"sync checkpoint {path} is unreadable: {e}") from None

    def valid_steps(self) -> list[int]:
        """Steps whose files load, newest first (reads every file; for resume)."""
        good = []
        for step in self.steps():
            try:
                self.read(step)
            except CorruptSnapshotError as e:
                warnings.warn(f"{e}; skipping it", stacklevel=2)
                continue
            good.append(step)
        return good


class SyncSave(SnapshotStrategy):
    """``torch.save`` at the step boundary, blocking (see the module docstring)."""

    name = "sync"

    def __init__(self, owner: Checkpointer) -> None:
        self.owner = owner
        self.files = TorchSaveFiles(owner.config.ckpt_dir, owner.rank, owner.num_ranks,
                                    keep_last=owner.config.keep_last)

    def after_step(self, step: int) -> None:
        if step % self.owner.config.every == 0:
            self.files.write(self.owner.capture(step))

    def close(self) -> None:
        _release_memory_tier(self.owner)


# --------------------------------------------------------------------------------- background


@dataclass
class _Buffer:
    """One preallocated CPU copy of the stage's tensors (internal)."""

    tensors: dict[str, torch.Tensor]
    pins: int = 0


class BackgroundSnapshot(SnapshotStrategy):
    """CheckFreq-style snapshot in a helper thread, persist in another (module docstring).

    Two preallocated buffers: a snapshot goes into one that no persist is reading, so the persist
    of step k and the snapshot of k+1 proceed side by side. If both are being persisted, the
    snapshot waits (and with it, the next optimizer step).
    """

    name = "background"

    def __init__(self, owner: Checkpointer) -> None:
        self.owner = owner
        self.durable = _durable(owner)
        self._buffers: list[_Buffer] = []
        self._cond = threading.Condition()
        self._snapshotter = ThreadPoolExecutor(1, thread_name_prefix="bubbleguard-snapshot")
        self._persister = ThreadPoolExecutor(1, thread_name_prefix="bubbleguard-bg-persist")
        self._snapshot: Future[tuple[StageState, _Buffer]] | None = None
        self._newest: tuple[StageState, _Buffer] | None = None
        self._persisted: int | None = None
        self._persists: list[Future[PersistResult]] = []
        self.results: list[PersistResult] = []

    def after_step(self, step: int) -> None:
        self._collect_persists()
        if step % self.owner.config.every == 0:
            # Capture on the training thread (references, RNG, metadata); copy in the helper.
            self._snapshot = self._snapshotter.submit(self._copy, self.owner.capture(step))

    def before_step(self) -> None:
        if self._snapshot is None:
            return
        future, self._snapshot = self._snapshot, None
        if self._newest is not None:
            self._unpin(self._newest[1])
        self._newest = future.result()  # re-raises a failed copy here, on the training thread
        state, buf = self._newest
        every = self.owner.config.persist_every
        if every and state.step % every == 0:
            self._submit_persist(state, buf)

    def flush(self) -> None:
        self.before_step()
        for future in list(self._persists):
            future.result()
        self._collect_persists()

    def close(self) -> None:
        self.before_step()
        if self._newest is not None and self._persisted != self._newest[0].step:
            self._submit_persist(*self._newest)
        self._snapshotter.shutdown()
        self._persister.shutdown()
        self._collect_persists()
        _release_memory_tier(self.owner)

    # ------------------------------------------------------------------ helper threads

    def _copy(self, state: StageState) -> tuple[StageState, _Buffer]:
        """Snapshot thread: copy every tensor of ``state`` into a free buffer."""
        sources = state.all_tensors()
        buf = self._take_buffer(sources)
        for name, src in sources.items():
            buf.tensors[name].copy_(src)
        local = set(state.local_tensors)
        copied = StageState(
            step=state.step,
            tensors={k: v for k, v in buf.tensors.items() if k not in local},
            local_tensors={k: v for k, v in buf.tensors.items() if k in local},
            metadata=state.metadata,
        )
        return copied, buf

    def _take_buffer(self, sources: dict[str, torch.Tensor]) -> _Buffer:
        # The buffer of the newest snapshot is pinned until the next one is taken: it is what a
        # close() persists.
        with self._cond:
            while True:
                for buf in self._buffers:
                    if buf.pins == 0 and _same_shapes(buf.tensors, sources):
                        buf.pins = 1
                        return buf
                if len(self._buffers) < 3:
                    break  # newest + one being persisted + the one to write
                self._cond.wait()
        buf = _Buffer({k: torch.empty(v.shape, dtype=v.dtype, device="cpu")
                       for k, v in sources.items()}, pins=1)
        with self._cond:
            self._buffers.append(buf)
        return buf

    def _unpin(self, buf: _Buffer) -> None:
        with self._cond:
            buf.pins -= 1
            self._cond.notify_all()

    def _submit_persist(self, state: StageState, buf: _Buffer) -> None:
        with self._cond:
            buf.pins += 1
        self._persisted = state.step
        self._persists.append(self._persister.submit(self._persist, state, buf))

    def _persist(self, state: StageState, buf: _Buffer) -> PersistResult:
        """Persist thread: write ``state`` to the durable tier (collective on its group)."""
        try:
            self.durable.save(state)
            return PersistResult(state.step, True)
        except (OSError, ValueError, CheckpointError) as e:
            # Storage trouble is reported per step (as the bubble mode's persister does).
            return PersistResult(state.step, False, str(e))
        finally:
            self._unpin(buf)

    def _collect_persists(self) -> None:
        """Move finished persists to ``results``; warn about failed ones, re-raise crashes."""
        pending = []
        for f in self._persists:
            if not f.done():
                pending.append(f)
                continue
            result = f.result()
            if not result.persisted:
                warnings.warn(f"background persist of step {result.step} failed: "
                              f"{result.error}", stacklevel=2)
            self.results.append(result)
        self._persists = pending


def _same_shapes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in b)


# ---------------------------------------------------------------------------------- dcp-async


class DcpAsyncSave(SnapshotStrategy):
    """``dcp.async_save`` into the durable tier, one save in flight (module docstring).

    Writes the durable tier's layout: DCP's files of the step, each rank's JSON (metadata and
    rank-local tensors), then the commit marker via ``DurableTier.commit``. A helper thread waits
    for the upload, writes the JSON and commits; every collective of a save and its commit runs
    on the persist group, one save after the other, so they never interleave.
    """

    name = "dcp-async"

    def __init__(self, owner: Checkpointer) -> None:
        self.owner = owner
        self.durable = _durable(owner)
        self._committer = ThreadPoolExecutor(1, thread_name_prefix="bubbleguard-dcp-commit")
        self._inflight: Future[PersistResult] | None = None
        self.results: list[PersistResult] = []

    def after_step(self, step: int) -> None:
        if step % self.owner.config.every:
            return
        self._wait()  # one save in flight: the next one waits for the previous (blocking)
        state = self.owner.capture(step)
        durable = self.durable
        step_dir = durable.step_dir(step)
        writer = (FileSystemWriter(step_dir) if is_local(durable.fs)
                  else FsspecWriter(durable.fs.unstrip_protocol(step_dir)))
        # Staging (the copy to CPU memory) happens inside this call, on the training thread.
        upload = dcp.async_save(dict(state.tensors), storage_writer=writer,
                                process_group=durable.group, no_dist=not durable.distributed)
        assert isinstance(upload, Future)  # the default stager blocks: a plain Future comes back
        self._inflight = self._committer.submit(self._commit, state, upload)

    def flush(self) -> None:
        self._wait()

    def close(self) -> None:
        self._wait()
        self._committer.shutdown()
        _release_memory_tier(self.owner)

    def _wait(self) -> None:
        if self._inflight is None:
            return
        result = self._inflight.result()
        self._inflight = None
        if not result.persisted:
            warnings.warn(f"dcp-async checkpoint of step {result.step} failed: {result.error}",
                          stacklevel=3)
        self.results.append(result)

    def _commit(self, state: StageState, upload: Future[Any]) -> PersistResult:
        """Committer thread: rank JSON, wait for DCP, agree, commit (collective on the group)."""
        durable = self.durable
        error: str | None = None
        try:
            durable.fs.makedirs(durable.step_dir(state.step), exist_ok=True)
            write_json(durable.fs, f"{durable.step_dir(state.step)}/rank-{durable.rank:05d}.json",
                       {"format": RANK_FORMAT, "rank": durable.rank,
                        "num_ranks": durable.num_ranks, "step": state.step,
                        "metadata": dict(state.metadata),
                        "local_tensors": {k: encode_tensor(v)
                                          for k, v in state.local_tensors.items()},
                        "tensor_names": sorted(state.tensors)})
        except OSError as e:
            error = f"rank JSON: {e}"
        try:
            upload.result()
        except Exception as e:  # noqa: BLE001 -- DCP wraps storage errors in its own types
            error = error or f"async_save: {e}"
        # Every rank's JSON and data are in (or some rank failed): decide together, then commit.
        if not _all_ranks_ok(durable, error is None):
            return PersistResult(state.step, False, error or "another rank failed to save")
        try:
            durable.commit(state.step)
        except (OSError, CheckpointError) as e:
            return PersistResult(state.step, False, str(e))
        return PersistResult(state.step, True)


def _all_ranks_ok(durable: DurableTier, ok: bool) -> bool:
    if not durable.distributed:
        return ok
    flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=durable.group)
    return bool(flag.item())

