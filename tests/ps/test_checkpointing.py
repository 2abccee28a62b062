"""Tests for bubbleguard.ps.checkpointing: committed checkpoints, discovery, pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bubbleguard.ps.checkpointing import (
    DATA_FILE,
    MARKER_FILE,
    committed_checkpoints,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    shard_dir,
)
from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.core.messages import Gradient, make_update_id
from bubbleguard.ps.core.state import LiveShardState, ShardState

LAYOUT = ParamLayout.from_shapes([("a.weight", (2, 3)), ("a.bias", (3,)), ("b.weight", (4,))], 2)


def trained_state(shard: int, steps: int) -> ShardState:
    initial = ShardState.initial(shard, torch.arange(LAYOUT.shard_numel(shard), dtype=torch.float32), momentum=True)
    live = LiveShardState(initial, lr=0.1, momentum=0.9)
    for seq in range(steps):
        live.apply(Gradient(make_update_id(1, 0, seq), seq, torch.full_like(initial.params, 0.5 + seq)))
    return live.freeze()


def test_save_then_load_is_bitwise_identical(tmp_path: Path) -> None:
    for shard in range(2):
        state = trained_state(shard, 5)
        info = save_checkpoint(tmp_path, state, LAYOUT)
        assert (info.version, info.num_applied) == (5, 5)
        assert load_checkpoint(info, LAYOUT).equals(state)
    stored = torch.load(latest_checkpoint(tmp_path, 0).path / DATA_FILE, weights_only=True)  # type: ignore[union-attr]
    names = [s.name for s in LAYOUT.slots_of(0)]
    assert set(stored) == {*(f"param.{n}" for n in names), *(f"momentum.{n}" for n in names), "version", "log"}


def test_a_checkpoint_without_its_marker_or_with_a_bad_checksum_is_ignored(tmp_path: Path) -> None:
    good = save_checkpoint(tmp_path, trained_state(0, 2), LAYOUT)
    torn = save_checkpoint(tmp_path, trained_state(0, 3), LAYOUT)
    (torn.path / MARKER_FILE).unlink()  # a crash between data and marker
    assert latest_checkpoint(tmp_path, 0) == good
    corrupt = save_checkpoint(tmp_path, trained_state(0, 4), LAYOUT)
    (corrupt.path / DATA_FILE).write_bytes(b"x" * len((corrupt.path / DATA_FILE).read_bytes()))
    assert latest_checkpoint(tmp_path, 0) == good
    wrong_format = save_checkpoint(tmp_path, trained_state(0, 5), LAYOUT)
    marker = json.loads((wrong_format.path / MARKER_FILE).read_text())
    (wrong_format.path / MARKER_FILE).write_text(json.dumps({**marker, "format": 99}))
    assert latest_checkpoint(tmp_path, 0) == good


def test_pruning_keeps_the_newest_and_never_the_only_good_one(tmp_path: Path) -> None:
    infos = [save_checkpoint(tmp_path, trained_state(0, n), LAYOUT, keep=2) for n in range(1, 5)]
    assert [i.seq for i in committed_checkpoints(tmp_path, 0)] == [infos[2].seq, infos[3].seq]
    assert len(list(shard_dir(tmp_path, 0).iterdir())) == 2
    # Directories count up even when versions repeat (after a rollback).
    again = save_checkpoint(tmp_path, trained_state(0, 1), LAYOUT, keep=2)
    assert again.seq == infos[-1].seq + 1 and latest_checkpoint(tmp_path, 0) == again


def test_loading_into_another_layout_is_refused(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path, trained_state(0, 1), LAYOUT)
    other = ParamLayout.from_shapes([("c.weight", (6,)), ("a.bias", (3,)), ("b.weight", (4,))], 2)
    with pytest.raises(ValueError, match="expects"):
        load_checkpoint(info, other)


def test_no_checkpoint_yet(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path, 0) is None
    assert committed_checkpoints(tmp_path / "missing", 1) == []
