"""Memory tier: per-rank snapshot buffers in node-local shared memory.

Files (directories 0700, files 0600 -- readable only by the job's user)::

    /dev/shm/bubbleguard-<uid>/<job_id>/COMMITTED.json       job-wide marker (see commit)
    /dev/shm/bubbleguard-<uid>/<job_id>/rank<r>/slot<i>.bin  snapshot bytes (one ChunkLayout region)
    /dev/shm/bubbleguard-<uid>/<job_id>/rank<r>/slot<i>.json "snapshot of step k complete" record

Each slot file is allocated once (create + ftruncate + mmap) and reused every step. With two slots
the newest complete snapshot stays valid while the next one is written: ``begin`` picks the slot
that does *not* hold it and deletes that slot's record first; ``finish`` writes the record
(checksum per chunk, layout, metadata) atomically after every chunk is in. The bytes live in
tmpfs pages, so a snapshot survives the crash of the process that wrote it.

Call order on each rank (runtime)::

    tier = MemoryTier(job_id, rank, num_ranks=P)           # once; maps nothing yet
    # after optimizer.step() k (or in the first bubble of iteration k+1):
    tier.begin(capture_state(stage, opt, sched, step=k))   # cheap, no copy
    tier.copy_chunk(i) ...                                 # from inside the bubbles of k+1
    tier.finish()                                          # once every chunk is in (a bubble),
                                                           # at the latest before optimizer.step()
                                                           # k+1: copies the rest, writes record
    # one process per node, once it knows every rank finished k (piggybacked on the step):
    tier.commit(k)

The next ``optimizer.step()`` must not start before ``finish()`` returns (parameters would change
under the copy); on a GPU, ``guard_copies()`` orders it after the queued copies on the device
instead, and ``finish()`` may come later (before the next ``begin``). With two slots, ``begin(k + 2)`` overwrites step k, so a rank must not begin k+2
before step k+1 is complete on every rank, or a crash in between leaves no common step; pass
``num_slots=3`` to be safe without that rule (pipeline ranks are never more than one snapshot
apart).

Resume: ``agree_newest_step(tier.valid_steps())`` (all ranks), then ``tier.read(step)``; or, in a
single process, ``tier.read_latest()``, which falls back to the older slot when the newest fails
its checksums.

On a GPU, chunks whose tensors are on CUDA are copied on a side stream straight into the shared
memory, registered as pinned host memory (``cudaHostRegister``): ``copy_chunk`` only queues the
copy (the copy engine runs it alongside compute) and the ``sum64`` of each piece it copies (the
device sums the words, so the host never reads the snapshot; ``layout.copy_chunk_device``); the
last chunk's also queues one readback of every piece's sum, and ``checksum_landed`` completes
all the chunks' checksums once it has landed (one event per snapshot, not one per chunk);
``finish`` waits for it. The copies are ordered after the work that produced the state:
``begin(state, after=event)`` with a CUDA event recorded right after ``optimizer.step()``, or,
without one, after everything queued on the current stream so far.

On the CPU each chunk is copied and checksummed in one pass: by the C extension with streaming
stores where it was built (``layout.copy_chunk_native``), else block by block through NumPy
(``layout.copy_chunk_checksummed``).
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import re
import shutil
import threading
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from bubbleguard.checkpoint.atomic import atomic_write_json, fsync_dir
from bubbleguard.checkpoint.checksum import MASK64, check_algorithm, checksum
from bubbleguard.checkpoint.errors import CorruptSnapshotError, IncompleteCheckpointError
from bubbleguard.checkpoint.layout import (
    DEFAULT_CHUNK_BYTES,
    NATIVE_COPY_AVAILABLE,
    ChunkLayout,
    copy_chunk,
    copy_chunk_checksummed,
    copy_chunk_device,
    copy_chunk_native,
    flat_bytes,
    tensors_from_region,
)
from bubbleguard.checkpoint.manifest import (
    MARKER_NAME,
    CommitMarker,
    RankPart,
    filesystem,
    read_marker,
    write_marker,
)
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.base import Tier

DEFAULT_SHM_ROOT = Path("/dev/shm")
RECORD_FORMAT = "bubbleguard-shm-record/1"
_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_SLOT_FILE = re.compile(r"^slot(\d{1,3})\.bin$")
V = TypeVar("V")


def shm_job_dir(job_id: str, root: str | os.PathLike[str] | None = None) -> Path:
    """``<root>/bubbleguard-<uid>/<job_id>`` (root defaults to ``/dev/shm``)."""
    if not _JOB_ID.match(job_id):
        raise ValueError(
            f"job_id {job_id!r} must be 1-128 characters of letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return (
        Path(root if root is not None else DEFAULT_SHM_ROOT) / f"bubbleguard-{os.getuid()}" / job_id
    )


def remove_job(job_id: str, root: str | os.PathLike[str] | None = None) -> None:
    """Delete every rank's snapshots of ``job_id`` (call once the job is over)."""
    shutil.rmtree(shm_job_dir(job_id, root), ignore_errors=True)


