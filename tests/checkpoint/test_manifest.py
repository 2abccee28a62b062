"""Tests for checkpoint/manifest.py: markers, discovery helpers, agreement across ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from bubbleguard.checkpoint.errors import CorruptSnapshotError, IncompleteCheckpointError
from bubbleguard.checkpoint.manifest import (
    MARKER_NAME,
    CommitMarker,
    RankPart,
    agree_newest_step,
    filesystem,
    newest_common_step,
    read_marker,
    write_marker,
)
from tests.checkpoint.ckpt_testlib import agree_worker, run_ranks


def test_marker_round_trip_leaves_no_temp_files(tmp_path: Path) -> None:
    fs, path = filesystem(str(tmp_path))
    marker = CommitMarker("durable", 7, 2, (RankPart(0, 10, "a"), RankPart(1, 20, "b")))
    write_marker(fs, path, marker)
    assert read_marker(fs, path) == marker
    assert marker.num_bytes == 30
    assert [p.name for p in tmp_path.iterdir()] == [MARKER_NAME]


def test_missing_and_garbled_markers(tmp_path: Path) -> None:
    fs, path = filesystem(str(tmp_path))
    with pytest.raises(IncompleteCheckpointError, match="no commit marker"):
        read_marker(fs, path)
    (tmp_path / MARKER_NAME).write_text('{"format": "bubbleguard-commit/1", "step": 3')
    with pytest.raises(CorruptSnapshotError, match="unreadable"):
        read_marker(fs, path)
    (tmp_path / MARKER_NAME).write_text(
        '{"format": "bubbleguard-commit/1", "tier": "memory", "step": 3, "num_ranks": 2, "parts": [[0, 1, "x"]]}'
    )
    with pytest.raises(CorruptSnapshotError, match=r"must list ranks 0..1 once each, got \[0\]"):
        read_marker(fs, path)


def test_newest_common_step() -> None:
    assert newest_common_step([[5, 4], [4, 3], [4, 5]]) == 4
    assert newest_common_step([[5], [4]]) is None
    assert newest_common_step([]) is None
    assert newest_common_step([[2, 9]]) == 9


def test_agree_without_process_group_is_local() -> None:
    assert agree_newest_step([3, 8, 5]) == 8
    assert agree_newest_step([]) is None


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_agree_across_two_gloo_ranks(tmp_path: Path) -> None:
    run_ranks(agree_worker, 2, str(tmp_path), str(tmp_path))
    assert (tmp_path / "rank0.txt").read_text() == "4"
    assert (tmp_path / "rank1.txt").read_text() == "4"
