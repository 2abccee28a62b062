"""Checks of a checkpoint location made before any rank starts, so a bad path fails at once."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["check_checkpoint_dir"]


def check_checkpoint_dir(ckpt_dir: str, *, resume: bool) -> None:
    """Refuse a checkpoint directory the run could not use.

    URLs (``s3://...``) are left to fsspec at write time; local paths must be, or be creatable
    as, a writable directory, and must exist when resuming.

    Raises:
        FileNotFoundError: ``resume`` and the directory does not exist.
        NotADirectoryError: the path is a file.
        PermissionError: the directory (or the parent it would be created in) is not writable.
    """
    if "://" in ckpt_dir:
        return
    path = Path(ckpt_dir)
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"checkpoint directory {path} is a file")
    if not path.exists():
        if resume:
            raise FileNotFoundError(f"--resume: checkpoint directory {path} does not exist")
        parent = path.parent
        while not parent.exists():
            parent = parent.parent
        if not os.access(parent, os.W_OK | os.X_OK):
            raise PermissionError(f"cannot create checkpoint directory {path}: {parent} is not "
                                  "writable")
        return
    # access() answers EROFS for a read-only mount even to root, unlike the permission bits.
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"checkpoint directory {path} is not writable")
