"""Tests for checkpoint/layout.py: chunks partition the region, copies round-trip."""

from __future__ import annotations

import contextlib
import os
import shutil
import sysconfig
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbleguard.checkpoint.checksum import MASK64, checksum
from bubbleguard.checkpoint.layout import (
    DEFAULT_CHUNK_BYTES,
    DEVICE_CHUNK_BYTES,
    NATIVE_COPY_AVAILABLE,
    ChunkLayout,
    copy_chunk,
    copy_chunk_checksummed,
    copy_chunk_device,
    copy_chunk_native,
    default_chunk_bytes,
    flat_bytes,
    tensors_from_region,
    word_sum,
)

needs_native = pytest.mark.skipif(not NATIVE_COPY_AVAILABLE,
                                  reason="the C extension _copysum was not built")

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.uint8,
    torch.bool,
    torch.float64,
]


@st.composite
def tensor_sets(draw):
    n = draw(st.integers(0, 6))
    out = {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        out[f"t{i}.weight"] = (torch.rand(shape) * 100).to(dtype)
    return out


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), chunk_units=st.integers(1, 8))
def test_chunks_cover_every_tensor_byte_once_and_round_trip(tensors, chunk_units) -> None:
    layout = ChunkLayout.build(tensors, chunk_bytes=64 * chunk_units)
    assert layout.total_bytes % 64 == 0
    assert sum(layout.chunk_sizes()) == layout.total_bytes
    covered: dict[str, list[tuple[int, int]]] = {name: [] for name in tensors}
    for cid in range(layout.num_chunks):
        start, end = layout.chunk_range(cid)
        for seg in layout.segments(cid):
            assert start <= seg.region_offset and seg.region_offset + seg.num_bytes <= end
            covered[seg.name].append((seg.tensor_offset, seg.tensor_offset + seg.num_bytes))
    for slot in layout.tensors:
        ranges = sorted(covered[slot.name])
        pos = 0
        for a, b in ranges:
            assert a == pos and b > a
            pos = b
        assert pos == slot.num_bytes
    region = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    copied = sum(
        copy_chunk(layout, cid, sources, region) for cid in reversed(range(layout.num_chunks))
    )
    assert copied == sum(t.numel() * t.element_size() for t in tensors.values())
    back = tensors_from_region(layout, region)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert ChunkLayout.from_json(layout.to_json()) == layout


def test_a_tensor_spans_chunks_and_a_chunk_spans_tensors() -> None:
    tensors = {"a": torch.zeros(40, dtype=torch.uint8), "b": torch.zeros(100, dtype=torch.uint8)}
    layout = ChunkLayout.build(tensors, chunk_bytes=128)
    # a at [0, 40), b at [64, 164): chunk 0 holds a and the start of b, chunk 1 the rest of b
    assert [
        (s.name, s.tensor_offset, s.region_offset, s.num_bytes) for s in layout.segments(0)
    ] == [
        ("a", 0, 0, 40),
        ("b", 0, 64, 64),
    ]
    assert [
        (s.name, s.tensor_offset, s.region_offset, s.num_bytes) for s in layout.segments(1)
    ] == [("b", 64, 128, 36)]
    assert layout.chunk_sizes() == (128, 64)


def test_matches_detects_shape_dtype_and_name_changes() -> None:
    tensors = {"a": torch.zeros(3), "b": torch.zeros(2, dtype=torch.int64)}
    layout = ChunkLayout.build(tensors)
    assert layout.matches(tensors)
    assert not layout.matches({"a": torch.zeros(4), "b": tensors["b"]})
    assert not layout.matches({"a": torch.zeros(3, dtype=torch.float64), "b": tensors["b"]})
    assert not layout.matches({"a": tensors["a"], "c": tensors["b"]})


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="multiple of 64, got 100"):
        ChunkLayout.build({"a": torch.zeros(1)}, chunk_bytes=100)
    layout = ChunkLayout.build({"a": torch.zeros(1)}, chunk_bytes=64)
    with pytest.raises(IndexError, match="chunk id 1 out of range"):
        layout.segments(1)
    obj = layout.to_json()
    obj["tensors"][0][3] = 8
    with pytest.raises(ValueError, match="tensor 'a' is inconsistent"):
        ChunkLayout.from_json(obj)


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), chunk_units=st.integers(1, 8), block_units=st.integers(1, 3),
       algorithm=st.sampled_from(["sum64", "crc32"]))
