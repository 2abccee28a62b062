"""Tests for bubbleguard.ps.core.buffer: the bounded gradient buffer and its overflow policies."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubbleguard.ps.core.buffer import GradientBuffer
from bubbleguard.ps.core.messages import Gradient, make_update_id


def g(seq: int, read_version: int = 5, value: float | None = None) -> Gradient:
    return Gradient(make_update_id(0, 0, seq), read_version, torch.full((3,), float(seq if value is None else value)))


@given(st.integers(1, 8), st.integers(0, 40))
def test_coalesce_keeps_every_gradient_within_the_cap(cap: int, n: int) -> None:
    buf = GradientBuffer(cap, "coalesce")
    for seq in range(n):
        buf.add(g(seq))
    entries = buf.entries()
    assert len(entries) == min(cap, n)
    ids = [uid for e in entries for uid in e.uids]
    assert sorted(ids) == [make_update_id(0, 0, s) for s in range(n)]
    total = sum((e.values for e in entries), torch.zeros(3))
    assert torch.allclose(total, torch.full((3,), float(sum(range(n)))))
    assert buf.dropped_uids == []


@given(st.integers(1, 8), st.integers(0, 40))
def test_drop_oldest_keeps_the_newest_cap_and_records_the_rest(cap: int, n: int) -> None:
    buf = GradientBuffer(cap, "drop-oldest")
    for seq in range(n):
        buf.add(g(seq))
    kept = [uid for e in buf.entries() for uid in e.uids]
    assert kept == [make_update_id(0, 0, s) for s in range(max(0, n - cap), n)]
    assert buf.dropped_uids == [make_update_id(0, 0, s) for s in range(max(0, n - cap))]


def test_coalesce_prefers_an_entry_read_at_the_same_version() -> None:
    buf = GradientBuffer(2, "coalesce")
    buf.add(g(0, read_version=3))
    buf.add(g(1, read_version=4))
    buf.add(g(2, read_version=3))
    first, second = buf.entries()
    assert first.uids == (make_update_id(0, 0, 0), make_update_id(0, 0, 2)) and first.read_version == 3
    assert second.uids == (make_update_id(0, 0, 1),)


def test_uncertain_and_sealed_entries_are_never_coalesced_or_dropped() -> None:
    for overflow in ("coalesce", "drop-oldest"):
        buf = GradientBuffer(1, overflow)
        buf.add(g(0), uncertain=True)
        buf.add(g(1))
        buf.seal()  # a hand-over failed: entry 1 may be applied
        buf.add(g(2))
        buf.add(g(3))
        entries = buf.entries()
        assert entries[0].uids == (make_update_id(0, 0, 0),)
        assert entries[1].uids == (make_update_id(0, 0, 1),)
        if overflow == "coalesce":
            assert entries[2].uids == (make_update_id(0, 0, 2), make_update_id(0, 0, 3))
        else:
            assert entries[2].uids == (make_update_id(0, 0, 3),)
            assert buf.dropped_uids == [make_update_id(0, 0, 2)]


def test_clear_forgets_the_backlog_but_not_the_drops() -> None:
    buf = GradientBuffer(1, "drop-oldest")
    buf.add(g(0))
    buf.add(g(1))
    buf.clear()
    assert buf.entries() == [] and buf.num_gradients == 0 and len(buf) == 0
    assert buf.dropped_uids == [make_update_id(0, 0, 0)]


def test_invalid_buffer_settings() -> None:
    with pytest.raises(ValueError, match="cap"):
        GradientBuffer(0, "coalesce")
    with pytest.raises(ValueError, match="overflow"):
        GradientBuffer(4, "block")
