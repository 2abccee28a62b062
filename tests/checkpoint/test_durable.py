"""Tests for checkpoint/tiers/durable.py: DCP format, commit, retention, reshard, bad input."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from bubbleguard.checkpoint.errors import IncompleteCheckpointError, StateMismatchError
from bubbleguard.checkpoint.manifest import MARKER_NAME
from bubbleguard.checkpoint.state import capture_state, restore_state, stage_selector
from bubbleguard.checkpoint.tiers.durable import DurableTier
from tests.checkpoint.ckpt_testlib import (
    STAGES_OF_2,
    assert_same_state,
    assert_same_tensors,
    make_training,
    mount_tmpfs,
    read_only_dir,
    run_ranks,
    save_two_stages,
    save_until_the_disk_is_full,
    seed_all,
    train_step,
    trained_state,
)


def test_round_trip_and_bit_identical_continuation(tmp_path: Path) -> None:
    model, opt, sched, state = trained_state(3)
    tier = DurableTier(tmp_path / "ckpt")  # missing root: created on the first write
    tier.save(state)
    assert tier.latest() == 3
    assert (tmp_path / "ckpt" / "step-00000003" / MARKER_NAME).is_file()
    back = tier.read()
    assert_same_state(back, state.clone())
    expected = [train_step(model, opt, sched, s) for s in (4, 5)]
    seed_all(99)
    model2, opt2, sched2 = make_training(seed=3)
    assert restore_state(back, model2, opt2, sched2).step == 3
    assert [train_step(model2, opt2, sched2, s) for s in (4, 5)] == expected


def test_plain_dcp_load_and_dcp_to_torch_save_read_it(tmp_path: Path) -> None:
    model, opt, _, state = trained_state(2)
    DurableTier(tmp_path).save(state)
    step_dir = tmp_path / "step-00000002"
    sd = {k: torch.empty_like(v) for k, v in model.state_dict().items()}
    dcp.load(sd, checkpoint_id=str(step_dir))
    assert_same_tensors(sd, dict(model.state_dict()))
    dcp_to_torch_save(step_dir, tmp_path / "whole.pt")
    whole = torch.load(tmp_path / "whole.pt", weights_only=True)
    assert_same_tensors(whole, {k: v.clone() for k, v in state.tensors.items()})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_two_ranks_save_disjoint_stages_one_and_three_stages_load(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    run_ranks(save_two_stages, 2, str(tmp_path), str(root))
    tier = DurableTier(root)
    assert [(i.step, i.committed, i.num_ranks) for i in tier.checkpoints()] == [(2, True, 2)]
    expected = {}
    for rank, blocks in STAGES_OF_2.items():
        *_, s = trained_state(2, blocks=blocks, seed=rank)
        expected.update({k: v.clone() for k, v in s.tensors.items()})

    whole = tier.read(2)  # one process, the whole model
    assert_same_tensors(dict(whole.tensors), expected)
    model, opt, sched = make_training()
    restore_state(whole, model, opt, sched)  # hyperparameters merged from both ranks by FQN
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]

    for stage_blocks in ([0], [1, 2], [3]):  # three stages of a different split
        stage, stage_opt, stage_sched = make_training(stage_blocks, seed=11)
        part = tier.read(2, select=stage_selector(stage))
        assert set(part.tensors) == {n for n in expected if stage_selector(stage)(n)}
        result = restore_state(part, stage, stage_opt, stage_sched)
        assert result.step == 2 and result.unexpected == ()
        for name, t in stage.state_dict().items():
            assert torch.equal(t, expected[name]), name
        for fqn, p in stage.named_parameters():
            assert torch.equal(stage_opt.state[p]["exp_avg"], expected[f"optim.{fqn}.exp_avg"])


def test_half_written_checkpoint_is_ignored_and_reported(tmp_path: Path) -> None:
    model, opt, sched, s1 = trained_state(1)
    tier = DurableTier(tmp_path)
    tier.save(s1)
    train_step(model, opt, sched, 2)
    tier.write(capture_state(model, opt, sched, step=2))  # crash before commit
    assert tier.latest() == 1
    infos = tier.checkpoints()
    assert [(i.step, i.committed) for i in infos] == [(1, True), (2, False)]
    assert "no commit marker" in (infos[1].reason or "")
    with pytest.raises(IncompleteCheckpointError, match="step-00000002 has no commit marker"):
        tier.read(2)
    assert tier.read().step == 1


def test_retention_keeps_the_newest_and_removes_stale_partials(tmp_path: Path) -> None:
    model, opt, sched = make_training()
    tier = DurableTier(tmp_path, keep_last=2)
    for step in range(1, 5):
        train_step(model, opt, sched, step)
        state = capture_state(model, opt, sched, step=step)
        if step == 2:
            tier.write(state)  # never committed
        else:
            tier.save(state)
    assert [(i.step, i.committed) for i in tier.checkpoints()] == [(3, True), (4, True)]


@pytest.mark.parametrize("keep_last,while_writing,after", [
    (2, [(2, True), (3, False)], [(2, True), (3, True)]),
    (3, [(1, True), (2, True), (3, False)], [(1, True), (2, True), (3, True)]),
    (1, [(2, True), (3, False)], [(3, True)]),
])
def test_retention_makes_room_before_a_write_but_keeps_the_newest(
        tmp_path: Path, keep_last: int, while_writing: list[tuple[int, bool]],
        after: list[tuple[int, bool]]) -> None:
    # The oldest checkpoints go just before the write (their freed pages are reused by it);
    # the newest committed one stays until the new one commits, also with keep_last=1.
    model, opt, sched = make_training()
    tier = DurableTier(tmp_path, keep_last=keep_last)
    for step in (1, 2):
        train_step(model, opt, sched, step)
        tier.save(capture_state(model, opt, sched, step=step))
    train_step(model, opt, sched, 3)
    tier.write(capture_state(model, opt, sched, step=3))
    assert [(i.step, i.committed) for i in tier.checkpoints()] == while_writing
    assert tier.latest() == 2
    tier.commit(3)
    assert [(i.step, i.committed) for i in tier.checkpoints()] == after


def test_listing_while_retention_deletes(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A rank or `inspect` lists the checkpoints while the persist helper's retention deletes
    # old ones: a directory that goes between the root's listing and its own is left out.
    model, opt, sched = make_training()
    tier = DurableTier(tmp_path, keep_last=5)
    for step in (1, 2, 3):
        train_step(model, opt, sched, step)
        tier.save(capture_state(model, opt, sched, step=step))
    writer = DurableTier(tmp_path, keep_last=1)  # another process's view: keeps only step 3
    real_ls = tier.fs.ls
    deleted = []

    def ls_then_retention(path: str, detail: bool = True, **kwargs: object) -> object:
        listing = real_ls(path, detail=detail, **kwargs)
        if path.rstrip("/") == tier.root.rstrip("/") and not deleted:
            deleted.append(path)  # once (both tiers share fsspec's cached filesystem)
            writer._retain()  # deletes steps 1 and 2 after the root was listed
        return listing

    monkeypatch.setattr(tier.fs, "ls", ls_then_retention)
    assert [(i.step, i.committed) for i in tier.checkpoints()] == [(3, True)]
    assert tier.latest() == 3
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000003"]


def test_a_half_deleted_checkpoint_reads_as_incomplete(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # Retention removes the commit marker before the files: stopped midway (a crash, or a
    # reader looking in between), the old step is incomplete, never committed with files gone.
    model, opt, sched = make_training()
    tier = DurableTier(tmp_path, keep_last=5)
    for step in (1, 2):
        train_step(model, opt, sched, step)
        tier.save(capture_state(model, opt, sched, step=step))
    real_rm = tier.fs.rm

    def rm_stops_after_the_marker(path: str, recursive: bool = False, **kwargs: object) -> None:
        if recursive:
            raise OSError("stopped midway")  # _discard is best effort: the error is swallowed
        real_rm(path, recursive=recursive, **kwargs)

    monkeypatch.setattr(tier.fs, "rm", rm_stops_after_the_marker)
    tier._discard(1)
    monkeypatch.undo()
    assert (tmp_path / "step-00000001" / ".metadata").exists()
    infos = tier.checkpoints()
    assert [(i.step, i.committed) for i in infos] == [(1, False), (2, True)]
    assert "no commit marker" in (infos[0].reason or "")
    assert tier.latest() == 2
    tier.save(capture_state(model, opt, sched, step=3))  # the next retention removes it
    assert [i.step for i in tier.checkpoints()] == [2, 3]


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="names fds through /proc")
def test_the_commit_syncs_dcp_metadata_before_writing_the_marker(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # DCP syncs .metadata before flushing the buffered stream it pickled it into: a pickle
    # under the 8 KiB buffer (this one-block model's, 17 tensors) is still in the buffer at
    # that sync (seen: the file was 0 bytes long then), so it was not on disk when the marker
    # said the checkpoint was complete. The commit syncs it first.
    *_, state = trained_state(1, blocks=[0])
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync_and_record(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_and_record)
    DurableTier(tmp_path).save(state)
    monkeypatch.undo()
    assert (tmp_path / "step-00000001" / ".metadata").stat().st_size < 8192
    marker_tmp = [i for i, name in enumerate(synced) if name.startswith(f".{MARKER_NAME}.")]
    assert len(marker_tmp) == 1
    assert ".metadata" in synced[:marker_tmp[0]]


def test_different_model_is_named_on_restore(tmp_path: Path) -> None:
    *_, state = trained_state(1, blocks=[0, 1])
    tier = DurableTier(tmp_path)
    tier.save(state)
    other, other_opt, _ = make_training(blocks=[3])
    with pytest.raises(StateMismatchError, match=r"missing tensor\(s\) \['blocks.3.lin.bias'"):
        restore_state(tier.read(select=stage_selector(other)), other, other_opt)


def test_fsspec_url(tmp_path: Path) -> None:
    *_, state = trained_state(1)
    tier = DurableTier("memory://bubbleguard-test/run1")
    tier.save(state)
    assert tier.latest() == 1
    assert_same_state(tier.read(1), state.clone())


def test_root_that_is_a_file_and_no_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError, match="is not a directory"):
        DurableTier(tmp_path / "f")
    with pytest.raises(FileNotFoundError, match="no committed checkpoint under"):
        DurableTier(tmp_path / "empty").read()


@pytest.mark.timeout(60)
def test_full_disk_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    small = tmp_path / "small"
    if not mount_tmpfs(small, "size=1m"):
        pytest.skip("needs root to mount a small tmpfs (a full disk cannot be faked without mocks)")
    try:
        model, opt, sched = make_training(dim=64)
        save_until_the_disk_is_full(DurableTier(small, keep_last=10), model, opt, sched)
    finally:
        subprocess.run(["umount", str(small)], check=False)


@pytest.mark.timeout(60)
def test_read_only_directory(tmp_path: Path) -> None:
    with read_only_dir(tmp_path / "ro") as ro:
        *_, state = trained_state(1)
        with pytest.raises(PermissionError, match=f"{ro} is not writable"):
            DurableTier(ro).save(state)