def test_fused_copy_and_checksum_equal_copy_then_checksum(
        tensors, chunk_units, block_units, algorithm) -> None:
    layout = ChunkLayout.build(tensors, chunk_bytes=64 * chunk_units)
    plain = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    fused = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    sources_np = {k: v.numpy() for k, v in sources.items()}
    for cid in range(layout.num_chunks):
        n = copy_chunk(layout, cid, sources, plain)
        start, end = layout.chunk_range(cid)
        assert copy_chunk_checksummed(layout, cid, sources_np, fused.numpy(), algorithm,
                                      block_bytes=64 * block_units) == (
            n, checksum(plain[start:end], algorithm))
        blocks = layout.blocks(cid, 64 * block_units)
        assert blocks[0].start == start and blocks[-1].end == end
        assert all(a.end == b.start for a, b in zip(blocks, blocks[1:], strict=False))
    assert torch.equal(plain, fused)


def test_block_size_must_be_a_multiple_of_64() -> None:
    layout = ChunkLayout.build({"w": torch.zeros(100)}, chunk_bytes=256)
    with pytest.raises(ValueError, match="block_bytes must be a positive multiple of 64, got 100"):
        layout.blocks(0, 100)


def test_padding_is_every_region_byte_no_tensor_covers() -> None:
    tensors = {"a": torch.zeros(3, dtype=torch.uint8), "b": torch.zeros(17),
               "c": torch.zeros(0), "d": torch.zeros(16, dtype=torch.int64)}
    layout = ChunkLayout.build(tensors, chunk_bytes=128)
    covered = torch.zeros(layout.total_bytes, dtype=torch.bool)
    for s in layout.tensors:
        covered[s.region_offset:s.region_offset + s.num_bytes] = True
    for start, end in layout.padding():
        assert not covered[start:end].any()
        covered[start:end] = True
    assert covered.all()
    assert layout.padding()[0] == (3, 64)  # after "a", up to "b"'s aligned start


@needs_native
@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), chunk_units=st.integers(1, 8))
def test_native_copy_equals_copy_then_checksum(tensors, chunk_units) -> None:
    layout = ChunkLayout.build(tensors, chunk_bytes=64 * chunk_units)
    plain = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    native = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # padding zero, as required
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    addresses = {k: v.data_ptr() for k, v in sources.items()}
    for cid in range(layout.num_chunks):
        n = copy_chunk(layout, cid, sources, plain)
        start, end = layout.chunk_range(cid)
        assert copy_chunk_native(layout, cid, addresses, native.data_ptr()) == (
            n, checksum(plain[start:end], "sum64"))
    assert torch.equal(plain, native)


@needs_native
@pytest.mark.parametrize("num_bytes", [0, 1, 64, 65, 3 * 4096 + 5, (1 << 20) + 61])
@pytest.mark.parametrize("piece_bytes", [64, 4096, 256 << 10])
@pytest.mark.parametrize("flag_on", [False, True])
@pytest.mark.parametrize("mode", ["YIELD", "ENTER_KERNEL"])
def test_copy_in_pieces_that_yield_equals_one_pass(num_bytes: int, piece_bytes: int,
                                                   flag_on: bool, mode: str) -> None:
    from bubbleguard.checkpoint._copysum import copy_sum64

    from bubbleguard import yielding

    if mode == "ENTER_KERNEL" and not yielding.idle_priority_is_reversible():
        pytest.skip("this process may not restore a thread's priority")
    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8)
    one, pieces = (torch.zeros(num_bytes + 8, dtype=torch.uint8) for _ in range(2))
    flag = yielding.YieldFlag(getattr(yielding, mode))
    flag.set(flag_on)
    whole = copy_sum64(one.data_ptr(), src.data_ptr(), num_bytes)
    assert copy_sum64(pieces.data_ptr(), src.data_ptr(), num_bytes, piece_bytes,
                      flag.address) == whole
    assert torch.equal(one, pieces) and torch.equal(pieces[:num_bytes], src)
    with pytest.raises(ValueError, match="piece_bytes must be a multiple of 64"):
        copy_sum64(pieces.data_ptr(), src.data_ptr(), num_bytes, 100, flag.address)


