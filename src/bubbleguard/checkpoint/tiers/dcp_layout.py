"""Rewrite a DCP checkpoint's files for the next state of the same layout, without DCP.

A background persist writes the same tensors, of the same names, dtypes and shapes, every time;
only their bytes change. Yet each ``dcp.save`` plans the save again (collectives, planner
objects), pickles every tensor with ``torch.save`` into a zip record of its own and pickles the
global metadata: 84 ms of user CPU for a 44 MB stage on the dev VM (9 ms replayed; README, "Dec
7"), CPU time that this VM takes from the training ranks ("idle CPU time is not free").

:class:`DcpLayout` learns, from the files of one ordinary ``dcp.save`` on a local filesystem,
where each tensor's bytes lie in this rank's data files and keeps everything else (zip headers,
the pickled records around the bytes, the global ``Metadata``). Writing the next state of the
same layout is then one ``writev`` per data file, straight from the tensors' memory, and the
cached metadata's pickle with a new ``checkpoint_id`` and ``save_id``: the files are
the ones ``dcp.save`` writes for those tensors (with ``torch.serialization.set_crc32_options
(False)``; the zip records' serialization ids are the first save's), so ``dcp.load`` and
``format_utils.dcp_to_torch_save`` read them as they read any DCP checkpoint.

The layout is learned only where nothing would make its copy differ from a fresh save: local
files, no storage transforms, one chunk per tensor, one stored (uncompressed) ``data/0`` record
per tensor, CRC32 off in this process (a zip CRC would go stale), and the tensors' bytes found
at the learned offsets. Anything else, and any state whose layout differs (a tensor added,
renamed, reshaped or of another dtype), goes through ``dcp.save`` again (:class:`DurableTier`
agrees on that over its process group).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import struct
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_METADATA = ".metadata"
_ZIP_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # 30 bytes, then the name and the extra field
_ZIP_LOCAL_SIGNATURE = 0x04034B50
_IOV_MAX = 1024  # Linux's limit on the buffers of one writev

Signature = tuple[tuple[str, str, tuple[int, ...]], ...]


class LayoutError(ValueError):
    """The files of a save are not laid out as :class:`DcpLayout` can replay."""


def signature(tensors: Mapping[str, torch.Tensor]) -> Signature:
    """What must not change for a layout to be replayed: names, dtypes and shapes."""
    return tuple(sorted((k, str(t.dtype), tuple(t.shape)) for k, t in tensors.items()))


@dataclass(frozen=True)
class _DataFile:
    """One data file of this rank: fixed bytes, alternating with the names of tensors."""

    name: str
    pieces: tuple[bytes | str, ...]


class DcpLayout:
    """This rank's data files and the global DCP metadata of one save; see the module docstring.

    Build one with :meth:`learn` right after a ``dcp.save`` of ``tensors``; then, for any state
    with ``matches(tensors)``, :meth:`write_files` on every rank followed by
    :meth:`write_metadata` on the coordinator writes that state's checkpoint.
    """

    def __init__(self, sig: Signature, files: tuple[_DataFile, ...], metadata: Metadata) -> None:
        self.signature = sig
        self.files = files
        self.metadata = metadata
        # (pickle, step dir, save id) of the last metadata pickled; see _pickled_metadata.
        self._pickle_template: tuple[bytes, bytes, bytes] | None = None

    @classmethod
    def learn(cls, step_dir: str, metadata: Metadata, tensors: Mapping[str, torch.Tensor],
              rank: int) -> DcpLayout:
        """Learn rank ``rank``'s files from the save of ``tensors`` into ``step_dir``.

        Raises:
            LayoutError: the save is not one this class can replay (the message says why).
            OSError: the files could not be read.
        """
        if torch.serialization.get_crc32_options():
            raise LayoutError("zip CRC32 is on in this process: replayed records would carry "
                              "stale CRCs")
        prefix = f"__{rank}_"
        by_file: dict[str, list[tuple[int, int, str]]] = {}
        for index, info in metadata.storage_data.items():
            if not info.relative_path.startswith(prefix):
                continue  # another rank's file
            if getattr(info, "transform_descriptors", None):
                raise LayoutError(f"{index.fqn} was written through storage transforms")
            if index.fqn not in tensors:
                raise LayoutError(f"{info.relative_path} holds {index.fqn}, not in this state")
            chunks = getattr(metadata.state_dict_metadata[index.fqn], "chunks", ())
            if len(chunks) != 1:
                raise LayoutError(f"{index.fqn} is saved in {len(chunks)} chunks, not one")
            by_file.setdefault(info.relative_path, []).append((info.offset, info.length,
                                                               index.fqn))
        files = tuple(_learn_file(step_dir, name, items, tensors)
                      for name, items in sorted(by_file.items()))
        return cls(signature(tensors), files, copy.deepcopy(metadata))

    def matches(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Whether ``tensors`` has the learned names, dtypes and shapes."""
        return signature(tensors) == self.signature

    def write_files(self, step_dir: str, tensors: Mapping[str, torch.Tensor],
                    recycled: str | None = None) -> int:
        """Write this rank's data files of ``tensors`` into ``step_dir``, synced.

        ``recycled``: a directory holding the files of a checkpoint being deleted. A data file
        of this layout's name and size found there is moved into ``step_dir`` and overwritten
        in place (every byte of it is rewritten) instead of a new file being written; see
        ``DurableTier``'s module docstring.

        Returns:
            how many data files were overwritten in place.
        """
        reused = 0
        for f in self.files:
            buffers = [p if isinstance(p, bytes) else _bytes_of(tensors[p]) for p in f.pieces]
            path = f"{step_dir}/{f.name}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
            if recycled is not None and _take(f"{recycled}/{f.name}", path,
                                              sum(len(b) for b in buffers)):
                flags &= ~os.O_TRUNC
                reused += 1
            fd = os.open(path, flags, 0o644)
            try:
                _write_all(fd, buffers)
                os.fsync(fd)
            finally:
                os.close(fd)
        return reused

    def write_metadata(self, step_dir: str) -> None:
        """The coordinator's part: DCP's ``.metadata`` for ``step_dir``, synced, atomically."""
        tmp = f"{step_dir}/{_METADATA}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(self._pickled_metadata(step_dir, str(uuid.uuid4())))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, f"{step_dir}/{_METADATA}")  # the commit marker's write syncs the dir

    def _pickled_metadata(self, step_dir: str, save_id: str) -> bytes:
        """The metadata with ``storage_meta`` naming ``step_dir`` and ``save_id``, pickled.

        Pickling it took 3.4 ms per persist (scratch, a 45 MB stage of ~100 tensors). Only the
        two strings change between saves, and a step directory's name has a fixed width, so
        the pickle of the previous save is reused with those two strings replaced in place
        (a pickled string's length prefix is unchanged); where a string is not found exactly
        once, or its length differs, the metadata is pickled again.
        """
        old = self._pickle_template
        if old is not None:
            pickled, old_dir, old_id = old
            new_dir, new_id = step_dir.encode(), save_id.encode()
            if (len(new_dir), len(new_id)) == (len(old_dir), len(old_id)):
                return pickled.replace(old_dir, new_dir).replace(old_id, new_id)
        metadata = copy.copy(self.metadata)
        metadata.storage_meta = StorageMeta(checkpoint_id=step_dir, save_id=save_id)
        pickled = pickle.dumps(metadata)
        self._pickle_template = None
        if pickled.count(step_dir.encode()) == 1 and pickled.count(save_id.encode()) == 1:
            self._pickle_template = (pickled, step_dir.encode(), save_id.encode())
        return pickled