@dataclass(frozen=True)
class SnapshotRecord:
    """The "snapshot of step k complete" record of one rank's slot.

    Attributes:
        step: the snapshot's step.
        rank: the rank that wrote it.
        slot: the slot index.
        checksum: algorithm (``"sum64"`` or ``"crc32"``).
        checksums: one per chunk of ``layout``.
        layout: where each tensor lies in the slot file.
        local_names: names in ``layout`` that are rank-local (RNG) rather than shareable.
        metadata: the state's JSON metadata.
    """

    step: int
    rank: int
    slot: int
    checksum: str
    checksums: tuple[int, ...]
    layout: ChunkLayout
    local_names: tuple[str, ...]
    metadata: dict[str, Any] = field(compare=False)

    @property
    def digest(self) -> str:
        """A short fingerprint of the chunk checksums."""
        return _digest(self.checksums)

    @property
    def part(self) -> RankPart:
        """This rank's part of a commit marker of its step."""
        return RankPart(self.rank, self.layout.total_bytes, self.digest)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON form."""
        return {
            "format": RECORD_FORMAT,
            "step": self.step,
            "rank": self.rank,
            "slot": self.slot,
            "checksum": self.checksum,
            "checksums": list(self.checksums),
            "layout": self.layout.to_json(),
            "local_names": list(self.local_names),
            "metadata": self.metadata,
        }

    @staticmethod
    def from_json(obj: dict[str, Any]) -> SnapshotRecord:
        """Parse :meth:`to_json` output; ValueError/KeyError/TypeError if malformed."""
        if obj.get("format") != RECORD_FORMAT:
            raise ValueError(f"unknown record format {obj.get('format')!r}")
        layout = ChunkLayout.from_json(obj["layout"])
        sums = tuple(int(c) for c in obj["checksums"])
        if len(sums) != layout.num_chunks:
            raise ValueError(f"{len(sums)} checksums for {layout.num_chunks} chunks")
        return SnapshotRecord(
            step=int(obj["step"]),
            rank=int(obj["rank"]),
            slot=int(obj["slot"]),
            checksum=check_algorithm(str(obj["checksum"])),
            checksums=sums,
            layout=layout,
            local_names=tuple(str(n) for n in obj["local_names"]),
            metadata=dict(obj["metadata"]),
        )


class _Slot:
    """One mapped slot file (internal)."""

    def __init__(self, path: Path, num_bytes: int) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            os.fchmod(fd, 0o600)
            # mmap of length 0 is not allowed: the file of an empty state holds one byte.
            file_bytes = max(num_bytes, 1)
            if os.fstat(fd).st_size != file_bytes:
                os.ftruncate(fd, file_bytes)
            self.mm = mmap.mmap(fd, file_bytes)
        finally:
            os.close(fd)
        self.num_bytes = num_bytes
        self.region = (
            torch.frombuffer(self.mm, dtype=torch.uint8)
            if num_bytes
            else torch.empty(0, dtype=torch.uint8)
        )
        self.cuda_registered = False
        # The layout whose padding was last zeroed in this mapping (native copies need zeros).
        self.zeroed_padding_of: ChunkLayout | None = None

    def zero_padding(self, layout: ChunkLayout) -> None:
        """Zero ``layout``'s padding bytes, unless they already are for this layout."""
        if self.zeroed_padding_of == layout:
            return
        region = self.region.numpy()
        for start, end in layout.padding():
            region[start:end] = 0
        self.zeroed_padding_of = layout

    def register_cuda(self) -> bool:
        """Pin the mapping for asynchronous device-to-host copies (once)."""
        if not self.cuda_registered and self.num_bytes:
            rc = torch.cuda.cudart().cudaHostRegister(self.region.data_ptr(), self.num_bytes, 0)
            self.cuda_registered = int(rc) == 0
            if not self.cuda_registered:
                warnings.warn(
                    f"cudaHostRegister of {self.path} failed ({rc}); copies will block",
                    stacklevel=3,
                )
        return self.cuda_registered

    def close(self) -> None:
        if self.cuda_registered:
            torch.cuda.cudart().cudaHostUnregister(self.region.data_ptr())
            self.cuda_registered = False
        del self.region
        try:
            self.mm.close()
        except BufferError:
            pass  # a view of the region is still alive somewhere; the mapping goes with it


class _PieceSums:
    """Where the device writes the ``sum64`` of every piece (chunk x tensor) of a layout.

    One ``int64`` entry per piece on the device, in chunk order, and its pinned host copy, read
    back with one copy once a snapshot's chunks are all queued; ``starts[c]`` is chunk ``c``'s
    first entry. Reused by every snapshot of the same layout and device.
    """

    def __init__(self, layout: ChunkLayout, device: torch.device) -> None:
        counts = [len(layout.segments(c)) for c in range(layout.num_chunks)]
        self.layout = layout
        self.starts = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))
        total = int(self.starts[-1])
        self.device = torch.zeros(total, dtype=torch.int64, device=device)
        self.host = torch.zeros(total, dtype=torch.int64, pin_memory=True)

    def of_chunk(self, chunk_id: int) -> torch.Tensor:
        return self.device[int(self.starts[chunk_id]) : int(self.starts[chunk_id + 1])]

    def chunk_sums(self) -> np.ndarray:
        """Each chunk's device part (modulo 2**64) from the host copy, once it has landed."""
        words = self.host.numpy().view(np.uint64)
        out = np.zeros(len(self.starts) - 1, dtype=np.uint64)
        nonempty = self.starts[:-1] < self.starts[1:]
        out[nonempty] = np.add.reduceat(words, self.starts[:-1][nonempty])
        return out