@needs_native
def test_an_enter_kernel_copy_runs_at_idle_priority_only_while_the_flag_is_set() -> None:
    # ENTER_KERNEL: the native copy lowers its own thread to SCHED_IDLE (GIL released) and is
    # back at normal priority when it returns; with the flag clear it never lowers it.
    import threading

    from bubbleguard.checkpoint._copysum import copy_sum64

    from bubbleguard import yielding

    if not yielding.idle_priority_is_reversible():
        pytest.skip("this process may not restore a thread's priority")
    num_bytes = 256 << 20  # tens of ms: long enough to be seen mid-copy
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.zeros(num_bytes, dtype=torch.uint8)
    for flag_on in (True, False):
        flag = yielding.YieldFlag(yielding.ENTER_KERNEL)
        flag.set(flag_on)
        done = threading.Event()
        after: list[int] = []

        def copier(flag: yielding.YieldFlag = flag, done: threading.Event = done,
                   after: list[int] = after) -> None:
            copy_sum64(dst.data_ptr(), src.data_ptr(), num_bytes, 4096, flag.address)
            after.append(os.sched_getscheduler(0))
            done.set()

        thread = threading.Thread(target=copier)
        thread.start()
        assert thread.native_id is not None
        policies = set()
        while not done.is_set():
            with contextlib.suppress(ProcessLookupError):
                policies.add(os.sched_getscheduler(thread.native_id))
            time.sleep(0.0002)
        thread.join()
        assert after == [os.SCHED_OTHER]
        if flag_on:
            assert os.SCHED_IDLE in policies, policies
        else:
            assert policies <= {os.SCHED_OTHER}, policies
    assert torch.equal(dst, src)


