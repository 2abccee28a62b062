"""Tests for checkpoint/tiers/dcp_layout.py: replaying a DCP save's files for the next state."""

from __future__ import annotations

import pickle
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bubbleguard.checkpoint.state import StageState, capture_state
from bubbleguard.checkpoint.tiers.dcp_layout import DcpLayout, LayoutError
from bubbleguard.checkpoint.tiers.durable import DurableTier
from tests.checkpoint.ckpt_testlib import (
    STAGES_OF_2,
    assert_same_state,
    assert_same_tensors,
    make_training,
    mount_tmpfs,
    run_ranks,
    save_until_the_disk_is_full,
    seed_all,
    train_step,
)


@pytest.fixture
def crc_off() -> Iterator[None]:
    """As in a persist helper: torch.save writes no zip CRC32 (replayed records need none)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    yield
    torch.serialization.set_crc32_options(before)


def _states(steps: int, blocks: list[int] | None = None, seed: int = 0) -> Iterator[StageState]:
    seed_all(seed)
    model, opt, sched = make_training(blocks if blocks is not None else range(4), seed)
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step)
        yield capture_state(model, opt, sched, step=step, data_cursor={"batch": step}).clone()


def test_replayed_files_are_the_ones_dcp_save_writes(tmp_path: Path, crc_off: None) -> None:
    tier = DurableTier(tmp_path / "ckpt", keep_last=5, reuse_layout=True)
    states = list(_states(3))
    for state in states:
        tier.save(state)
    assert tier.replayed == 2 and tier.layout_error is None  # steps 2 and 3
    for state in states:
        assert_same_state(tier.read(state.step), state)

    # The same bytes as a fresh dcp.save of step 3's tensors; the metadata differs only in
    # the save's identity.
    fresh = tmp_path / "fresh"
    dcp.save(dict(states[2].tensors), checkpoint_id=str(fresh), no_dist=True)
    step_dir = tmp_path / "ckpt" / "step-00000003"
    assert (step_dir / "__0_0.distcp").read_bytes() == (fresh / "__0_0.distcp").read_bytes()
    ours = pickle.loads((step_dir / ".metadata").read_bytes())
    theirs = pickle.loads((fresh / ".metadata").read_bytes())
    assert ours.storage_data == theirs.storage_data
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_meta.checkpoint_id == str(step_dir)
    assert ours.storage_meta.save_id != pickle.loads(
        (tmp_path / "ckpt" / "step-00000002" / ".metadata").read_bytes()).storage_meta.save_id

    # Plain DCP readers read a replayed checkpoint.
    sd = {k: torch.empty_like(v) for k, v in states[2].tensors.items()}
    dcp.load(sd, checkpoint_id=str(step_dir), no_dist=True)
    assert_same_tensors(sd, dict(states[2].tensors))
    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    assert_same_tensors(torch.load(tmp_path / "whole.pt", weights_only=True),
                        dict(states[2].tensors))


def test_a_changed_layout_is_saved_by_dcp_and_then_replayed(tmp_path: Path,
                                                            crc_off: None) -> None:
    tier = DurableTier(tmp_path, keep_last=10, reuse_layout=True)
    s1, s2, s3, s4, s5 = _states(5)
    grown = {**s2.tensors, "extra.weight": torch.arange(6.0)}
    reshaped = {**s4.tensors, "extra.weight": torch.arange(6.0).reshape(2, 3)}
    written = [
        s1,
        replace(s2, tensors=grown),  # a tensor more: dcp.save
        replace(s3, tensors={**s3.tensors, "extra.weight": torch.ones(6)}),  # same: replayed
        replace(s4, tensors=reshaped),  # same name, another shape: dcp.save
        replace(s5, tensors={**s5.tensors,
                             "extra.weight": torch.ones(6, dtype=torch.float64)}),  # dtype
    ]
    replayed = []
    for state in written:
        before = tier.replayed
        tier.save(state)
        replayed.append(tier.replayed > before)
    assert replayed == [False, False, True, False, False]
    for state in written:
        assert_same_state(tier.read(state.step), state)


def _data_file(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}" / "__0_0.distcp"


def test_retention_hands_the_oldest_data_file_to_the_next_write(tmp_path: Path,
                                                                crc_off: None) -> None:
    root = tmp_path / "ckpt"
    tier = DurableTier(root, keep_last=2, reuse_layout=True)
    states = list(_states(5))
    inodes = {}
    for state in states:
        tier.save(state)
        inodes[state.step] = _data_file(root, state.step).stat().st_ino
        assert sorted(p.name for p in root.iterdir()) == [
            f"step-{s:08d}" for s in range(max(1, state.step - 1), state.step + 1)]
    # Steps 3, 4 and 5 were written into the files of steps 1, 2 and 3 (step 2's write had
    # nothing to delete: with keep_last=2 the newest committed checkpoint, step 1, stays).
    assert tier.recycled == 3 and tier.replayed == 4
    assert (inodes[3], inodes[4], inodes[5]) == (inodes[1], inodes[2], inodes[1])
    for state in states[3:]:
        assert_same_state(tier.read(state.step), state)
    fresh = tmp_path / "fresh"
    dcp.save(dict(states[4].tensors), checkpoint_id=str(fresh), no_dist=True)
    assert _data_file(root, 5).read_bytes() == (fresh / "__0_0.distcp").read_bytes()


def test_a_half_written_data_file_is_not_overwritten_in_place(tmp_path: Path,
                                                              crc_off: None) -> None:
    root = tmp_path / "ckpt"
    tier = DurableTier(root, keep_last=3, reuse_layout=True)
    s1, s2, s3, s4 = _states(4)
    tier.save(s1)
    tier.save(s2)
    # A write of step 3 that died midway: half its data file, no marker.
    shutil.copytree(root / "step-00000002", root / "step-00000003")
    (root / "step-00000003" / "COMMITTED.json").unlink()
    half = _data_file(root, 3).stat().st_size // 2
    with _data_file(root, 3).open("r+b") as fh:
        fh.truncate(half)
    tier.save(s4)  # deletes step 3 first: incomplete and older than the step written
    assert tier.recycled == 0 and tier.replayed == 2
    assert [(i.step, i.committed) for i in tier.checkpoints()] == [(1, True), (2, True),
                                                                  (4, True)]
    assert sorted(p.name for p in root.iterdir()) == [
        "step-00000001", "step-00000002", "step-00000004"]
    assert_same_state(tier.read(4), s4)
    assert_same_state(tier.read(1), s1)


def test_with_crc32_on_every_write_is_a_dcp_save(tmp_path: Path) -> None:
    assert torch.serialization.get_crc32_options()  # torch's default
    tier = DurableTier(tmp_path, reuse_layout=True)
    states = list(_states(2))
    for state in states:
        tier.save(state)
    assert tier.replayed == 0
    assert "CRC32 is on" in (tier.layout_error or "")
    assert_same_state(tier.read(2), states[1])


def test_learning_checks_the_bytes_where_the_records_say(tmp_path: Path, crc_off: None) -> None:
    s1, s2 = _states(2)
    metadata = dcp.save(dict(s1.tensors), checkpoint_id=str(tmp_path), no_dist=True)
    layout = DcpLayout.learn(str(tmp_path), metadata, s1.tensors, rank=0)
    assert layout.matches(s2.tensors) and not layout.matches({**s2.tensors, "x": torch.ones(1)})
    with pytest.raises(LayoutError, match="are not where its record says"):
        DcpLayout.learn(str(tmp_path), metadata, s2.tensors, rank=0)  # other values
    (tmp_path / "__0_0.distcp").write_bytes(b"not a zip")
    with pytest.raises(LayoutError, match="is not a torch.save zip"):
        DcpLayout.learn(str(tmp_path), metadata, s1.tensors, rank=0)


@pytest.mark.timeout(60)
def test_full_disk_while_replaying_keeps_the_previous_checkpoint(tmp_path: Path,
                                                                crc_off: None) -> None:
    small = tmp_path / "small"
    if not mount_tmpfs(small, "size=1m"):
        pytest.skip("needs root to mount a small tmpfs (a full disk cannot be faked without mocks)")
    try:
        tier = DurableTier(small, keep_last=10, reuse_layout=True)
        seed_all(0)
        model, opt, sched = make_training(dim=64)
        committed = save_until_the_disk_is_full(tier, model, opt, sched)
        assert tier.replayed == len(committed) - 1 >= 1  # it failed in a replayed write
        # The failed write forgot the layout: the next one is a dcp.save, on every rank.
        shutil.rmtree(small / f"step-{committed[0]:08d}")  # room for one more
        train_step(model, opt, sched, 10, dim=64)
        state = capture_state(model, opt, sched, step=10)
        tier.save(state)
        assert tier.replayed == len(committed) - 1
        assert_same_state(tier.read(10), state)
    finally:
        subprocess.run(["umount", str(small)], check=False)


def _replay_two_stages(rank: int, world: int, root: str) -> None:
    torch.serialization.set_crc32_options(False)
    tier = DurableTier(root, keep_last=2, reuse_layout=True)
    for state in _states(5, blocks=STAGES_OF_2[rank], seed=rank):
        tier.save(state)
    counts = torch.tensor([tier.replayed, tier.recycled])
    dist.all_reduce(counts, op=dist.ReduceOp.MIN)
    # Every rank replayed steps 2-5 and wrote 3-5 into its own files of steps 1-3.
    assert counts.tolist() == [4, 3]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_replay_and_one_process_reads_the_whole_model(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(_replay_two_stages, 2, str(tmp_path), str(root))
    tier = DurableTier(root)
    assert [(i.step, i.committed, i.num_ranks) for i in tier.checkpoints()] == [
        (4, True, 2), (5, True, 2)]
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000005"]
    for step in (4, 5):
        expected: dict[str, torch.Tensor] = {}
        for rank, blocks in STAGES_OF_2.items():
            expected.update(list(_states(step, blocks=blocks, seed=rank))[-1].tensors)
        assert_same_tensors(dict(tier.read(step).tensors), expected)
        sd = {k: torch.empty_like(v) for k, v in expected.items()}
        dcp.load(sd, checkpoint_id=str(root / f"step-{step:08d}"), no_dist=True)
        assert_same_tensors(sd, expected)
