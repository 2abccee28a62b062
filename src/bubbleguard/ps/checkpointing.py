"""Durable checkpoints of one shard: data first, then a commit marker.

Layout on disk::

    DIR/shard-0/ckpt-00000007/state.pt        torch.save of a dict of plain tensors
    DIR/shard-0/ckpt-00000007/COMMITTED.json  written last: version, size, sha256 of state.pt

Both files are written atomically (temp file, fsync, rename). A checkpoint exists only once its
marker does and the marker's checksum matches the data; discovery skips anything else, so a
crash in the middle of a save leaves the previous checkpoint in charge. Older checkpoints are
deleted only after a newer one has committed. Tensors are keyed by the parameter's name in the
whole model and loaded with ``weights_only=True``: nothing but tensors is ever unpickled.

Directories are numbered by a counter, not by version: after a restore the version can repeat.
"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from bubbleguard.checkpoint.atomic import atomic_write_bytes, atomic_write_json
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.state import ShardState

FORMAT = 1
DATA_FILE = "state.pt"
MARKER_FILE = "COMMITTED.json"
_PREFIX = "ckpt-"


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    Attributes:
        path: its directory.
        seq: its number among the shard's checkpoints.
        shard: the shard.
        version: the state's version.
        num_applied: gradients in the state.
        sha256: checksum of the data file.
    """

    path: Path
    seq: int
    shard: int
    version: int
    num_applied: int
    sha256: str


def shard_dir(directory: str | Path, shard: int) -> Path:
    """Where ``shard``'s checkpoints live."""
    return Path(directory) / f"shard-{shard}"


def _numbered(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        if child.is_dir() and child.name.startswith(_PREFIX) and child.name[len(_PREFIX) :].isdigit():
            out.append((int(child.name[len(_PREFIX) :]), child))
    return sorted(out)


def save_checkpoint(directory: str | Path, state: ShardState, layout: ParamLayout, *, keep: int = 2) -> CheckpointInfo:
    """Write ``state`` as a new committed checkpoint, then prune to the newest ``keep``.

    Raises:
        OSError: the write failed; the previous checkpoints are untouched.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    root = shard_dir(directory, state.shard)
    root.mkdir(parents=True, exist_ok=True)
    existing = _numbered(root)
    seq = existing[-1][0] + 1 if existing else 0
    path = root / f"{_PREFIX}{seq:08d}"
    path.mkdir()
    tensors: dict[str, torch.Tensor] = {
        f"param.{name}": t.clone() for name, t in layout.named_of(state.shard, state.params).items()
    }
    if state.momentum.numel():
        tensors.update(
            {f"momentum.{name}": t.clone() for name, t in layout.named_of(state.shard, state.momentum).items()}
        )
    tensors["version"] = torch.tensor(state.version, dtype=torch.int64)
    tensors["log"] = state.log.clone()
    buf = io.BytesIO()
    torch.save(tensors, buf)
    data = buf.getvalue()
    atomic_write_bytes(path / DATA_FILE, data)
    digest = hashlib.sha256(data).hexdigest()
    atomic_write_json(
        path / MARKER_FILE,
        {
            "format": FORMAT,
            "shard": state.shard,
            "seq": seq,
            "version": state.version,
            "num_applied": state.num_applied,
            "file": DATA_FILE,
            "bytes": len(data),
            "sha256": digest,
            "params": [s.name for s in layout.slots_of(state.shard)],
        },
    )
    info = CheckpointInfo(path, seq, state.shard, state.version, state.num_applied, digest)
    _prune(root, keep_from=info.seq, keep=keep)
    return info


def _read_marker(path: Path) -> CheckpointInfo | None:
    try:
        marker = json.loads((path / MARKER_FILE).read_text())
        data = (path / marker["file"]).read_bytes()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if marker.get("format") != FORMAT or len(data) != marker.get("bytes"):
        return None
    if hashlib.sha256(data).hexdigest() != marker.get("sha256"):
        return None
    return CheckpointInfo(
        path, int(marker["seq"]), int(marker["shard"]), int(marker["version"]), int(marker["num_applied"]), marker["sha256"]
    )


def committed_checkpoints(directory: str | Path, shard: int) -> list[CheckpointInfo]:
    """Every valid committed checkpoint of ``shard``, oldest first."""
    infos = (_read_marker(p) for _, p in _numbered(shard_dir(directory, shard)))
    return [i for i in infos if i is not None and i.shard == shard]


def latest_checkpoint(directory: str | Path, shard: int) -> CheckpointInfo | None:
    """The newest valid committed checkpoint of ``shard``, or ``None``."""
    for _, path in reversed(_numbered(shard_dir(directory, shard))):
        info = _read_marker(path)
        if info is not None and info.shard == shard:
            return info
    return None


def load_checkpoint(info: CheckpointInfo, layout: ParamLayout) -> ShardState:
    """The state stored in ``info`` (checksum verified again, tensors only).

    Raises:
        ValueError: the data no longer matches its marker, or it holds other parameters than
            the layout's shard.
    """
    data = (info.path / DATA_FILE).read_bytes()
    if hashlib.sha256(data).hexdigest() != info.sha256:
        raise ValueError(f"checkpoint {info.path} changed since it was committed")
    tensors = torch.load(io.BytesIO(data), weights_only=True)
    names = {s.name for s in layout.slots_of(info.shard)}
    stored = {k[len("param.") :] for k in tensors if k.startswith("param.")}
    if stored != names:
        raise ValueError(
            f"checkpoint {info.path} holds parameters {sorted(stored)}, shard {info.shard} expects {sorted(names)}"
        )
    params = layout.flatten_shard(info.shard, {n: tensors[f"param.{n}"] for n in names})
    if any(k.startswith("momentum.") for k in tensors):
        momentum = layout.flatten_shard(info.shard, {n: tensors[f"momentum.{n}"] for n in names})
    else:
        momentum = torch.zeros(0)
    return ShardState(info.shard, params, momentum, int(tensors["version"].item()), tensors["log"])


def _prune(root: Path, *, keep_from: int, keep: int) -> None:
    """Delete committed checkpoints older than the newest ``keep`` and torn ones older than
    ``keep_from`` (the checkpoint just committed)."""
    committed = [i.seq for i in (_read_marker(p) for _, p in _numbered(root)) if i is not None]
    survivors = set(sorted(committed)[-keep:]) | {keep_from}
    for seq, path in _numbered(root):
        if seq < keep_from and seq not in survivors:
            shutil.rmtree(path, ignore_errors=True)