@needs_native
def test_a_thread_with_a_yield_flag_copies_chunks_identically() -> None:
    # The bubble helper thread's copies (flag installed, set while the training thread waits)
    # must give the bytes and checksums of the one-pass copy.
    import threading

    from bubbleguard import yielding

    tensors = {"a": torch.randn(300_000), "b": torch.randn(70_001).to(torch.float16)}
    layout = ChunkLayout.build(tensors, chunk_bytes=1 << 20)
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    addresses = {k: v.data_ptr() for k, v in sources.items()}
    plain = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    want = [copy_chunk_native(layout, c, addresses, plain.data_ptr())
            for c in range(layout.num_chunks)]
    got: list[tuple[int, int]] = []
    region = torch.zeros(layout.total_bytes, dtype=torch.uint8)

    def helper() -> None:
        flag = yielding.YieldFlag()
        flag.set(True)
        yielding.install(flag, piece_bytes=4096)
        assert yielding.current() == (4096, flag.address)
        got.extend(copy_chunk_native(layout, c, addresses, region.data_ptr())
                   for c in range(layout.num_chunks))

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert got == want and torch.equal(region, plain)
    assert yielding.current() is None  # installed on the helper thread only
    with pytest.raises(ValueError, match="piece_bytes must be a positive multiple of 64"):
        yielding.install(yielding.YieldFlag(), piece_bytes=1000)


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("num_bytes", [0, 1, 7, 8, 9, 63, 64, (1 << 20) + 61])
def test_word_sum_is_the_checksum_of_the_bytes_padded_to_a_word(device: str,
                                                                num_bytes: int) -> None:
    data = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, generator=torch.Generator()
                         .manual_seed(num_bytes)).to(device)
    padded = torch.zeros(-(-num_bytes // 8) * 8, dtype=torch.uint8)
    padded[:num_bytes] = data.cpu()
    assert int(word_sum(data)) & MASK64 == checksum(padded, "sum64")


@settings(max_examples=60, deadline=None)
@given(tensors=tensor_sets(), chunk_units=st.integers(1, 8),
       sums_device=st.sampled_from(["cpu", "meta"]))
def test_device_chunk_copy_sums_equal_copy_then_checksum(tensors, chunk_units,
                                                         sums_device) -> None:
    # The pieces whose tensors are on the sums' device are summed there (with sums on the CPU,
    # every piece: the device branch's arithmetic); the others on the host (sums on "meta",
    # which no piece is on: the host branch). tests/checkpoint/test_cuda.py runs both on a GPU.
    layout = ChunkLayout.build(tensors, chunk_bytes=64 * chunk_units)
    plain = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    queued = torch.zeros(layout.total_bytes, dtype=torch.uint8)  # padding zero, as required
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    for cid in range(layout.num_chunks):
        n = copy_chunk(layout, cid, sources, plain)
        start, end = layout.chunk_range(cid)
        sums = torch.zeros(len(layout.segments(cid)), dtype=torch.int64, device=sums_device)
        result = copy_chunk_device(layout, cid, sources, queued, sums)
        assert result is not None
        copied, host = result
        device_part = int(sums.sum()) if sums_device == "cpu" else 0
        if sums_device == "cpu":
            assert host == 0  # nothing summed on the host
        assert copied == n
        assert (host + device_part) & MASK64 == checksum(plain[start:end], "sum64")
    assert torch.equal(plain, queued)


def test_device_chunk_copy_wants_one_sum_per_piece() -> None:
    tensors = {"a": torch.arange(40, dtype=torch.float32), "b": torch.ones(3)}
    layout = ChunkLayout.build(tensors, chunk_bytes=1024)
    region = torch.zeros(layout.total_bytes, dtype=torch.uint8)
    sources = {k: flat_bytes(v) for k, v in tensors.items()}
    with pytest.raises(ValueError, match="chunk 0 has 2 pieces, sums has 1"):
        copy_chunk_device(layout, 0, sources, region, torch.zeros(1, dtype=torch.int64))


@needs_native
@pytest.mark.parametrize("num_bytes", [0, 1, 7, 8, 9, 63, 64, 65, 64 << 10, (64 << 10) + 13,
                                       (1 << 20) + 61])
@pytest.mark.parametrize("dst_offset", [0, 8, 3])
def test_native_kernel_copies_and_sums_every_length_and_alignment(num_bytes, dst_offset) -> None:
    from bubbleguard.checkpoint._copysum import copy_sum64

    rng = np.random.default_rng(num_bytes)
    src = rng.integers(0, 256, num_bytes + 8, dtype=np.uint8)[5:5 + num_bytes]  # unaligned
    dst = np.zeros(num_bytes + 16, dtype=np.uint8)
    value = copy_sum64(dst.ctypes.data + dst_offset, src.ctypes.data, num_bytes)
    assert np.array_equal(dst[dst_offset:dst_offset + num_bytes], src)
    assert not dst[:dst_offset].any() and not dst[dst_offset + num_bytes:].any()
    padded = np.zeros(-(-num_bytes // 8) * 8, dtype=np.uint8)
    padded[:num_bytes] = src
    assert value == int(np.add.reduce(padded.view(np.uint64), dtype=np.uint64))
    with pytest.raises(ValueError, match="num_bytes must be >= 0"):
        copy_sum64(dst.ctypes.data, src.ctypes.data, -1)


def test_native_copy_is_built_where_a_c_compiler_is() -> None:
    # The extension is optional so that installs without a compiler work; where one is present
    # (as on CI), a missing extension means its build broke, which would otherwise go unseen.
    compiler = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(compiler) is None:
        pytest.skip(f"no C compiler ({compiler}) on this machine")
    assert NATIVE_COPY_AVAILABLE


def test_default_chunk_bytes_is_larger_for_device_state() -> None:
    # No CUDA needed: the choice depends on the device's type only.
    assert default_chunk_bytes("cpu") == DEFAULT_CHUNK_BYTES == 4 << 20
    assert default_chunk_bytes(torch.device("cuda", 0)) == DEVICE_CHUNK_BYTES == 64 << 20
