"""Tests for checkpoint/tiers/shm.py: the shared-memory snapshot tier."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import stat
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from bubbleguard.checkpoint.errors import CorruptSnapshotError, IncompleteCheckpointError
from bubbleguard.checkpoint.layout import NATIVE_COPY_AVAILABLE
from bubbleguard.checkpoint.state import StageState
from bubbleguard.checkpoint.tiers.shm import MemoryTier, remove_job, shm_job_dir
from bubbleguard.elastic.forking import process_target
from tests.checkpoint.ckpt_testlib import (
    assert_same_state,
    assert_same_tensors,
    train_step,
    trained_state,
    write_then_die,
)

CHUNK = 1024  # small chunks so that the tiny model spans many


@pytest.fixture(params=["native", "numpy"])
def tier(tmp_path: Path, request: pytest.FixtureRequest):
    """A tier copying through the C extension, or through NumPy (the fallback)."""
    native = request.param == "native"
    if native and not NATIVE_COPY_AVAILABLE:
        pytest.skip("the C extension _copysum was not built")
    t = MemoryTier("job", 0, root=tmp_path, chunk_bytes=CHUNK, native_copy=native)
    yield t
    t.cleanup()


def test_round_trip_is_identical_and_private(tier: MemoryTier, tmp_path: Path) -> None:
    *_, state = trained_state(2)
    layout = tier.begin(state)
    assert layout.num_chunks > 4
    for cid in reversed(range(layout.num_chunks)):  # any order, e.g. as bubbles come
        tier.copy_chunk(cid)
    assert tier.pending_chunks() == []
    record = tier.finish()
    assert record.step == 2 and len(record.checksums) == layout.num_chunks
    assert_same_state(tier.read(2), state)
    assert_same_state(tier.read_latest(), state)
    for d in (tmp_path / f"bubbleguard-{os.getuid()}", shm_job_dir("job", tmp_path), tier.rank_dir):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d
    for f in tier.rank_dir.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f


def test_a_state_without_tensors_round_trips(tier: MemoryTier) -> None:
    # A stage may hold no tensors worth a byte (and a benchmark filtered them all away once):
    # its slot file still maps (mmap refuses a zero-length file).
    for step in (1, 2, 3):  # every slot, then one reused
        tier.write(StageState(step=step, tensors={}, metadata={"step": step}))
    state = tier.read(3)
    assert state.step == 3 and dict(state.tensors) == {} and state.metadata == {"step": 3}


def test_a_mapped_snapshot_is_the_slot_file_itself_checked(tier: MemoryTier) -> None:
    *_, state = trained_state(2)
    tier.write(state)
    record = tier.records()[0]
    with tier.mapped(2) as snap:
        assert_same_state(snap, state)
        # Not a copy: a byte written into the file shows through the tensor.
        name, tensor = next((k, v) for k, v in snap.tensors.items()
                            if v.dtype == torch.float32 and v.numel())
        where = next(t for t in record.layout.tensors if t.name == name)
        with open(tier.rank_dir / f"slot{record.slot}.bin", "r+b") as f:
            f.seek(where.region_offset)
            f.write(struct.pack("<f", 123.5))
        assert tensor.reshape(-1)[0].item() == 123.5
    chunk = where.region_offset // CHUNK
    with pytest.raises(CorruptSnapshotError, match=f"chunk {chunk} .* fails its sum64"), \
            tier.mapped(2):
        pass


def test_a_mapped_snapshot_follows_its_slot_file_when_it_is_replaced(tier: MemoryTier) -> None:
    """The mapping kept between persists is of the file that is there now: a slot file
    replaced by a short one, or gone, is named as such, not read through the old mapping."""
    *_, state = trained_state(2)
    tier.write(state)
    record = tier.records()[0]
    data = tier.rank_dir / f"slot{record.slot}.bin"
    with tier.mapped(2) as snap:
        assert_same_state(snap, state)
    short = data.with_suffix(".tmp")
    short.write_bytes(data.read_bytes()[:100])
    os.replace(short, data)
    with pytest.raises(CorruptSnapshotError, match=rf"{data} holds 100 bytes, its record "
                                                   rf"expects {record.layout.total_bytes}"), \
            tier.mapped(2):
        pass
    data.unlink()
    with pytest.raises(CorruptSnapshotError, match=f"data file {data} is missing"), \
            tier.mapped(2):
        pass


def test_readers_see_every_slot_a_writer_used(tmp_path: Path) -> None:
    # A GPU job's tier keeps three slots; its persist helper and a later resume open the tier
    # without saying how many: the files tell them.
    writer = MemoryTier("job", 0, root=tmp_path, chunk_bytes=CHUNK, num_slots=3)
    *_, state = trained_state(2)
    for step in (4, 5, 6):
        writer.write(StageState(step=step, tensors=state.tensors, metadata={}))
    reader = MemoryTier("job", 0, root=tmp_path, create=False)
    assert reader.num_slots == 3 and reader.steps() == [6, 5, 4]
    assert_same_tensors(dict(reader.read(4).tensors), dict(state.tensors))
    assert MemoryTier("job", 0, root=tmp_path).num_slots == 3  # a writer too
    writer.cleanup()


def test_two_slots_keep_the_last_complete_snapshot_while_writing(tier: MemoryTier) -> None:
    model, opt, sched, s2 = trained_state(2)
    tier.write(s2)
    s2 = s2.clone()
    from bubbleguard.checkpoint.state import capture_state

    train_step(model, opt, sched, 3)
    tier.begin(capture_state(model, opt, sched, step=3))
    tier.copy_chunk(0)
    assert tier.steps() == [2]
    assert_same_state(tier.read_latest(), s2)  # still valid mid-write
    tier.finish()
    assert tier.steps() == [3, 2]
    train_step(model, opt, sched, 4)
    tier.begin(capture_state(model, opt, sched, step=4))
    assert tier.steps() == [3]  # the older slot (step 2) is the one being overwritten
    tier.finish()
    assert tier.steps() == [4, 3]


def test_slot_files_are_allocated_once(tier: MemoryTier) -> None:
    model, opt, sched, state = trained_state(1)
    from bubbleguard.checkpoint.state import capture_state

    tier.write(state)
    inodes = {p.name: p.stat().st_ino for p in tier.rank_dir.glob("*.bin")}
    mapped = list(tier._slots)
    for step in range(2, 6):
        train_step(model, opt, sched, step)
        tier.write(capture_state(model, opt, sched, step=step))
    assert {p.name: p.stat().st_ino for p in tier.rank_dir.glob("*.bin")} | inodes == {
        p.name: p.stat().st_ino for p in tier.rank_dir.glob("*.bin")
    }
    assert tier._slots[0] is mapped[0]


def test_corrupt_chunk_is_named_and_the_older_slot_is_used(tier: MemoryTier) -> None:
    model, opt, sched, s2 = trained_state(2)
    tier.write(s2)
    s2 = s2.clone()
    from bubbleguard.checkpoint.state import capture_state

    train_step(model, opt, sched, 3)
    tier.write(capture_state(model, opt, sched, step=3))
    record = tier.records()[0]
    assert record.step == 3
    data = tier.rank_dir / f"slot{record.slot}.bin"
    with open(data, "r+b") as f:  # flip one byte inside chunk 2
        f.seek(2 * CHUNK + 5)
        b = f.read(1)
        f.seek(2 * CHUNK + 5)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(
        CorruptSnapshotError, match=rf"chunk 2 \(bytes {2 * CHUNK}-{3 * CHUNK}\) of {data}"
    ):
        tier.read(3)
    with pytest.warns(UserWarning, match="chunk 2"):
        assert_same_state(tier.read_latest(), s2)
    assert tier.valid_steps() == [2]


def test_snapshot_survives_sigkill_of_the_writer(tmp_path: Path) -> None:
    method, target = process_target(write_then_die)
    child = multiprocessing.get_context(method).Process(target=target,
                                                        args=(str(tmp_path), "crash", CHUNK))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    *_, expected = trained_state(2)
    # The child never touched a GPU; this process may have (its CUDA RNG state is captured).
    expected = StageState(expected.step, expected.tensors,
                          {k: v for k, v in expected.local_tensors.items()
                           if not k.startswith("rng.cuda")}, expected.metadata)
    reader = MemoryTier("crash", 0, root=tmp_path, create=False)
    assert reader.steps() == [2]  # the half-copied step 3 has no record
    assert_same_state(reader.read_latest(), expected)
    remove_job("crash", tmp_path)
    assert not shm_job_dir("crash", tmp_path).exists()


def test_commit_marker_needs_every_rank(tmp_path: Path) -> None:
    *_, state = trained_state(1, blocks=[0, 1])
    *_, other = trained_state(1, blocks=[2, 3])
    r0 = MemoryTier("j", 0, num_ranks=2, root=tmp_path, chunk_bytes=CHUNK)
    r1 = MemoryTier("j", 1, num_ranks=2, root=tmp_path, chunk_bytes=CHUNK)
    r0.write(state)
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\] have no complete snapshot"):
        r0.commit(1)
    assert r0.latest() is None
    r1.write(other)
    r0.commit(1)
    assert r0.latest() == 1 and r1.latest() == 1
    r0.cleanup()
    r1.cleanup()
    assert not shm_job_dir("j", tmp_path).exists()


def test_commit_reads_each_record_once_and_sees_replacements(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """commit() is retried in every wait until the last rank is done: a retry that finds no
    new record parses nothing, a record replaced since (a newer step, or garbage) is read again,
    and the committing rank's own records, which it wrote, are never parsed."""
    from bubbleguard.checkpoint.tiers import shm

    parsed: list[str] = []
    real = shm._record_summary

    def counting(path: str, rank: int):
        parsed.append(Path(path).name)
        return real(path, rank)

    monkeypatch.setattr(shm, "_record_summary", counting)
    model, opt, sched, state = trained_state(1, blocks=[0, 1])
    *_, other = trained_state(1, blocks=[2, 3])
    r0 = MemoryTier("j", 0, num_ranks=2, root=tmp_path, chunk_bytes=CHUNK)
    r1 = MemoryTier("j", 1, num_ranks=2, root=tmp_path, chunk_bytes=CHUNK)
    r0.write(state)
    for _ in range(3):
        with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\]"):
            r0.commit(1)
    assert parsed == []  # rank 0 knows its own record; rank 1 has none
    r1.write(other)
    r0.commit(1)
    assert parsed == ["slot0.json"] and r0.latest() == 1  # rank 1's, once
    # Step 2 on both ranks: one new record each, read once.
    from bubbleguard.checkpoint.state import capture_state

    train_step(model, opt, sched, 2)
    r0.write(capture_state(model, opt, sched, step=2))
    r1.write(dataclasses.replace(other, step=2))
    parsed.clear()
    r0.commit(2)
    r0.commit(2)
    assert parsed == ["slot1.json"] and r0.latest() == 2
    # Rank 1's record of step 2 replaced by garbage (a new file, as every record is written):
    # step 2 is no longer complete there; the marker written before stays.
    garbage = r1.rank_dir / "slot1.json.tmp"
    garbage.write_text("{not json")
    os.replace(garbage, r1.rank_dir / "slot1.json")
    with pytest.raises(IncompleteCheckpointError, match=r"ranks \[1\] have no complete snapshot of"):
        r0.commit(2)
    assert r0.latest() == 2
    r0.cleanup()
    r1.cleanup()