@dataclass
class _Active:
    """The snapshot being written (internal)."""

    step: int
    slot: int
    layout: ChunkLayout
    local_names: tuple[str, ...]
    metadata: dict[str, Any]
    sources: dict[str, torch.Tensor]
    region: torch.Tensor
    done: list[bool]
    checksums: list[int | None]
    cuda: bool
    sources_np: dict[str, np.ndarray] | None = None
    region_np: np.ndarray | None = None
    sources_address: dict[str, int] | None = None  # native copies
    region_address: int = 0
    # Device copies: each chunk's host part of its checksum (its device part is in
    # piece_sums); None: checksummed on the host once landed (crc32, misaligned).
    partial_sums: list[int | None] = field(default_factory=list)
    piece_sums: _PieceSums | None = None
    num_queued: int = 0
    landed: Any = None  # a CUDA event after every copy and the sums' readback
    checksummed: bool = False  # device copies: checksum_landed is done


class MemoryTier(Tier):
    """Two (or more) snapshot slots per rank in ``/dev/shm``; see the module docstring.

    Args:
        job_id: names the job's directory (letters, digits, ``._-``).
        rank: this process's rank.
        num_ranks: ranks of the job (used by :meth:`commit`).
        root: parent of ``bubbleguard-<uid>`` (default ``/dev/shm``; tests pass a temp dir).
        num_slots: slots per rank, >= 2.
        checksum: ``"sum64"`` (default, fast) or ``"crc32"``; see ``checksum.py``.
        chunk_bytes: chunk size of the layout (a multiple of 64).
        create: create the directories (writers); False for readers, which then get
            FileNotFoundError if the rank has no directory.
        native_copy: copy CPU chunks with the C extension (one pass, streaming stores); None
            (default): where it was built and the checksum is ``sum64``; False: through NumPy.

    Raises:
        ValueError: ``native_copy=True`` where the extension was not built or with ``crc32``.
    """

    kind = "memory"

    def __init__(
        self,
        job_id: str,
        rank: int = 0,
        *,
        num_ranks: int = 1,
        root: str | os.PathLike[str] | None = None,
        num_slots: int = 2,
        checksum: str = "sum64",
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        create: bool = True,
        native_copy: bool | None = None,
    ) -> None:
        if native_copy and checksum != "sum64":
            raise ValueError(f"native_copy computes sum64 checksums, not {checksum!r}")
        if native_copy and not NATIVE_COPY_AVAILABLE:
            raise ValueError("native_copy=True, but the C extension bubbleguard.checkpoint._copysum "
                             "was not built (install with a C compiler present)")
        if not 0 <= rank < num_ranks:
            raise ValueError(f"rank must be in [0, num_ranks={num_ranks}), got {rank}")
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (one to keep, one to write), got {num_slots}")
        self.job_dir = shm_job_dir(job_id, root)
        self.rank_dir = self.job_dir / f"rank{rank}"
        self.rank = rank
        self.num_ranks = num_ranks
        self.num_slots = num_slots
        self.checksum = check_algorithm(checksum)
        self.chunk_bytes = chunk_bytes
        self.native_copy = (NATIVE_COPY_AVAILABLE and checksum == "sum64"
                            if native_copy is None else native_copy)
        if create:
            if not self.job_dir.parent.parent.is_dir():
                raise FileNotFoundError(
                    f"shared-memory root {self.job_dir.parent.parent} does not exist; "
                    "pass root= a tmpfs directory (default /dev/shm)"
                )
            for d in (self.job_dir.parent, self.job_dir, self.rank_dir):
                _private_dir(d)
        elif not self.rank_dir.is_dir():
            raise FileNotFoundError(
                f"no memory-tier snapshots for rank {rank}: {self.rank_dir} does not exist"
            )
        # The files are the truth: a writer may have used more slots than asked for here (a
        # resume or `bubbleguard inspect` reads them all). A reader opened before the writer
        # made its files (the persist helper) is told the number instead.
        found = [int(m.group(1)) for p in self.rank_dir.glob("slot*.bin")
                 if (m := _SLOT_FILE.match(p.name))] if self.rank_dir.is_dir() else []
        num_slots = self.num_slots = max(num_slots, max(found, default=-1) + 1)
        self._slots: list[_Slot | None] = [None] * num_slots
        # Record files are re-read before every hold (a persist) and commit try; each is parsed
        # once (rebuilding a record's layout took ~1.5 ms of a persist's CPU per slot, on the
        # rank's bubble thread and again in the helper).
        self._parsed_records = _ParsedFiles[SnapshotRecord | None]()
        self._summaries = _ParsedFiles[tuple[int, RankPart] | None]()  # commit(): no layout
        self._records: list[SnapshotRecord | None] = [
            self._load_record(i) for i in range(num_slots)
        ]
        self._pins = [0] * num_slots
        # mapped(): read-only mappings of the slot files, by slot: ((inode, size), mapping).
        self._read_maps: dict[int, tuple[tuple[int, int], mmap.mmap]] = {}
        self._cond = threading.Condition(threading.RLock())
        self._writing_slot: int | None = None
        self._layout: ChunkLayout | None = None
        self._active: _Active | None = None
        self._stream: Any = None
        self._piece_sums: _PieceSums | None = None

    # ----------------------------------------------------------------- writing

    def begin(self, state: StageState, *, after: Any = None) -> ChunkLayout:
        """Start the snapshot of ``state.step`` in the slot not holding the newest one.

        Cheap: no bytes are copied. Waits if that slot is being read (a pinned persist). A
        previous ``begin`` without ``finish`` is abandoned (its slot has no record).

        Args:
            state: the state to copy (tensors by reference; on the CPU or a CUDA device).
            after: for CUDA tensors, a ``torch.cuda.Event`` recorded once the state was final
                (right after ``optimizer.step()``); the copies wait for it and for nothing
                queued later. None: they wait for everything queued on the current stream.

        Returns:
            The layout (reused while shapes stay the same); the runtime plans its chunks.
        """
        tensors = state.all_tensors()
        if self._layout is None or not self._layout.matches(tensors):
            self._layout = ChunkLayout.build(tensors, self.chunk_bytes)
        layout = self._layout
        with self._cond:
            slot = self._pick_slot()
            self._records[slot] = None
            self._writing_slot = slot
        record_path = self._record_path(slot)
        if record_path.exists():
            record_path.unlink()
            fsync_dir(self.rank_dir)
        mapped = self._map(slot, layout.total_bytes)
        sources = {name: flat_bytes(t) for name, t in tensors.items()}
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        use_cuda = device is not None
        if device is not None:
            mapped.register_cuda()
            if self._stream is None or self._stream.device != device:
                self._stream = torch.cuda.Stream(device=device)
            # Copies read what optimizer.step() just wrote: order them after it. A tensor that
            # is not contiguous was just copied by flat_bytes on the current stream, so then
            # the copies wait for that stream's work so far.
            if after is not None and all(t.is_contiguous() for t in tensors.values() if t.is_cuda):
                self._stream.wait_event(after)
            else:
                self._stream.wait_stream(torch.cuda.current_stream(device))
        native = self.native_copy and not use_cuda
        piece_sums = None
        if native or (use_cuda and self.checksum == "sum64"):
            # The native copy and device checksums sum the tensors' bytes only.
            mapped.zero_padding(layout)
        if device is not None and self.checksum == "sum64":
            piece_sums = self._piece_sums
            if piece_sums is None or piece_sums.layout is not layout or \
                    piece_sums.device.device != device:
                piece_sums = self._piece_sums = _PieceSums(layout, device)
            with torch.cuda.stream(self._stream):
                piece_sums.device.zero_()  # host pieces' entries stay zero
        self._active = _Active(
            step=state.step,
            slot=slot,
            layout=layout,
            local_names=tuple(state.local_tensors),
            metadata=json.loads(json.dumps(dict(state.metadata))),
            sources=sources,
            region=mapped.region,
            done=[False] * layout.num_chunks,
            checksums=[None] * layout.num_chunks,
            cuda=use_cuda,
            # CPU copies: one native pass each, or NumPy views (memcpy, then a checksum of each
            # cache-hot block).
            sources_np=None if use_cuda or native else {k: v.numpy() for k, v in sources.items()},
            region_np=None if use_cuda or native else mapped.region.numpy(),
            sources_address={k: v.data_ptr() for k, v in sources.items()} if native else None,
            region_address=mapped.region.data_ptr(),
            partial_sums=[None] * layout.num_chunks,
            piece_sums=piece_sums,
        )
        return layout

    def copy_chunk(self, chunk_id: int) -> int:
        """Copy one chunk of the active snapshot into shared memory (from inside a bubble).

        On the CPU the chunk's checksum is computed in the same pass (block by block, while the
        bytes are in the cache). On a GPU the copy and the device's sums of its pieces are only
        queued on the side stream (a few launches per tensor in the chunk, no wait); once every
        chunk is queued, so is the sums' readback, and :meth:`checksum_landed` or
        :meth:`finish` completes the checksums when it has landed.

        Returns:
            Bytes copied (0 if the chunk was already copied).
        """
        a = self._active
        if a is None:
            raise RuntimeError("copy_chunk() called without begin(): no snapshot is being written")
        if a.done[chunk_id]:
            return 0
        if a.cuda:
            sums = a.piece_sums
            with torch.cuda.stream(self._stream):
                queued = (copy_chunk_device(a.layout, chunk_id, a.sources, a.region,
                                            sums.of_chunk(chunk_id))
                          if sums is not None else None)
                if queued is None:  # crc32, or a misaligned device tensor: host checksum
                    n = copy_chunk(a.layout, chunk_id, a.sources, a.region, non_blocking=True)
                else:
                    n, a.partial_sums[chunk_id] = queued
                a.num_queued += 1
                if a.num_queued == a.layout.num_chunks:  # the last one: read the sums back
                    if sums is not None:
                        sums.host.copy_(sums.device, non_blocking=True)
                    a.landed = torch.cuda.Event()
                    a.landed.record()
        elif a.sources_address is not None:
            n, a.checksums[chunk_id] = copy_chunk_native(
                a.layout, chunk_id, a.sources_address, a.region_address
            )
        else:
            assert a.sources_np is not None and a.region_np is not None
            n, a.checksums[chunk_id] = copy_chunk_checksummed(
                a.layout, chunk_id, a.sources_np, a.region_np, self.checksum
            )
        a.done[chunk_id] = True
        return n

    @property
    def copies_async(self) -> bool:
        """Whether the active snapshot's copies are queued on a device stream (CUDA) rather
        than done by ``copy_chunk`` itself; its chunks then need :meth:`checksum_landed`."""
        return self._active is not None and self._active.cuda

    def guard_copies(self) -> None:
        """Make the current CUDA stream wait for every copy queued so far (no CPU wait).

        Call before queuing work that changes the state (the next ``optimizer.step()``): the
        device runs it only after the copies have read the state. Nothing to do on the CPU.
        """
        a = self._active
        if a is not None and a.cuda:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)

    @property
    def copies_in_flight(self) -> int:
        """Device copies queued but not checksummed yet (0 on the CPU)."""
        a = self._active
        return 0 if a is None or a.checksummed else a.num_queued

    def checksum_landed(self, *, wait: bool = True) -> bool:
        """Checksum every chunk of the active device snapshot once all its copies have landed.

        The device summed each piece as it copied it; this adds the sums read back (one copy
        behind the last chunk's) per chunk, so the host never reads the snapshot (it does
        with ``crc32`` or a misaligned tensor, which the device does not sum).

        Args:
            wait: wait for the copies to land; False: return False at once if they have not.

        Returns:
            Whether the chunks were checksummed now: False on the CPU (``copy_chunk``
            checksums as it copies), before every chunk is queued, or once done.
        """
        a = self._active
        if a is None or a.landed is None or not self.copies_in_flight:
            return False
        if not wait and not a.landed.query():
            return False
        a.landed.synchronize()
        device_parts = a.piece_sums.chunk_sums() if a.piece_sums is not None else None
        for chunk_id, partial in enumerate(a.partial_sums):
            if partial is not None:  # summed by the device, from the bytes it copied
                assert device_parts is not None
                a.checksums[chunk_id] = (partial + int(device_parts[chunk_id])) & MASK64
            else:
                start, end = a.layout.chunk_range(chunk_id)
                a.checksums[chunk_id] = checksum(a.region[start:end], self.checksum)
        a.checksummed = True
        return True

    def pending_chunks(self) -> list[int]:
        """Chunk ids of the active snapshot not copied yet (empty without one)."""
        a = self._active
        return [] if a is None else [i for i, d in enumerate(a.done) if not d]

    @property
    def active_step(self) -> int | None:
        """Step of the snapshot between ``begin`` and ``finish``, else None."""
        return None if self._active is None else self._active.step

    def finish(self) -> SnapshotRecord:
        """Copy the chunks the bubbles did not, then write the slot's record atomically.

        Blocking when chunks are left; call it before the next ``optimizer.step()``. Once every
        chunk is in, it only writes the record, so a runtime can call it from a bubble as soon
        as the last chunk is copied (see ``copier.py``): the snapshot is complete from then on.
        """
        a = self._active
        if a is None:
            raise RuntimeError("finish() called without begin(): no snapshot is being written")
        for chunk_id in self.pending_chunks():
            self.copy_chunk(chunk_id)
        self.checksum_landed()
        record = SnapshotRecord(
            step=a.step,
            rank=self.rank,
            slot=a.slot,
            checksum=self.checksum,
            checksums=tuple(c for c in a.checksums if c is not None),
            layout=a.layout,
            local_names=a.local_names,
            metadata=a.metadata,
        )
        assert len(record.checksums) == a.layout.num_chunks
        path = str(self._record_path(a.slot))
        atomic_write_json(path, record.to_json(), compact=True)
        # This process need not parse what it just wrote (hold() and commit() look it up).
        self._parsed_records.remember(path, record)
        self._summaries.remember(path, (record.step, record.part))
        with self._cond:
            self._records[a.slot] = record
            self._active = None
            self._writing_slot = None
        return record

    def write(self, state: StageState) -> None:
        """``begin`` + every chunk + ``finish`` at once (blocking)."""
        self.begin(state)
        self.finish()

    def commit(self, step: int) -> None:
        """Write the job-wide marker for ``step`` once every rank's record of it is in.

        Call from one process per node that knows every rank finished ``step`` (all ranks'
        directories must be on this node). Raises IncompleteCheckpointError naming the ranks
        without a complete record of ``step``.
        """
        parts = []
        lacking = []
        for r in range(self.num_ranks):
            # Runs from the bubbles, tried again in each wait until the last rank is done: a
            # summary of each record, not a validated layout (resume validates and verifies in
            # full), parsed once per record file; a try that finds nothing new only stats them.
            part = next((p for p in self._rank_summaries(r) if p[0] == step), None)
            if part is None:
                lacking.append(r)
            else:
                parts.append(part[1])
        if lacking:
            raise IncompleteCheckpointError(
                f"cannot commit step {step} of {self.job_dir}: ranks {lacking} have no complete snapshot of it"
            )
        fs, path = filesystem(str(self.job_dir))
        write_marker(fs, path, CommitMarker("memory", step, self.num_ranks, tuple(parts)))

    def _rank_summaries(self, rank: int) -> list[tuple[int, RankPart]]:
        """(step, commit-marker part) of every readable record of ``rank``, from the cache
        where the file has not changed since it was read."""
        out = []
        try:
            entries = sorted(os.scandir(self.job_dir / f"rank{rank}"), key=lambda e: e.name)
        except FileNotFoundError:
            return []
        for entry in entries:
            if entry.name.startswith("slot") and entry.name.endswith(".json"):
                summary = self._summaries.get(entry.path, lambda path: _record_summary(path, rank))
                if summary is not None:  # None: unreadable, or replaced since the listing
                    out.append(summary)
        return out

    # ----------------------------------------------------------------- reading

    def latest(self) -> int | None:
        """Step named by the job-wide marker, if this rank still holds it; else None."""
        fs, path = filesystem(str(self.job_dir))
        try:
            step = read_marker(fs, path).step
        except (FileNotFoundError, CorruptSnapshotError):
            return None
        return step if step in self.steps() else None

    def steps(self) -> list[int]:
        """Steps this rank holds complete records of, newest first (data not verified)."""
        with self._cond:
            self._refresh_records()
            return sorted((r.step for r in self._records if r is not None), reverse=True)

    def valid_steps(self) -> list[int]:
        """Steps whose data also passes its checksums, newest first (reads every slot)."""
        good = []
        for step in self.steps():
            try:
                self.read(step)
            except CorruptSnapshotError:
                continue
            good.append(step)
        return good

    def records(self) -> list[SnapshotRecord]:
        """This rank's complete records, newest first."""
        with self._cond:
            self._refresh_records()
            return sorted((r for r in self._records if r is not None), key=lambda r: -r.step)

    def read(self, step: int | None = None, *, out: torch.Tensor | None = None) -> StageState:
        """This rank's snapshot of ``step`` (default: :meth:`read_latest`), checksums verified.

        The returned tensors share one freshly read buffer, not the shared memory: ``out``
        (a flat ``uint8`` CPU tensor of at least the snapshot's size, reused by a caller that
        reads again and again) or a new one.

        Raises:
            FileNotFoundError: no complete snapshot of ``step`` on this rank.
            CorruptSnapshotError: a chunk fails its checksum (names the chunk and the file).
        """
        if step is None:
            return self.read_latest()
        with self.hold(step) as record:
            return read_snapshot(self.rank_dir, record, out=out)

    def read_latest(self) -> StageState:
        """The newest snapshot of this rank that passes its checksums.

        A newest snapshot that fails is skipped with a warning naming the chunk and the file,
        and the older slot's snapshot is returned instead.
        """
        records = self.records()
        if not records:
            raise FileNotFoundError(f"no complete memory-tier snapshot in {self.rank_dir}")
        first_error: CorruptSnapshotError | None = None
        for record in records:
            try:
                return self.read(record.step)
            except CorruptSnapshotError as e:
                warnings.warn(f"{e}; trying an older snapshot", stacklevel=2)
                first_error = first_error or e
        assert first_error is not None
        raise first_error

    @contextmanager
    def mapped(self, step: int) -> Iterator[StageState]:
        """This rank's snapshot of ``step``, checksums verified, as tensors over a read-only
        mapping of its slot file: no copy (the persist helper writes it to DCP from there).

        Valid inside the block only, and only while the writer leaves the slot alone: the
        writing rank pins it (:meth:`hold`, via the persister) until the helper is done.

        Raises:
            FileNotFoundError: no complete snapshot of ``step`` on this rank.
            CorruptSnapshotError: a chunk fails its checksum (names the chunk and the file).
        """
        with self.hold(step) as record:
            yield _verified_state(record, self._mapped_region(record),
                                  self._data_path(record.slot))

    @contextmanager
    def hold(self, step: int) -> Iterator[SnapshotRecord]:
        """Keep ``begin`` away from the slot of ``step`` while the block runs.

        Used by a background persist: pin at submit time, read later from another thread.
        """
        with self._cond:
            slot = self._slot_of(step)
            if slot is None:
                raise FileNotFoundError(
                    f"rank {self.rank} holds no complete snapshot of step {step} in {self.rank_dir} "
                    f"(it holds {self.steps()})"
                )
            self._pins[slot] += 1
            record = self._records[slot]
            assert record is not None
        try:
            yield record
        finally:
            with self._cond:
                self._pins[slot] -= 1
                self._cond.notify_all()

    # ----------------------------------------------------------------- lifetime

    def close(self) -> None:
        """Unmap the slots (the files stay)."""
        self._active = None
        self._writing_slot = None
        for i, s in enumerate(self._slots):
            if s is not None:
                s.close()
                self._slots[i] = None
        for _, mm in self._read_maps.values():
            _close_mapping(mm)
        self._read_maps.clear()

    def cleanup(self) -> None:
        """Close and delete this rank's snapshots; the job directory goes when it is empty."""
        self.close()
        shutil.rmtree(self.rank_dir, ignore_errors=True)
        marker = self.job_dir / MARKER_NAME
        if self.job_dir.is_dir() and not any(
            p.name.startswith("rank") for p in self.job_dir.iterdir()
        ):
            marker.unlink(missing_ok=True)
            try:
                self.job_dir.rmdir()
            except OSError:
                pass

    # ----------------------------------------------------------------- internals

    def _pick_slot(self) -> int:
        """Slot with the oldest (or no) record, never the newest one; waits out pins."""
        while True:
            order = sorted(
                range(self.num_slots),
                key=lambda i: -1 if self._records[i] is None else self._records[i].step,  # type: ignore[union-attr]
            )
            newest = order[-1] if self._records[order[-1]] is not None else None
            for i in order:
                if i != newest and self._pins[i] == 0:
                    return i
            self._cond.wait()

    def _map(self, slot: int, num_bytes: int) -> _Slot:
        current = self._slots[slot]
        if current is not None and current.num_bytes == num_bytes:
            return current
        if current is not None:
            current.close()
        self._slots[slot] = _Slot(self._data_path(slot), num_bytes)
        return self._slots[slot]  # type: ignore[return-value]

    def _mapped_region(self, record: SnapshotRecord) -> torch.Tensor:
        """The bytes of ``record``'s slot file, read-only, not verified.

        Each slot's mapping is kept for the next persist while its file is the same (inode and
        size): a fresh mapping of a 45 MB slot faulted in its ~11,000 pages again each time,
        which doubled the checksum pass (13 against 5.5 ms, scratch measurement).

        Raises:
            CorruptSnapshotError: the data file is missing or shorter than the record says.
        """
        path = self._data_path(record.slot)
        total = record.layout.total_bytes
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise CorruptSnapshotError(
                f"snapshot of step {record.step}: data file {path} is missing") from None
        if st.st_size < max(total, 1):
            raise CorruptSnapshotError(f"snapshot of step {record.step}: {path} holds "
                                       f"{st.st_size} bytes, its record expects {total}")
        key = (st.st_ino, st.st_size)
        cached = self._read_maps.get(record.slot)
        if cached is None or cached[0] != key:
            if cached is not None:
                _close_mapping(cached[1])
            with open(path, "rb") as f:
                cached = self._read_maps[record.slot] = (
                    key, mmap.mmap(f.fileno(), st.st_size, prot=mmap.PROT_READ))
        if not total:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            # Read-only memory: torch warns that writing to these tensors is undefined; they
            # are only read (serialised).
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(cached[1], dtype=torch.uint8)[:total]

    def _slot_of(self, step: int) -> int | None:
        """The slot holding a complete record of ``step``, from the files; only that record's
        layout is rebuilt (the others' steps come from their summaries)."""
        for i in range(self.num_slots):
            if i == self._writing_slot:
                continue
            path = str(self._record_path(i))
            summary = self._summaries.get(path, lambda p: _record_summary(p, self.rank))
            if summary is not None and summary[0] == step:
                record = self._records[i] = self._parsed_records.get(path, _load_record_file)
                if record is not None and record.step == step:
                    return i
        return None

    def _refresh_records(self) -> None:
        # Another process (the writer) may have moved on; the files are the truth.
        with self._cond:
            for i in range(self.num_slots):
                if i != self._writing_slot:
                    self._records[i] = self._load_record(i)

    def _load_record(self, slot: int) -> SnapshotRecord | None:
        return self._parsed_records.get(str(self._record_path(slot)), _load_record_file)

    def _data_path(self, slot: int) -> Path:
        return self.rank_dir / f"slot{slot}.bin"

    def _record_path(self, slot: int) -> Path:
        return self.rank_dir / f"slot{slot}.json"


