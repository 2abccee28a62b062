"""Durable tier: checkpoints in the ``torch.distributed.checkpoint`` (DCP) format.

Layout under ``root`` (a local path or an fsspec URL)::

    <root>/step-00000042/.metadata          DCP's global metadata (written by DCP's coordinator)
    <root>/step-00000042/__<r>_0.distcp     DCP's data files
    <root>/step-00000042/rank-00000.json    our per-rank JSON: metadata + rank-local tensors (RNG)
    <root>/step-00000042/COMMITTED.json     our commit marker, written last

The DCP part holds the shareable tensors, keyed by whole-model FQN (``optim.<fqn>.<key>`` for the
optimizer state). Every pipeline stage saves disjoint FQNs, so one checkpoint holds the whole model;
it loads into any number of stages, and plain ``torch.distributed.checkpoint.load`` and
``format_utils.dcp_to_torch_save`` read it.

Call order (every rank of ``process_group``, same steps, same order)::

    tier = DurableTier(root, process_group=group, keep_last=3)
    tier.write(state)   # collective: per-rank JSON, then dcp.save on `group`
    tier.commit(step)   # collective: rank 0 checks .metadata and every rank's JSON, syncs
                        # .metadata, writes the marker, applies retention, and tells every
                        # rank the outcome
    # or tier.save(state) for both.

Readers (any process, no process group): ``latest()``, ``read(step, select=...)``,
``checkpoints()``. A step directory without a valid marker is reported as incomplete and never
read.

Decisions on bad input: a missing root is created (with parents) on the first write; a root that
is a file raises NotADirectoryError; an unwritable root raises PermissionError and a full disk
OSError(ENOSPC), both naming the directory and the previous checkpoint, which stays in place (the
half-written step directory is removed). Retention never deletes the newest committed checkpoint:
it goes only after a newer commit.

Retention makes room *before* a write: the checkpoints beyond the newest ``keep_last - 1`` (and
older half-written ones) are deleted just before step k is written, so that the new files take
the page-cache pages the deleted ones just gave back. On a VM that hands free memory back to its
host (virtio free page reporting, seconds after it is freed), pages freed at the previous
persist are the host's again, and writing into them faults on the host: on the dev VM a 44 MB
file written 4 s after another was deleted took 28-125 ms of kernel time (0.35-1.6 GB/s),
against 13-17 ms right after the delete (a scratch script, 5 tries each); kernel time that a
persist helper spends on the ranks' cores, where kernel code is not preempted. With
``keep_last=1`` the only committed checkpoint stays until the new one commits, as always.

A write that replays a layout (``reuse_layout``) does not even delete: rank 0 deletes the oldest
of those checkpoints' marker and moves its directory to ``<root>/.recycled``, and every rank
moves its data file from there into the new step directory and overwrites it in place, when its
name and size are the new file's (same layout: every byte is rewritten); what is left there is
deleted after the commit. Overwriting a file's cached pages frees and allocates no pages and no
disk blocks: on the dev VM (ext4), deleting a 44 MB file and writing and syncing a new one took
24-27 ms of kernel time, overwriting it in place 12-13 ms (a scratch script, medians of 7-12
tries, 1 s and 4 s apart).
"""

from __future__ import annotations

import base64
import errno
import os
import re
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from bubbleguard.checkpoint.atomic import fsync_path
from bubbleguard.checkpoint.errors import (
    CheckpointError,
    CorruptSnapshotError,
    IncompleteCheckpointError,
)
from bubbleguard.checkpoint.layout import dtype_from_str
from bubbleguard.checkpoint.manifest import (
    MARKER_NAME,
    CommitMarker,
    RankPart,
    filesystem,
    is_local,
    read_json,
    read_marker,
    write_json,
    write_marker,
)
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.base import Tier
from bubbleguard.checkpoint.tiers.dcp_layout import DcpLayout, LayoutError

RANK_FORMAT = "bubbleguard-durable-rank/1"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_RECYCLED = ".recycled"  # not a step directory: readers and discovery never look inside


@dataclass(frozen=True)
class DurableCheckpointInfo:
    """What discovery found in one step directory.

    Attributes:
        step: the step number from the directory name.
        path: the directory (path or URL).
        committed: True only with a valid marker and DCP metadata.
        reason: why it is not committed (None when it is).
        num_ranks: ranks that wrote it (from the marker), if committed.
        size_bytes: bytes of all files in the directory.
    """

    step: int
    path: str
    committed: bool
    reason: str | None
    num_ranks: int | None
    size_bytes: int


