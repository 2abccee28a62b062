"""Atomic file writes: the building block of every commit marker.

A reader either sees the old file or the complete new one, never a torn write: the bytes go to
a temporary file in the same directory, are fsynced, renamed over the target, and the directory
is fsynced so the rename itself survives a power loss.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def fsync_path(path: str | os.PathLike[str]) -> None:
    """Flush a file's data, or a directory's entries, to stable storage (opened read-only)."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Flush a directory's entries (a rename or a new file in it) to stable storage."""
    fsync_path(path)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers never observe a partial file.

    Raises:
        FileNotFoundError: the parent directory does not exist.
        PermissionError: the directory is not writable.
        OSError: the write failed (for example, the disk is full); ``path`` is then unchanged.
    """
    target = Path(path)
    parent = target.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {target}: directory {parent} does not exist")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, target)
    except BaseException:
        # Leave no temporary file behind; the target still holds its previous content.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    fsync_dir(parent)


def atomic_write_json(path: str | os.PathLike[str], obj: Any, *, compact: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (see :func:`atomic_write_bytes`).

    Indented for people by default; ``compact`` uses the C encoder (no indent), about ten
    times faster for records written on the training's critical path.
    """
    atomic_write_bytes(path, json_bytes(obj, compact=compact))


def json_bytes(obj: Any, *, compact: bool = False) -> bytes:
    """``obj`` as a line of JSON: indented and sorted, or ``compact`` (see above)."""
    text = (json.dumps(obj, separators=(",", ":")) if compact
            else json.dumps(obj, indent=2, sort_keys=True))
    return (text + "\n").encode()