def _learn_file(step_dir: str, name: str, items: list[tuple[int, int, str]],
                tensors: Mapping[str, torch.Tensor]) -> _DataFile:
    """Split one data file into fixed bytes and tensors, checking each tensor's bytes."""
    with open(f"{step_dir}/{name}", "rb") as fh:
        content = fh.read()
    spans = []
    for offset, length, fqn in items:
        start = offset + _data_offset(content[offset:offset + length], fqn,
                                      tensors[fqn].nbytes)
        if content[start:start + tensors[fqn].nbytes] != _bytes_of(tensors[fqn]).tobytes():
            raise LayoutError(f"{name}: the bytes of {fqn} are not where its record says")
        spans.append((start, tensors[fqn].nbytes, fqn))
    pieces: list[bytes | str] = []
    pos = 0
    for start, nbytes, fqn in sorted(spans):
        if start < pos:
            raise LayoutError(f"{name}: the records of {fqn} and the one before it overlap")
        pieces += [content[pos:start], fqn]
        pos = start + nbytes
    pieces.append(content[pos:])
    return _DataFile(name, tuple(pieces))


def _data_offset(record: bytes, fqn: str, nbytes: int) -> int:
    """Where the tensor's bytes start inside one ``torch.save`` zip record."""
    try:
        archive = zipfile.ZipFile(io.BytesIO(record))
    except zipfile.BadZipFile as e:
        raise LayoutError(f"the record of {fqn} is not a torch.save zip: {e}") from None
    data = [i for i in archive.infolist() if i.filename.endswith("/data/0")]
    if len(data) != 1:
        raise LayoutError(f"the record of {fqn} does not hold exactly one storage")
    info = data[0]
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != nbytes:
        raise LayoutError(f"the storage of {fqn} is compressed or not {nbytes} bytes")
    head = record[info.header_offset:info.header_offset + _ZIP_LOCAL_HEADER.size]
    fields = _ZIP_LOCAL_HEADER.unpack(head)
    if fields[0] != _ZIP_LOCAL_SIGNATURE:
        raise LayoutError(f"no zip entry header where the storage of {fqn} should start")
    return info.header_offset + _ZIP_LOCAL_HEADER.size + fields[9] + fields[10]


def _take(src: str, dst: str, size: int) -> bool:
    """Move file ``src`` to ``dst`` if it is exactly ``size`` bytes; whether it was moved."""
    try:
        if os.stat(src).st_size != size:
            return False
        os.rename(src, dst)
    except FileNotFoundError:
        return False
    return True


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A tensor's bytes, in memory order, without a copy where it is contiguous."""
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8).numpy().data if flat.numel() else memoryview(b"")


def _write_all(fd: int, buffers: list[bytes | memoryview]) -> int:
    """``writev`` every buffer, resuming after partial writes; the bytes written."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = 0
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        total += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total
