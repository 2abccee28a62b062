"""Errors of the checkpoint engine: each names the file, step, chunk or parameter at fault."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of the errors below."""


class CorruptSnapshotError(CheckpointError, ValueError):
    """Stored bytes do not match their checksum or their record (names the chunk and the file)."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """A checkpoint without a valid commit marker: half-written, never to be used."""


class StateMismatchError(CheckpointError, ValueError):
    """A checkpoint that does not fit this stage (names the missing and unexpected parameters)."""
