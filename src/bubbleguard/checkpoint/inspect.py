"""``describe_checkpoints(path)``: what checkpoints a directory holds, on any tier, and whether each is usable.

``path`` may be a durable root (``step-*`` directories, local path or fsspec URL) or a memory-tier
job directory (``/dev/shm/bubbleguard-<uid>/<job_id>``, with ``rank*`` directories). The records
are plain data for ``bubbleguard inspect DIR`` to print.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bubbleguard.checkpoint.errors import CorruptSnapshotError
from bubbleguard.checkpoint.manifest import filesystem, is_local, read_marker
from bubbleguard.checkpoint.tiers.durable import DurableTier
from bubbleguard.checkpoint.tiers.shm import SnapshotRecord, verify_rank_dir


@dataclass(frozen=True)
class CheckpointRecord:
    """One checkpoint found by :func:`describe_checkpoints`.

    Attributes:
        tier: ``"durable"`` or ``"memory"``.
        step: the checkpoint's step.
        size_bytes: bytes on storage (durable: all files; memory: data of every rank).
        num_ranks: ranks (pipeline stages x replicas) that wrote it, when known.
        valid: whether a resume may use it.
        reason: why not (None when valid).
        path: the step directory (durable) or the job directory (memory).
        committed: a commit marker names it. Always true for a valid durable checkpoint; a
            memory-tier step may be valid (every rank holds it, checksums pass) without one,
            when the ranks span nodes and agree at resume time instead.
    """

    tier: str
    step: int
    size_bytes: int
    num_ranks: int | None
    valid: bool
    reason: str | None
    path: str
    committed: bool = False


def describe_checkpoints(path: str | os.PathLike[str]) -> list[CheckpointRecord]:
    """Describe every checkpoint under ``path``, ordered by step.

    Raises:
        FileNotFoundError: ``path`` does not exist.
    """
    url = os.fspath(path)
    fs, root = filesystem(url)
    if not fs.exists(root):
        raise FileNotFoundError(f"{url} does not exist")
    if is_local(fs) and any(p.is_dir() and p.name.startswith("rank") for p in Path(root).iterdir()):
        return _describe_memory(Path(root))
    return [
        CheckpointRecord(
            "durable", i.step, i.size_bytes, i.num_ranks, i.committed, i.reason, i.path, i.committed
        )
        for i in DurableTier(url).checkpoints()
    ]


def _describe_memory(job_dir: Path) -> list[CheckpointRecord]:
    rank_dirs = sorted(
        (
            p
            for p in job_dir.iterdir()
            if p.is_dir() and p.name.startswith("rank") and p.name[4:].isdigit()
        ),
        key=lambda p: int(p.name[4:]),
    )
    num_ranks = len(rank_dirs)
    fs, _ = filesystem(str(job_dir))
    try:
        committed: int | None = read_marker(fs, str(job_dir)).step
    except (FileNotFoundError, CorruptSnapshotError):
        committed = None
    per_rank: list[dict[int, tuple[SnapshotRecord, str | None]]] = [
        {record.step: (record, error) for record, error in verify_rank_dir(d)} for d in rank_dirs
    ]
    out = []
    for step in sorted({s for found in per_rank for s in found}):
        reasons = []
        size = 0
        for rank, found in enumerate(per_rank):
            if step not in found:
                reasons.append(f"rank {rank} has no complete snapshot of step {step}")
                continue
            record, error = found[step]
            size += record.layout.total_bytes
            if error:
                reasons.append(error)
        out.append(
            CheckpointRecord(
                tier="memory",
                step=step,
                size_bytes=size,
                num_ranks=num_ranks,
                valid=not reasons,
                reason="; ".join(reasons) if reasons else None,
                committed=committed == step,
                path=str(job_dir),
            )
        )
    return out