def read_snapshot(rank_dir: Path, record: SnapshotRecord, *,
                  out: torch.Tensor | None = None) -> StageState:
    """Read and verify the snapshot ``record`` describes from ``rank_dir``.

    The returned tensors share one buffer, not the shared memory: the first bytes of ``out``
    (a flat ``uint8`` CPU tensor) if given, else a new one.

    Raises:
        CorruptSnapshotError: data missing, short, or a chunk failing its checksum (names both).
        ValueError: ``out`` is too small or not a flat ``uint8`` tensor.
    """
    path = rank_dir / f"slot{record.slot}.bin"
    layout = record.layout
    if out is None:
        buf = torch.empty(layout.total_bytes, dtype=torch.uint8)
    elif out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < layout.total_bytes:
        raise ValueError(f"out must be a flat uint8 tensor of >= {layout.total_bytes} bytes, got "
                         f"{out.dtype} {tuple(out.shape)}")
    else:
        buf = out[: layout.total_bytes]
    try:
        with open(path, "rb") as f:
            n = f.readinto(buf.numpy().data) if layout.total_bytes else 0
    except FileNotFoundError:
        raise CorruptSnapshotError(
            f"snapshot of step {record.step}: data file {path} is missing"
        ) from None
    if n != layout.total_bytes:
        raise CorruptSnapshotError(
            f"snapshot of step {record.step}: {path} holds {n} bytes, its record expects {layout.total_bytes}"
        )
    return _verified_state(record, buf, path)


