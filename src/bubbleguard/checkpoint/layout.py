"""Chunk layout: a stage's tensors back to back in one flat byte region, cut into fixed chunks.

The layout is plain data, built once (state shapes do not change between steps) and reused every
step. Each tensor starts at a 64-byte aligned offset of the region (so the region can be viewed
back as typed tensors, and checksums can read 8-byte words); chunk ``i`` covers region bytes
``[i * chunk_bytes, min((i + 1) * chunk_bytes, total_bytes))``. A chunk may span tensors and a
tensor may span chunks; :meth:`ChunkLayout.segments` lists the byte ranges to copy.

Copying a chunk is a handful of ``Tensor.copy_`` calls on flat ``uint8`` views
(:func:`flat_bytes`), never Python work per byte. On the CPU a snapshot copy also checksums what
it copies, in one of two ways:

* :func:`copy_chunk_native` (the default where the C extension ``_copysum`` was built): each
  piece is copied and summed in one pass with streaming stores (``sum64`` only). Measured on the
  2-core dev machine on a 44 MB stage state, from cold caches: 8.7 GB/s, against 6.5 GB/s for a
  plain ``memcpy`` of the same bytes and 5.0 GB/s for the NumPy path below.
* :func:`copy_chunk_checksummed` (fallback, and for ``crc32``): a chunk is copied in blocks of
  :data:`COPY_BLOCK_BYTES` through NumPy, each block checksummed right after it was copied
  (:meth:`ChunkLayout.blocks` lists the pieces of each block).

Both give the checksum of the chunk's region bytes, padding included; the native path sums only
the tensors' bytes, so the padding must be zero (:meth:`ChunkLayout.padding` lists it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bubbleguard import yielding
from bubbleguard.checkpoint.checksum import MASK64, checksum_update

try:
    from bubbleguard.checkpoint._copysum import copy_sum64 as _copy_sum64
except ImportError:  # installed without a C compiler: the NumPy path
    _copy_sum64 = None

NATIVE_COPY_AVAILABLE = _copy_sum64 is not None
"""Whether the fused native copy + checksum (``_copysum``) was built."""

ALIGN_BYTES = 64
DEFAULT_CHUNK_BYTES = 4 << 20
DEVICE_CHUNK_BYTES = 64 << 20
"""Chunk size for CUDA state (``CheckpointConfig``'s default there): its copies run on the copy
engine, so a chunk bounds no overrun, and each piece (chunk x tensor) costs launches."""


def default_chunk_bytes(device: torch.device | str) -> int:
    """The chunk size for state on ``device``: :data:`DEVICE_CHUNK_BYTES` on CUDA, else
    :data:`DEFAULT_CHUNK_BYTES` (on the CPU a chunk bounds how far a copy overruns a bubble)."""
    return DEVICE_CHUNK_BYTES if torch.device(device).type == "cuda" else DEFAULT_CHUNK_BYTES


COPY_BLOCK_BYTES = 512 << 10
"""Block of a fused copy + checksum: small enough to stay in a core's L2 cache (>= 1 MiB on
current x86 server cores) between the copy and the checksum, large enough that the per-block
Python calls (a few microseconds) stay a few percent of the copy (~50 us at ~10 GB/s)."""


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor lives in the region.

    Attributes:
        name: tensor name (whole-model FQN, ``optim.<fqn>.<key>`` or ``rng.*``).
        dtype: ``str(torch.dtype)``, e.g. ``"torch.float32"``.
        shape: the tensor's shape.
        num_bytes: ``numel * element_size``.
        region_offset: first byte in the region (a multiple of 64).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    num_bytes: int
    region_offset: int


@dataclass(frozen=True)
class Segment:
    """A byte range of one tensor that belongs to one chunk.

    Attributes:
        name: tensor name.
        tensor_offset: first byte inside the tensor's flat bytes.
        region_offset: first byte inside the region.
        num_bytes: length of the range.
    """

    name: str
    tensor_offset: int
    region_offset: int
    num_bytes: int


@dataclass(frozen=True)
class Block:
    """A piece of a chunk copied and checksummed in one go (see :meth:`ChunkLayout.blocks`).

    Attributes:
        start: first region byte (a multiple of 64).
        end: one past the last region byte.
        segments: the tensor byte ranges inside ``[start, end)`` (padding between tensors is
            not copied but is checksummed, as in :func:`copy_chunk`).
    """

    start: int
    end: int
    segments: tuple[Segment, ...]


@dataclass(frozen=True)
class ChunkLayout:
    """All tensors of a stage in one region, cut into ``chunk_bytes`` chunks.

    Build with :meth:`build`; ``total_bytes`` is the region size (a multiple of 64).
    """

    tensors: tuple[TensorSlot, ...]
    chunk_bytes: int
    total_bytes: int
    _segments: tuple[tuple[Segment, ...], ...] = field(init=False, repr=False, compare=False)
    _blocks: dict[tuple[int, int], tuple[Block, ...]] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.chunk_bytes <= 0 or self.chunk_bytes % ALIGN_BYTES:
            raise ValueError(
                f"chunk_bytes must be a positive multiple of {ALIGN_BYTES}, got {self.chunk_bytes}"
            )
        object.__setattr__(self, "_segments", _cut(self.tensors, self.chunk_bytes, self.num_chunks))

    @staticmethod
    def build(
        tensors: Mapping[str, torch.Tensor], chunk_bytes: int = DEFAULT_CHUNK_BYTES
    ) -> ChunkLayout:
        """Lay out ``tensors`` in their iteration order.

        Args:
            tensors: name -> tensor (any device, dtype and contiguity).
            chunk_bytes: chunk size, a positive multiple of 64.
        """
        slots = []
        offset = 0
        for name, t in tensors.items():
            n = t.numel() * t.element_size()
            slots.append(TensorSlot(name, str(t.dtype), tuple(t.shape), n, offset))
            offset = _align(offset + n)
        return ChunkLayout(tuple(slots), chunk_bytes, offset)

    @property
    def num_chunks(self) -> int:
        """Number of chunks (0 for an empty region)."""
        return -(-self.total_bytes // self.chunk_bytes)

    def chunk_range(self, chunk_id: int) -> tuple[int, int]:
        """Region bytes ``[start, end)`` of chunk ``chunk_id``."""
        self._check(chunk_id)
        start = chunk_id * self.chunk_bytes
        return start, min(start + self.chunk_bytes, self.total_bytes)

    def chunk_sizes(self) -> tuple[int, ...]:
        """Size in bytes of every chunk, in chunk order (what the planner takes)."""
        return tuple(e - s for s, e in (self.chunk_range(i) for i in range(self.num_chunks)))

    def segments(self, chunk_id: int) -> tuple[Segment, ...]:
        """The tensor byte ranges that make up chunk ``chunk_id`` (precomputed)."""
        self._check(chunk_id)
        return self._segments[chunk_id]

    def blocks(self, chunk_id: int, block_bytes: int = COPY_BLOCK_BYTES) -> tuple[Block, ...]:
        """Chunk ``chunk_id`` cut into blocks of ``block_bytes`` (a positive multiple of 64).

        Computed once per chunk and block size, then reused every step.
        """
        self._check(chunk_id)
        blocks = self._blocks.get((chunk_id, block_bytes))
        if blocks is None:
            if block_bytes <= 0 or block_bytes % ALIGN_BYTES:
                raise ValueError(f"block_bytes must be a positive multiple of {ALIGN_BYTES}, "
                                 f"got {block_bytes}")
            blocks = _cut_blocks(self.chunk_range(chunk_id), self._segments[chunk_id],
                                 block_bytes)
            self._blocks[(chunk_id, block_bytes)] = blocks
        return blocks

    def padding(self) -> tuple[tuple[int, int], ...]:
        """Region byte ranges ``[start, end)`` that belong to no tensor (alignment gaps)."""
        gaps = []
        pos = 0
        for s in self.tensors:
            if s.region_offset > pos:
                gaps.append((pos, s.region_offset))
            pos = max(pos, s.region_offset + s.num_bytes)
        if pos < self.total_bytes:
            gaps.append((pos, self.total_bytes))
        return tuple(gaps)

    def names(self) -> tuple[str, ...]:
        """Tensor names in layout order."""
        return tuple(s.name for s in self.tensors)

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` have exactly these names, dtypes and shapes, in this order."""
        if len(tensors) != len(self.tensors):
            return False
        return all(
            s.name == name and s.dtype == str(t.dtype) and s.shape == tuple(t.shape)
            for s, (name, t) in zip(self.tensors, tensors.items(), strict=True)
        )

    def to_json(self) -> dict[str, Any]:
        """Plain JSON form (stored in snapshot records)."""
        return {
            "chunk_bytes": self.chunk_bytes,
            "total_bytes": self.total_bytes,
            "tensors": [
                [s.name, s.dtype, list(s.shape), s.num_bytes, s.region_offset] for s in self.tensors
            ],
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> ChunkLayout:
        """Inverse of :meth:`to_json`; ValueError if the entries are inconsistent."""
        slots = tuple(
            TensorSlot(str(n), str(d), tuple(int(x) for x in shape), int(nb), int(off))
            for n, d, shape, nb, off in obj["tensors"]
        )
        layout = ChunkLayout(slots, int(obj["chunk_bytes"]), int(obj["total_bytes"]))
        for s in slots:
            dtype = dtype_from_str(s.dtype)
            numel = 1
            for x in s.shape:
                numel *= x
            if (
                s.num_bytes != numel * dtype.itemsize
                or s.region_offset % ALIGN_BYTES
                or s.region_offset + s.num_bytes > layout.total_bytes
            ):
                raise ValueError(f"layout entry for tensor {s.name!r} is inconsistent: {s}")
        return layout

    def _check(self, chunk_id: int) -> None:
        if not 0 <= chunk_id < self.num_chunks:
            raise IndexError(f"chunk id {chunk_id} out of range [0, {self.num_chunks})")


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as a flat ``uint8`` tensor (a view when ``t`` is contiguous)."""
    return t.detach().reshape(-1).view(torch.uint8)


def copy_chunk(
    layout: ChunkLayout,
    chunk_id: int,
    sources: Mapping[str, torch.Tensor],
    region: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> int:
    """Copy chunk ``chunk_id`` from ``sources`` (name -> :func:`flat_bytes`) into ``region``.

    Returns:
        The number of bytes copied.
    """
    n = 0
    for seg in layout.segments(chunk_id):
        src = sources[seg.name][seg.tensor_offset : seg.tensor_offset + seg.num_bytes]
        region[seg.region_offset : seg.region_offset + seg.num_bytes].copy_(
            src, non_blocking=non_blocking
        )
        n += seg.num_bytes
    return n


def copy_chunk_checksummed(
    layout: ChunkLayout,
    chunk_id: int,
    sources: Mapping[str, np.ndarray],
    region: np.ndarray,
    algorithm: str,
    block_bytes: int = COPY_BLOCK_BYTES,
) -> tuple[int, int]:
    """Copy chunk ``chunk_id`` into ``region`` and checksum it in the same pass (CPU only).

    Block by block: copy the block's pieces (``memcpy`` through NumPy), then checksum the block
    while it is still in the cache. The result equals ``checksum(region[chunk], algorithm)``.

    Args:
        layout: the layout.
        chunk_id: which chunk.
        sources: name -> ``flat_bytes(tensor).numpy()`` (CPU tensors).
        region: the destination region as a ``uint8`` NumPy array.
        algorithm: ``"sum64"`` or ``"crc32"`` (see ``checksum.py``).
        block_bytes: block size (see :data:`COPY_BLOCK_BYTES`).

    Returns:
        (bytes copied, the chunk's checksum).
    """
    n = 0
    value = 0
    for block in layout.blocks(chunk_id, block_bytes):
        for seg in block.segments:
            end = seg.region_offset + seg.num_bytes
            region[seg.region_offset : end] = sources[seg.name][
                seg.tensor_offset : seg.tensor_offset + seg.num_bytes
            ]
            n += seg.num_bytes
        value = checksum_update(value, region[block.start : block.end], algorithm)
    return n, value


def copy_chunk_native(
    layout: ChunkLayout,
    chunk_id: int,
    source_addresses: Mapping[str, int],
    region_address: int,
) -> tuple[int, int]:
    """Copy chunk ``chunk_id`` and compute its ``sum64`` checksum in one pass (C extension).

    The checksum equals ``checksum(region[chunk], "sum64")`` when the region's padding bytes are
    zero (:meth:`ChunkLayout.padding`).

    Args:
        layout: the layout.
        chunk_id: which chunk.
        source_addresses: name -> address of the tensor's first byte (``data_ptr()`` of its
            :func:`flat_bytes`; contiguous CPU memory that stays alive during the call).
        region_address: address of the region's first byte.

    Returns:
        (bytes copied, the chunk's checksum).

    Raises:
        RuntimeError: the extension was not built (see :data:`NATIVE_COPY_AVAILABLE`).
    """
    if _copy_sum64 is None:
        raise RuntimeError("the native copy (bubbleguard.checkpoint._copysum) was not built; "
                           "use copy_chunk_checksummed")
    n = 0
    value = 0
    pieces = yielding.current() or ()  # a bubble helper's copies yield to the training thread
    for seg in layout.segments(chunk_id):
        value += _copy_sum64(region_address + seg.region_offset,
                             source_addresses[seg.name] + seg.tensor_offset, seg.num_bytes,
                             *pieces)
        n += seg.num_bytes
    return n, value & MASK64


def word_sum(data: torch.Tensor) -> torch.Tensor:
    """The ``sum64`` of a flat ``uint8`` tensor's bytes, the last word zero-padded, as a 0-dim
    ``int64`` tensor on its device (queued there, no sync). Its start must be 8-byte aligned.

    Modulo 2**64 (read it with ``int(...) & MASK64``), it is what :func:`checksum` gives for the
    same bytes followed by zeros up to a multiple of 8.
    """
    n = data.numel()
    whole = n - n % 8
    total = (data[:whole].view(torch.int64).sum() if whole
             else torch.zeros((), dtype=torch.int64, device=data.device))
    if whole < n:
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[: n - whole] = data[whole:]
        total = total + tail.view(torch.int64).sum()
    return total


def copy_chunk_device(
    layout: ChunkLayout,
    chunk_id: int,
    sources: Mapping[str, torch.Tensor],
    region: torch.Tensor,
    sums: torch.Tensor,
) -> tuple[int, int] | None:
    """Queue chunk ``chunk_id``'s copies from device tensors, and their ``sum64``, on the current
    CUDA stream (a snapshot's side stream).

    The checksum is computed by the device from the source bytes, so the host never reads the
    snapshot: the 8-byte words of each piece from ``sums``' device (the last word zero-padded)
    are summed there into that piece's entry of ``sums``; pieces from other tensors (RNG
    states on the CPU) are copied and summed on the host, and their entries are left alone.
    Two launches per piece (the copy and its sum), nothing per chunk: a caller that queues a
    whole snapshot reads every piece's sum back with one copy. The chunk's checksum, which equals
    ``checksum(region[chunk], "sum64")`` once the copies have landed and when the region's
    padding bytes are zero, is the host part plus the device entries, modulo 2**64.

    Args:
        layout: the layout.
        chunk_id: which chunk.
        sources: name -> :func:`flat_bytes` of each tensor (on ``sums``' device or the CPU).
        region: the flat ``uint8`` host region (pinned, for the copies to be asynchronous).
        sums: ``int64``, one entry per piece of the chunk (``len(layout.segments(chunk_id))``),
            on the device; entries of host pieces are not written (keep them zero).

    Returns:
        (bytes copied, the host pieces' sum); None if a device piece does not start on an
        8-byte boundary: then nothing was queued, and the caller copies with :func:`copy_chunk`
        and checksums the landed bytes.
    """
    segments = layout.segments(chunk_id)
    if sums.numel() != len(segments):
        raise ValueError(f"chunk {chunk_id} has {len(segments)} pieces, sums has {sums.numel()}")
    device = sums.device
    for seg in segments:
        src = sources[seg.name]
        if src.device == device and (src.data_ptr() + seg.tensor_offset) % 8:
            return None
    n = 0
    host = 0
    for j, seg in enumerate(segments):
        src = sources[seg.name][seg.tensor_offset : seg.tensor_offset + seg.num_bytes]
        dst = region[seg.region_offset : seg.region_offset + seg.num_bytes]
        dst.copy_(src, non_blocking=True)
        n += seg.num_bytes
        if src.device != device:  # copied already (host to host); the padding after it is zero
            end = seg.region_offset + _align8(seg.num_bytes)
            host += int(np.add.reduce(region[seg.region_offset : end].numpy().view(np.uint64)))
        elif seg.num_bytes % 8 == 0:
            torch.sum(src.view(torch.int64), dim=0, keepdim=True, out=sums[j : j + 1])
        else:  # a tensor's last piece, its last word short (e.g. an odd number of bf16)
            sums[j].copy_(word_sum(src))
    return n, host & MASK64


def tensors_from_region(layout: ChunkLayout, region: torch.Tensor) -> dict[str, torch.Tensor]:
    """Typed views of ``region`` (flat ``uint8``, CPU) for every tensor of ``layout``; no copies.

    Each tensor gets a storage of exactly its own bytes (over ``region``'s memory, which it
    keeps alive): ``torch.save``, and so DCP, writes a tensor whose storage is larger than the
    tensor by cloning it first, which cost a 44 MB stage's persist 22 ms of copying.
    """
    if region.numel() < layout.total_bytes:
        raise ValueError(f"region has {region.numel()} bytes, layout needs {layout.total_bytes}")
    raw = region.numpy()
    out = {}
    for s in layout.tensors:
        dtype = dtype_from_str(s.dtype)
        if s.num_bytes == 0:
            out[s.name] = torch.empty(s.shape, dtype=dtype)  # frombuffer refuses empty buffers
            continue
        own = raw[s.region_offset : s.region_offset + s.num_bytes]
        out[s.name] = torch.frombuffer(own, dtype=dtype).reshape(s.shape)
    return out


def dtype_from_str(name: str) -> torch.dtype:
    """``"torch.float32"`` -> ``torch.float32``; ValueError for anything else."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} (expected e.g. 'torch.float32')")
    return dtype


def _align8(n: int) -> int:
    return -(-n // 8) * 8


def _align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


def _cut_blocks(
    chunk: tuple[int, int], segments: tuple[Segment, ...], block_bytes: int
) -> tuple[Block, ...]:
    start, end = chunk
    blocks = []
    for b_start in range(start, end, block_bytes):
        b_end = min(b_start + block_bytes, end)
        pieces = []
        for seg in segments:
            lo = max(b_start, seg.region_offset)
            hi = min(b_end, seg.region_offset + seg.num_bytes)
            if lo < hi:
                pieces.append(
                    Segment(seg.name, seg.tensor_offset + lo - seg.region_offset, lo, hi - lo)
                )
        blocks.append(Block(b_start, b_end, tuple(pieces)))
    return tuple(blocks)


def _cut(
    slots: tuple[TensorSlot, ...], chunk_bytes: int, num_chunks: int
) -> tuple[tuple[Segment, ...], ...]:
    chunks: list[list[Segment]] = [[] for _ in range(num_chunks)]
    for s in slots:
        pos = s.region_offset
        end = s.region_offset + s.num_bytes
        while pos < end:
            cid = pos // chunk_bytes
            stop = min(end, (cid + 1) * chunk_bytes)
            chunks[cid].append(Segment(s.name, pos - s.region_offset, pos, stop - pos))
            pos = stop
    return tuple(tuple(c) for c in chunks)