class DurableTier(Tier):
    """DCP checkpoints under a local path or fsspec URL; see the module docstring.

    Args:
        root: directory or fsspec URL (``s3://bucket/run1``, ``memory://x``).
        process_group: the group whose ranks write together; default: the default group when
            ``torch.distributed`` is initialised, else a single process. A background persist
            must pass its own gloo group (see ``persist.py``).
        keep_last: committed checkpoints to keep (>= 1).
        reuse_layout: after a first ``dcp.save`` to local files, write each later state of the
            same layout by replaying that save's files (:mod:`dcp_layout`): the same DCP files
            for a fraction of the CPU time. Falls back to ``dcp.save`` whenever any rank's
            layout changed. Needs ``torch.serialization.set_crc32_options(False)`` in this
            process (a persist helper sets it), else every write is a ``dcp.save``.
    """

    kind = "durable"

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        process_group: dist.ProcessGroup | None = None,
        keep_last: int = 3,
        reuse_layout: bool = False,
    ) -> None:
        if keep_last < 1:
            raise ValueError(
                f"keep_last must be >= 1 (the newest checkpoint is always kept), got {keep_last}"
            )
        self.url = os.fspath(root)
        self.fs, self.root = filesystem(self.url)
        if self.fs.exists(self.root) and not self.fs.isdir(self.root):
            raise NotADirectoryError(f"checkpoint root {self.url} exists and is not a directory")
        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise ValueError("process_group given but torch.distributed is not initialised")
        self.rank = dist.get_rank(process_group) if self.distributed else 0
        self.num_ranks = dist.get_world_size(process_group) if self.distributed else 1
        self.keep_last = keep_last
        self.reuse_layout = reuse_layout and is_local(self.fs)
        self._layout: DcpLayout | None = None
        self.layout_error: str | None = None  # why the last save's layout cannot be replayed
        self.replayed = 0  # writes done by replaying a layout instead of dcp.save
        self.recycled = 0  # data files of this rank overwritten in place (module docstring)

    # ----------------------------------------------------------------- paths

    def step_dir(self, step: int) -> str:
        """Directory of ``step`` inside the root's filesystem."""
        return f"{self.root.rstrip('/')}/step-{step:08d}"

    @property
    def _recycled_dir(self) -> str:
        """Where rank 0 moves the checkpoint that a replayed write overwrites in place."""
        return f"{self.root.rstrip('/')}/{_RECYCLED}"

    def _rank_file(self, step: int, rank: int) -> str:
        return f"{self.step_dir(step)}/rank-{rank:05d}.json"

    # ----------------------------------------------------------------- writing

    def save(self, state: StageState) -> None:
        """:meth:`write` then :meth:`commit` (collective)."""
        self.write(state)
        self.commit(state.step)

    def write(self, state: StageState) -> None:
        """Store this rank's part of ``state.step``: per-rank JSON, then the DCP save.

        Collective over the process group. Raises on every rank if any rank fails. A step that
        is already committed is left alone (every rank sees the same marker and returns).
        """
        if self._is_committed(state.step):
            return
        if self.rank == 0:
            self._make_room(state.step)
        step_dir = self.step_dir(state.step)
        try:
            self.fs.makedirs(step_dir, exist_ok=True)
            write_json(
                self.fs,
                self._rank_file(state.step, self.rank),
                {
                    "format": RANK_FORMAT,
                    "rank": self.rank,
                    "num_ranks": self.num_ranks,
                    "step": state.step,
                    "metadata": dict(state.metadata),
                    "local_tensors": {k: _encode(v) for k, v in state.local_tensors.items()},
                    "tensor_names": sorted(state.tensors),
                },
                compact=True,  # indenting it took 2 ms of a persist's CPU (Python's encoder)
            )
            local_error: BaseException | None = None
        except OSError as e:
            local_error = e
        # Everyone enters dcp.save or nobody does: a rank alone in it would wait forever.
        if not self._all_ok(local_error is None):
            self._discard(state.step)
            raise self._storage_error(local_error, state.step) from local_error
        tensors = {k: v.detach() for k, v in state.tensors.items()}
        if self.reuse_layout and self._all_ok(
                self._layout is not None and self._layout.matches(tensors)):
            self._replay(state.step, tensors)
            return
        writer: FileSystemWriter | FsspecWriter = (
            FileSystemWriter(step_dir)
            if is_local(self.fs)
            else FsspecWriter(self._url_of(step_dir))
        )
        try:
            with _quiet_single_process():
                metadata = dcp.save(
                    tensors,
                    storage_writer=writer,
                    process_group=self.group,
                    no_dist=not self.distributed,
                )
        except CheckpointException as e:
            self._discard(state.step)
            raise self._storage_error(e, state.step) from None
        except OSError as e:
            self._discard(state.step)
            raise self._storage_error(e, state.step) from e
        if self.reuse_layout:
            self._learn(step_dir, metadata, tensors)

    def _learn(self, step_dir: str, metadata: Any, tensors: dict[str, torch.Tensor]) -> None:
        """Keep the layout of the save just made, or why it cannot be replayed."""
        self._layout = None
        try:
            self._layout = DcpLayout.learn(step_dir, metadata, tensors, self.rank)
            self.layout_error = None
        except (LayoutError, OSError) as e:
            self.layout_error = str(e)

    def _replay(self, step: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write ``step`` by replaying the learned layout (every rank agreed it matches)."""
        assert self._layout is not None
        step_dir = self.step_dir(step)
        error: OSError | None = None
        try:
            self.recycled += self._layout.write_files(step_dir, tensors, self._recycled_dir)
        except OSError as e:
            error = e
        written = self._all_ok(error is None)
        if written and self.rank == 0:  # .metadata last, as DCP's coordinator writes it
            try:
                self._layout.write_metadata(step_dir)
            except OSError as e:
                error = e
        if not written or not self._all_ok(error is None, src=0):
            self._discard(step)
            self._layout = None  # the next write is a dcp.save again, on every rank
            raise self._storage_error(error, step) from error
        self.replayed += 1

    def commit(self, step: int) -> None:
        """Rank 0 checks DCP's metadata and every rank's JSON, then writes the marker.

        Collective. Afterwards rank 0 deletes checkpoints beyond ``keep_last`` (and half-written
        ones older than ``step``). Raises on every rank if the commit failed.
        """
        error: BaseException | None = None
        if self.rank == 0 and not self._is_committed(step):
            try:
                self._write_marker(step)
            except (OSError, CheckpointError) as e:
                error = e
        if not self._all_ok(error is None, src=0):
            if self.rank == 0:
                self._discard(step)
            raise (
                self._storage_error(error, step)
                if error is not None
                else CheckpointError(
                    f"rank 0 could not commit step {step} in {self.url}; see rank 0's log"
                )
            )
        if self.rank == 0:
            self._retain()

    def _is_committed(self, step: int) -> bool:
        try:
            return read_marker(self.fs, self.step_dir(step)).step == step
        except (FileNotFoundError, CorruptSnapshotError):
            return False

    def _write_marker(self, step: int) -> None:
        step_dir = self.step_dir(step)
        if not self.fs.exists(f"{step_dir}/.metadata"):
            raise IncompleteCheckpointError(f"{step_dir}: DCP metadata .metadata is missing")
        parts = []
        for r in range(self.num_ranks):
            path = self._rank_file(step, r)
            if not self.fs.exists(path):
                raise IncompleteCheckpointError(f"{step_dir}: rank {r}'s {path} is missing")
            parts.append(RankPart(r, 0, f"{self.fs.size(path)}"))
        if is_local(self.fs):
            # DCP syncs .metadata before it flushes the buffered stream it pickled it into: a
            # pickle under the buffer's 8 KiB (a small model's) is not on disk when DCP returns.
            # On disk before the marker says the checkpoint is complete.
            fsync_path(f"{step_dir}/.metadata")
        write_marker(self.fs, step_dir, CommitMarker("durable", step, self.num_ranks, tuple(parts)))

    def _retain(self) -> None:
        self._clear_recycled()
        for old in self._doomed(keep=self.keep_last):
            self._discard(old)

    def _make_room(self, step: int) -> None:
        """Before writing ``step``: delete what retention will delete once it commits (see the
        module docstring); at least the newest committed checkpoint stays. With a layout to
        replay, the oldest of them is moved aside for the write to overwrite instead."""
        doomed = self._doomed(keep=max(self.keep_last - 1, 1), before=step)
        self._clear_recycled()
        if doomed and self._layout is not None:
            self._recycle(doomed.pop(0))
        for old in doomed:
            self._discard(old)

    def _doomed(self, keep: int, before: int | None = None) -> list[int]:
        """The steps older than ``before`` (default: up to the newest committed one) but the
        newest ``keep`` committed ones, oldest first."""
        infos = self.checkpoints()
        if before is None:
            newest = [i.step for i in infos if i.committed][-1:]
            before = newest[0] + 1 if newest else 0
        infos = [i for i in infos if i.step < before]
        committed = [i.step for i in infos if i.committed]
        return sorted(set(committed[:-keep]) | {i.step for i in infos if not i.committed})

    def _recycle(self, step: int) -> None:
        """Move ``step``'s directory to the recycled one, its marker deleted first (a crash
        midway leaves an incomplete step, never a committed one with files missing)."""
        path = self.step_dir(step)  # a local path: only a local root replays layouts
        try:
            if os.path.lexists(f"{path}/{MARKER_NAME}"):
                os.remove(f"{path}/{MARKER_NAME}")
            os.rename(path, self._recycled_dir)
        except OSError:
            self._discard(step)

    def _clear_recycled(self) -> None:
        """Delete what the last write did not take from the recycled directory."""
        if self.reuse_layout and os.path.lexists(self._recycled_dir):
            try:
                self.fs.rm(self._recycled_dir, recursive=True)
            except OSError:
                pass  # best effort, as in _discard; the next write tries again

    def _discard(self, step: int) -> None:
        path = self.step_dir(step)
        try:
            if self.fs.exists(path):
                # The marker first: a directory half deleted (or a crash midway) then reads as
                # incomplete, never as a committed checkpoint with files missing.
                if self.fs.exists(f"{path}/{MARKER_NAME}"):
                    self.fs.rm(f"{path}/{MARKER_NAME}")
                self.fs.rm(path, recursive=True)
        except OSError:
            pass  # best effort: an incomplete directory is ignored by readers anyway

    def _all_ok(self, ok: bool, src: int | None = None) -> bool:
        """True iff ``ok`` on every rank (``src`` given: rank ``src``'s verdict)."""
        if not self.distributed:
            return ok
        flag = torch.tensor([1 if ok else 0], dtype=torch.int64)
        if src is None:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        else:
            dist.broadcast(flag, group_src=src, group=self.group)
        return bool(flag.item())

    def _storage_error(self, e: BaseException | None, step: int) -> BaseException:
        previous = self.latest()
        kept = (
            f"the previous checkpoint (step {previous}) is kept"
            if previous is not None
            else "no earlier checkpoint exists"
        )
        where = f"writing checkpoint step {step} to {self.url}"
        cause = _first_os_error(e)
        if cause is None:
            if e is None:
                return CheckpointError(f"{where} failed on another rank; {kept}")
            if isinstance(e, CheckpointError):
                return e
            return CheckpointError(f"{where} failed: {e}; {kept}")
        if cause.errno == errno.ENOSPC:
            return OSError(
                errno.ENOSPC,
                f"no space left on device {where}; {kept}. Free space or lower keep_last",
            )
        if cause.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return PermissionError(
                cause.errno, f"{self.url} is not writable ({cause.strerror}) while {where}; {kept}"
            )
        return OSError(cause.errno, f"{where} failed: {cause}; {kept}")

    # ----------------------------------------------------------------- reading

    def checkpoints(self) -> list[DurableCheckpointInfo]:
        """Every step directory under the root, oldest first, with its validity.

        Safe while another process writes or applies retention (a persist helper does both):
        a directory deleted after the root was listed is left out, not reported as broken.
        """
        if not self.fs.exists(self.root):
            return []
        out = []
        for entry in self.fs.ls(self.root, detail=True):
            name = entry["name"].rstrip("/").rsplit("/", 1)[-1]
            m = _STEP_DIR.match(name)
            if not m or entry["type"] != "directory":
                continue
            step = int(m.group(1))
            path = self.step_dir(step)
            try:
                size = sum(int(f["size"]) for f in self.fs.ls(path, detail=True)
                           if f["type"] == "file")
            except FileNotFoundError:
                continue  # deleted (retention) since the root was listed
            try:
                marker = read_marker(self.fs, path)
                if marker.step != step:
                    raise CorruptSnapshotError(f"{path}: marker names step {marker.step}")
                if not self.fs.exists(f"{path}/.metadata"):
                    raise CorruptSnapshotError(f"{path}: marker present but DCP .metadata missing")
                out.append(
                    DurableCheckpointInfo(
                        step, self._url_of(path), True, None, marker.num_ranks, size
                    )
                )
            except (IncompleteCheckpointError, CorruptSnapshotError) as e:
                if not self.fs.exists(path):
                    continue  # deleted while we read it
                out.append(
                    DurableCheckpointInfo(step, self._url_of(path), False, str(e), None, size)
                )
        return sorted(out, key=lambda i: i.step)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        committed = [i.step for i in self.checkpoints() if i.committed]
        return committed[-1] if committed else None

    def tensor_names(self, step: int) -> list[str]:
        """Names of the tensors stored for ``step`` (all ranks together)."""
        return sorted(self._dcp_metadata(step).state_dict_metadata)

    def read(
        self,
        step: int | None = None,
        *,
        select: Callable[[str], bool] | None = None,
        rank: int | None = None,
    ) -> StageState:
        """Load ``step`` (default: latest committed) for one stage, without a process group.

        Args:
            step: the step; it must be committed.
            select: which tensors to load (e.g. ``state.stage_selector(stage)``); default all.
            rank: whose rank-local state (RNG, data cursor, scheduler) to take; default this
                tier's rank. A rank the checkpoint does not have (fewer ranks saved it) gets
                rank 0's. Optimizer hyperparameters are merged from all ranks by FQN.

        Raises:
            FileNotFoundError: no committed checkpoint (IncompleteCheckpointError: that step is
                half-written).
        """
        if step is None:
            step = self.latest()
            if step is None:
                partial = [i.step for i in self.checkpoints()]
                raise FileNotFoundError(
                    f"no committed checkpoint under {self.url}"
                    + (f" (incomplete step directories: {partial})" if partial else "")
                )
        path = self.step_dir(step)
        marker = read_marker(self.fs, path)
        meta = self._dcp_metadata(step)
        tensors: dict[str, torch.Tensor] = {}
        for name, item in meta.state_dict_metadata.items():
            if isinstance(item, TensorStorageMetadata) and (select is None or select(name)):
                tensors[name] = torch.empty(item.size, dtype=item.properties.dtype)
        if tensors:
            with _quiet_single_process():
                dcp.load(tensors, storage_reader=self._reader(path), no_dist=True)
        ranks = [read_json(self.fs, self._rank_file(step, r)) for r in range(marker.num_ranks)]
        own = ranks[
            rank
            if rank is not None and rank < len(ranks)
            else (self.rank if self.rank < len(ranks) else 0)
        ]
        metadata = dict(own["metadata"])
        optims = [r["metadata"].get("optimizer") for r in ranks if r["metadata"].get("optimizer")]
        if optims:
            metadata["optimizer"] = {
                "param_groups": [g for o in optims for g in o["param_groups"]],
                "non_tensor_state": {
                    k: v for o in optims for k, v in o.get("non_tensor_state", {}).items()
                },
            }
        local = {k: _decode(v) for k, v in own["local_tensors"].items()}
        return StageState(step=step, tensors=tensors, local_tensors=local, metadata=metadata)

    def _dcp_metadata(self, step: int) -> Any:
        try:
            return self._reader(self.step_dir(step)).read_metadata()
        except FileNotFoundError:
            raise IncompleteCheckpointError(f"{self.step_dir(step)} has no DCP .metadata") from None

    def _reader(self, path: str) -> FileSystemReader | FsspecReader:
        return FileSystemReader(path) if is_local(self.fs) else FsspecReader(self._url_of(path))

    def _url_of(self, path: str) -> str:
        if is_local(self.fs):
            return path
        return self.fs.unstrip_protocol(path)


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    # DCP warns that it "assumes" a single process; here that is the documented intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _first_os_error(e: BaseException | None) -> OSError | None:
    """The first OSError inside ``e`` (DCP wraps per-rank failures)."""
    seen: set[int] = set()
    stack = [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno is not None:
            return x
        if isinstance(x, CheckpointException):
            stack.extend(exc for exc, _ in x.failures.values())
        stack.extend([x.__cause__, x.__context__])
    return None


def _encode(t: torch.Tensor) -> list[Any]:
    t = t.detach().to("cpu").contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return [str(t.dtype), list(t.shape), base64.b64encode(raw).decode("ascii")]


def _decode(obj: list[Any]) -> torch.Tensor:
    dtype, shape, data = obj
    raw = bytearray(base64.b64decode(data))
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    return flat.view(dtype_from_str(dtype)).reshape(shape).clone()
