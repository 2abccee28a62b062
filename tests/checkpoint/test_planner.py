"""Tests for checkpoint/planner.py on hand-made and random bubble maps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbleguard.checkpoint.planner import IdleWindow, plan_checkpoint

MB = 1 << 20


def windows(*durations: float) -> list[IdleWindow]:
    return [IdleWindow(i, f"F{i}", d) for i, d in enumerate(durations)]


def test_hand_made_bubble_map() -> None:
    # bandwidth 1 MB/s, no margin: windows hold 2.5, 0.5 and 1 chunk(s) of 1 MB
    plan = plan_checkpoint(windows(2.5, 0.5, 1.0), [MB] * 5, 1.0 * MB, safety_margin=0.0)
    assert [a.chunk_ids for a in plan.assignments] == [(0, 1), (), (2,)]
    assert plan.blocking_chunk_ids == (3, 4)
    assert plan.blocking_s == pytest.approx(2.0)
    assert plan.blocking_bytes == 2 * MB
    assert plan.leftover_idle_s == pytest.approx(1.0)
    assert plan.chunks_for_window(2) == (2,)


def test_small_last_chunk_fills_an_earlier_gap_and_margin_shrinks_windows() -> None:
    plan = plan_checkpoint(windows(1.5, 1.0), [MB, MB, MB // 2], 1.0 * MB, safety_margin=0.0)
    assert [a.chunk_ids for a in plan.assignments] == [(0, 2), (1,)]
    assert plan.blocking_s == 0.0
    tight = plan_checkpoint(windows(1.5, 1.0), [MB, MB, MB // 2], 1.0 * MB, safety_margin=0.2)
    # capacities 1.2 MB and 0.8 MB: chunk 1 fits nowhere, the half chunk fits the second window
    assert [a.chunk_ids for a in tight.assignments] == [(0,), (2,)]
    assert tight.blocking_chunk_ids == (1,)


def test_persist_every_free() -> None:
    # 1 chunk of 1 MB in 4 s of bubbles at 1 MB/s: 3 s left per iteration; persist of 1 MB at
    # 0.1 MB/s takes 10 s -> fits every 4 iterations
    plan = plan_checkpoint(
        windows(4.0), [MB], 1.0 * MB, safety_margin=0.0, persist_bandwidth_bytes_per_s=0.1 * MB
    )
    assert plan.persist_every_free == 4
    full = plan_checkpoint(
        windows(1.0), [MB], 1.0 * MB, safety_margin=0.0, persist_bandwidth_bytes_per_s=MB
    )
    assert full.persist_every_free is None
    assert plan_checkpoint(windows(4.0), [MB], MB).persist_every_free is None


def test_no_windows_means_everything_blocks() -> None:
    plan = plan_checkpoint([], [3, 5], 2.0)
    assert plan.assignments == () and plan.blocking_chunk_ids == (0, 1) and plan.blocking_s == 4.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"copy_bandwidth_bytes_per_s": 0.0},
            "copy_bandwidth_bytes_per_s must be a positive number, got 0.0",
        ),
        ({"safety_margin": 1.0}, r"safety_margin must be in \[0, 1\), got 1.0"),
        ({"windows": [IdleWindow(0, "F0", -1.0)]}, "window 0 .'F0'. has duration_s -1.0"),
        ({"windows": windows(1.0) * 2}, "window index 0 appears twice"),
        ({"chunk_bytes": [4, -1]}, "chunk 1 has negative size -1"),
        ({"persist_bandwidth_bytes_per_s": -2.0}, "persist_bandwidth_bytes_per_s must be > 0"),
    ],
)
def test_bad_input_is_named(kwargs, message) -> None:
    args = {
        "windows": windows(1.0),
        "chunk_bytes": [1],
        "copy_bandwidth_bytes_per_s": 1.0,
        **kwargs,
    }
    with pytest.raises(ValueError, match=message):
        plan_checkpoint(**args)


durations = st.lists(st.floats(0.0, 5.0, allow_nan=False), max_size=8)


@st.composite
def layout_chunks(draw):
    """Chunk sizes as a ChunkLayout makes them: equal, the last one possibly smaller."""
    size = draw(st.integers(1, 64))
    n = draw(st.integers(0, 30))
    last = draw(st.integers(1, size))
    return [size] * n + [last]


@settings(max_examples=300, deadline=None)
@given(
    ds=durations,
    chunks=st.lists(st.integers(0, 100), max_size=30),
    bw=st.floats(0.5, 50.0),
    margin=st.floats(0.0, 0.9),
)
def test_random_maps_invariants(ds, chunks, bw, margin) -> None:
    plan = plan_checkpoint(windows(*ds), chunks, bw, safety_margin=margin)
    placed = [c for a in plan.assignments for c in a.chunk_ids] + list(plan.blocking_chunk_ids)
    assert sorted(placed) == list(range(len(chunks)))  # every chunk exactly once
    for a, d in zip(plan.assignments, ds, strict=True):
        assert a.num_bytes == sum(chunks[c] for c in a.chunk_ids)
        assert a.num_bytes <= d * (1 - margin) * bw + 1e-9  # never over-filled
        assert list(a.chunk_ids) == sorted(a.chunk_ids)
    unassigned = sum(chunks[c] for c in plan.blocking_chunk_ids)
    assert plan.blocking_s == pytest.approx(unassigned / bw)
    # a blocking chunk fits in no window's remaining room
    for c in plan.blocking_chunk_ids:
        for a in plan.assignments:
            assert a.num_bytes + chunks[c] > a.capacity_bytes or any(x > c for x in a.chunk_ids)


@settings(max_examples=300, deadline=None)
@given(ds=durations, chunks=layout_chunks(), bw=st.floats(0.5, 50.0), factor=st.floats(1.0, 4.0))
def test_blocking_time_never_grows_with_bandwidth_or_longer_bubbles(ds, chunks, bw, factor) -> None:
    base = plan_checkpoint(windows(*ds), chunks, bw, safety_margin=0.1)
    faster = plan_checkpoint(windows(*ds), chunks, bw * factor, safety_margin=0.1)
    longer = plan_checkpoint(windows(*(d * factor for d in ds)), chunks, bw, safety_margin=0.1)
    assert faster.blocking_s <= base.blocking_s + 1e-12
    assert longer.blocking_bytes <= base.blocking_bytes