def test_hold_rebuilds_only_the_record_of_its_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A persist holds one step: the helper's tier (a reader) rebuilds that record's layout
    only, and the writer's tier, which made the records, rebuilds none."""
    from bubbleguard.checkpoint.state import capture_state
    from bubbleguard.checkpoint.tiers import shm

    rebuilt: list[str] = []
    real = shm._load_record_file

    def counting(path: str | Path) -> shm.SnapshotRecord | None:
        rebuilt.append(Path(path).name)
        return real(path)

    monkeypatch.setattr(shm, "_load_record_file", counting)
    model, opt, sched, state = trained_state(1)
    writer = MemoryTier("j", 0, root=tmp_path, chunk_bytes=CHUNK)
    writer.write(state)
    reader = MemoryTier("j", 0, root=tmp_path, create=False)  # knows step 1's record
    for step in (2, 3):  # two more slots, changed since the reader looked
        train_step(model, opt, sched, step)
        writer.write(capture_state(model, opt, sched, step=step))
    rebuilt.clear()
    with writer.hold(2) as mine:
        assert mine.step == 2 and rebuilt == []
    with reader.hold(2) as record:
        assert record.step == 2 and rebuilt == [f"slot{record.slot}.json"]
    with reader.hold(2):  # unchanged since: nothing to rebuild
        assert rebuilt == [f"slot{record.slot}.json"]
    with pytest.raises(FileNotFoundError, match="holds no complete snapshot of step 9"):
        reader.hold(9).__enter__()
    writer.cleanup()