def _close_mapping(mm: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):
        mm.close()  # unless a caller still holds a tensor over it: then it goes with the tensor


def _verified_state(record: SnapshotRecord, buf: torch.Tensor, path: Path) -> StageState:
    """The state in ``buf`` (the slot's bytes), each chunk checked against the record."""
    layout = record.layout
    for chunk_id, expected in enumerate(record.checksums):
        start, end = layout.chunk_range(chunk_id)
        if checksum(buf[start:end], record.checksum) != expected:
            raise CorruptSnapshotError(
                f"snapshot of step {record.step}: chunk {chunk_id} (bytes {start}-{end}) of "
                f"{path} fails its {record.checksum} checksum"
            )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        tensors = tensors_from_region(layout, buf)
    local = set(record.local_names)
    return StageState(
        step=record.step,
        tensors={k: v for k, v in tensors.items() if k not in local},
        local_tensors={k: v for k, v in tensors.items() if k in local},
        metadata=record.metadata,
    )


def verify_rank_dir(rank_dir: Path) -> list[tuple[SnapshotRecord, str | None]]:
    """Every complete record of a rank directory, newest first, with why its data is bad (or None)."""
    out: list[tuple[SnapshotRecord, str | None]] = []
    for record in sorted(_rank_records(rank_dir), key=lambda r: -r.step):
        try:
            read_snapshot(rank_dir, record)
            out.append((record, None))
        except CorruptSnapshotError as e:
            out.append((record, str(e)))
    return out


