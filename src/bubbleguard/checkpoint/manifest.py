"""Commit protocol and discovery: a checkpoint exists only once its commit marker does.

Protocol for step k on one tier:

1. every rank stores its data, then its own record (checksums, sizes) -- atomically;
2. once every rank's part is in and checked, one process writes the marker
   (:func:`write_marker`: temp file + fsync + rename, via ``atomic.py``; one object put on an
   object store, which is atomic there);
3. readers (:func:`read_marker`) trust a step only if its marker parses and lists every rank;
   anything without one is reported as incomplete and never used.

Across ranks that cannot see each other's files (memory tiers on different nodes), the newest
step every rank holds is found by :func:`newest_common_step` (pure) or, on a process group, by
:func:`agree_newest_step` -- one all-gather at resume time, none per step.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from fsspec.implementations.local import LocalFileSystem

from bubbleguard.checkpoint.atomic import atomic_write_json, json_bytes
from bubbleguard.checkpoint.errors import CorruptSnapshotError, IncompleteCheckpointError

MARKER_NAME = "COMMITTED.json"
MARKER_FORMAT = "bubbleguard-commit/1"


@dataclass(frozen=True)
class RankPart:
    """One rank's share of a committed step.

    Attributes:
        rank: the rank that wrote it.
        num_bytes: bytes of tensor data it stored.
        digest: a fingerprint of its record (e.g. its chunk checksums), to spot a part that was
            replaced after the commit.
    """

    rank: int
    num_bytes: int
    digest: str


@dataclass(frozen=True)
class CommitMarker:
    """The content of a commit marker.

    Attributes:
        tier: ``"memory"`` or ``"durable"``.
        step: the committed step.
        num_ranks: number of ranks that wrote the step.
        parts: one :class:`RankPart` per rank, ranks 0..num_ranks-1 in order.
    """

    tier: str
    step: int
    num_ranks: int
    parts: tuple[RankPart, ...]

    def __post_init__(self) -> None:
        if [p.rank for p in self.parts] != list(range(self.num_ranks)):
            raise ValueError(
                f"commit marker of step {self.step} must list ranks 0..{self.num_ranks - 1} "
                f"once each, got {[p.rank for p in self.parts]}"
            )

    @property
    def num_bytes(self) -> int:
        """Total tensor bytes over all ranks."""
        return sum(p.num_bytes for p in self.parts)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON form."""
        return {
            "format": MARKER_FORMAT,
            "tier": self.tier,
            "step": self.step,
            "num_ranks": self.num_ranks,
            "parts": [[p.rank, p.num_bytes, p.digest] for p in self.parts],
        }

    @staticmethod
    def from_json(obj: Mapping[str, Any]) -> CommitMarker:
        """Parse :meth:`to_json` output; ValueError (or KeyError/TypeError) if malformed."""
        if obj.get("format") != MARKER_FORMAT:
            raise ValueError(
                f"unknown marker format {obj.get('format')!r}, expected {MARKER_FORMAT!r}"
            )
        parts = tuple(RankPart(int(r), int(n), str(d)) for r, n, d in obj["parts"])
        return CommitMarker(str(obj["tier"]), int(obj["step"]), int(obj["num_ranks"]), parts)


def filesystem(url_or_path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the path inside it for a local path or an fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url_or_path)
    return fs, path


def is_local(fs: fsspec.AbstractFileSystem) -> bool:
    """Whether ``fs`` is the local disk (where atomic rename and fsync apply)."""
    return isinstance(fs, LocalFileSystem)


def write_json(fs: fsspec.AbstractFileSystem, path: str, obj: Any, *,
               compact: bool = False) -> None:
    """Write ``obj`` as JSON so that a reader sees the old content or the new, never a mix.

    Local: temp file + fsync + rename + directory fsync. Other filesystems: one ``pipe_file``,
    which object stores apply atomically. ``compact``: as :func:`atomic_write_json`'s.
    """
    if is_local(fs):
        atomic_write_json(path, obj, compact=compact)
    else:
        fs.pipe_file(path, json_bytes(obj, compact=compact))


def read_json(fs: fsspec.AbstractFileSystem, path: str) -> Any:
    """Parse the JSON file at ``path``; FileNotFoundError if absent, ValueError if unparseable."""
    try:
        data = fs.cat_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} does not exist") from None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None


def write_marker(fs: fsspec.AbstractFileSystem, directory: str, marker: CommitMarker) -> None:
    """Write ``directory/COMMITTED.json`` atomically: the last write of a commit."""
    write_json(fs, f"{directory.rstrip('/')}/{MARKER_NAME}", marker.to_json())


def read_marker(fs: fsspec.AbstractFileSystem, directory: str) -> CommitMarker:
    """Read and validate ``directory/COMMITTED.json``.

    Raises:
        IncompleteCheckpointError: no marker (a half-written or in-progress checkpoint).
        CorruptSnapshotError: the marker exists but does not parse or is inconsistent.
    """
    path = f"{directory.rstrip('/')}/{MARKER_NAME}"
    try:
        obj = read_json(fs, path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{directory} has no commit marker {MARKER_NAME}: the checkpoint is incomplete "
            "(half-written or still being written) and is not used"
        ) from None
    except ValueError as e:
        raise CorruptSnapshotError(f"commit marker {path} is unreadable: {e}") from None
    try:
        return CommitMarker.from_json(obj)
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptSnapshotError(f"commit marker {path} is malformed: {e}") from None


def newest_common_step(steps_per_rank: Sequence[Iterable[int]]) -> int | None:
    """The newest step that every rank holds, or None (pure).

    Args:
        steps_per_rank: for each rank, the steps it holds complete (any order).
    """
    if not steps_per_rank:
        return None
    common = set(steps_per_rank[0])
    for steps in steps_per_rank[1:]:
        common &= set(steps)
    return max(common) if common else None


def agree_newest_step(
    local_steps: Iterable[int], group: dist.ProcessGroup | None = None, *, max_steps: int = 8
) -> int | None:
    """All ranks of ``group`` agree on the newest step that every one of them holds.

    Collective: every rank of ``group`` calls it once, at resume time. Uses one all-gather of a
    fixed-size int64 tensor (no pickling). Without ``torch.distributed`` initialised it returns
    the newest local step.

    Args:
        local_steps: the steps this rank holds complete (e.g. ``MemoryTier.steps()``).
        group: the process group (default: the default group). Its backend must handle CPU
            tensors (gloo).
        max_steps: at most this many of the newest local steps take part.
    """
    steps = sorted(set(local_steps), reverse=True)[:max_steps]
    if not (dist.is_available() and dist.is_initialized()):
        return steps[0] if steps else None
    mine = torch.full((max_steps,), -1, dtype=torch.int64)
    if steps:
        mine[: len(steps)] = torch.tensor(steps, dtype=torch.int64)
    world = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    return newest_common_step([[int(s) for s in g.tolist() if s >= 0] for g in gathered])