def test_begin_waits_for_a_held_slot(tier: MemoryTier) -> None:
    model, opt, sched, state = trained_state(1)
    from bubbleguard.checkpoint.state import capture_state

    tier.write(state)
    train_step(model, opt, sched, 2)
    tier.write(capture_state(model, opt, sched, step=2))
    train_step(model, opt, sched, 3)
    s3 = capture_state(model, opt, sched, step=3)
    with tier.hold(1):  # a persist still reads step 1, the slot step 3 would take
        t = threading.Thread(target=tier.begin, args=(s3,))
        t.start()
        time.sleep(0.3)
        assert t.is_alive()
        assert tier.steps() == [2, 1]
    t.join(10)
    assert not t.is_alive()
    tier.finish()
    assert tier.steps() == [3, 2]


def test_layout_change_reallocates(tier: MemoryTier) -> None:
    *_, small = trained_state(1, blocks=[0])
    *_, big = trained_state(2)
    tier.write(small)
    tier.write(big)
    assert_same_state(tier.read(2), big)
    assert tier.read(1).tensors.keys() == small.tensors.keys()
    sizes = sorted(p.stat().st_size for p in tier.rank_dir.glob("*.bin"))
    assert sizes[0] < sizes[1]


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="job_id '../x'"):
        MemoryTier("../x", 0, root=tmp_path)
    with pytest.raises(ValueError, match="num_slots must be >= 2"):
        MemoryTier("j", 0, root=tmp_path, num_slots=1)
    with pytest.raises(FileNotFoundError, match="shared-memory root .*nowhere does not exist"):
        MemoryTier("j", 0, root=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no memory-tier snapshots for rank 0"):
        MemoryTier("absent", 0, root=tmp_path, create=False)
    with pytest.raises(ValueError, match="native_copy computes sum64 checksums, not 'crc32'"):
        MemoryTier("j", 0, root=tmp_path, checksum="crc32", native_copy=True)
    t = MemoryTier("j", 0, root=tmp_path)
    with pytest.raises(RuntimeError, match="without begin"):
        t.copy_chunk(0)
    with pytest.raises(FileNotFoundError, match="no complete memory-tier snapshot"):
        t.read_latest()
    assert torch.get_num_threads() >= 1



@pytest.mark.skipif(not NATIVE_COPY_AVAILABLE, reason="the C extension _copysum was not built")
def test_stale_padding_in_a_reused_slot_is_zeroed_for_native_copies(tmp_path: Path) -> None:
    # Native copies sum only the tensors' bytes, so a slot file whose padding holds old bytes
    # (another layout, another process) must be cleaned first, or its checksums would not verify.
    *_, state = trained_state(2)
    first = MemoryTier("pad", 0, root=tmp_path, chunk_bytes=CHUNK, native_copy=True)
    layout = first.begin(state)
    first.finish()
    first.write(state)  # both slots exist now
    first.close()
    assert layout.padding()
    for path in first.rank_dir.glob("slot*.bin"):
        data = bytearray(path.read_bytes())
        for start, end in layout.padding():
            data[start:end] = b"\xff" * (end - start)
        path.write_bytes(bytes(data))
    again = MemoryTier("pad", 0, root=tmp_path, chunk_bytes=CHUNK, native_copy=True)
    for step in (3, 4):  # through both slots
        again.write(type(state)(step=step, tensors=state.tensors,
                                local_tensors=state.local_tensors, metadata=state.metadata))
        read = again.read(step)
        assert read.step == step
        assert_same_tensors(dict(read.tensors), dict(state.tensors))
        assert_same_tensors(dict(read.local_tensors), dict(state.local_tensors))
    for path in again.rank_dir.glob("slot*.bin"):
        data = path.read_bytes()
        assert all(data[a:b] == bytes(b - a) for a, b in layout.padding())
    again.cleanup()


def test_read_into_a_reused_buffer(tier: MemoryTier) -> None:
    # The persist helper reads every snapshot into one buffer instead of fresh memory each time.
    *_, state = trained_state(2)
    tier.write(state)
    out = torch.full((state.num_bytes + 4096,), 7, dtype=torch.uint8)
    read = tier.read(2, out=out)
    assert_same_state(read, state)
    base = out.data_ptr()
    for name, t in read.all_tensors().items():
        # inside `out`, and a storage of exactly its bytes, so DCP writes it without a clone
        assert base <= t.data_ptr() and t.data_ptr() + t.nbytes <= base + out.numel(), name
        assert t.untyped_storage().nbytes() == t.nbytes, name
    out[:] = 0  # the tensors are views of `out`, not copies
    assert all(not t.any() for t in read.all_tensors().values())
    with pytest.raises(ValueError, match="out must be a flat uint8 tensor of >= "):
        tier.read(2, out=torch.empty(16, dtype=torch.uint8))