class _ParsedFiles(Generic[V]):
    """What ``parse`` made of each small file, parsed again only once the file changed.

    Valid while the file's (inode, mtime, size) is unchanged: records and markers are replaced
    by rename, so a new one is a new inode. A file replaced between the ``stat`` and the parse
    is parsed once more on the next ``get``.
    """

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[int, int, int], V]] = {}

    def get(self, path: str, parse: Callable[[str], V]) -> V | None:
        """``parse(path)``, or its cached value; None (not parsed) when there is no file."""
        try:
            st = os.stat(path)
        except FileNotFoundError:
            self._cache.pop(path, None)
            return None
        key = (st.st_ino, st.st_mtime_ns, st.st_size)
        cached = self._cache.get(path)
        if cached is None or cached[0] != key:
            cached = self._cache[path] = (key, parse(path))
        return cached[1]

    def remember(self, path: str, value: V) -> None:
        """Record ``value`` as what the file at ``path``, as it is now, parses to."""
        st = os.stat(path)
        self._cache[path] = ((st.st_ino, st.st_mtime_ns, st.st_size), value)


def _load_record_file(path: str | Path) -> SnapshotRecord | None:
    try:
        return SnapshotRecord.from_json(json.loads(Path(path).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"ignoring unreadable snapshot record {path}: {e}", stacklevel=2)
        return None


def _digest(checksums: Sequence[int]) -> str:
    return f"{zlib.crc32(json.dumps(list(checksums)).encode()):08x}"


def _record_summary(path: str, rank: int) -> tuple[int, RankPart] | None:
    """(step, commit-marker part) of the record at ``path``, None if it is not a readable
    record; unlike :func:`_load_record_file`, the layout is not rebuilt."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
        if obj.get("format") != RECORD_FORMAT:
            return None
        return int(obj["step"]), RankPart(rank, int(obj["layout"]["total_bytes"]),
                                          _digest(obj["checksums"]))
    except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
        return None  # being replaced, or unreadable: not a complete record of any step


def _rank_records(rank_dir: Path) -> list[SnapshotRecord]:
    if not rank_dir.is_dir():
        return []
    records = (_load_record_file(p) for p in sorted(rank_dir.glob("slot*.json")))
    return [r for r in records if r is not None]


def _private_dir(path: Path) -> None:
    """Create ``path`` with mode 0700, or check that an existing one is ours and private."""
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = path.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(
            f"{path} belongs to uid {st.st_uid}, not to this user ({os.getuid()}); "
            "pick another job_id or root"
        )
    if st.st_mode & 0o777 != 0o700:
        os.chmod(path, 0o700)
