"""Tests for bubbleguard.ps.core.layout: key-range shards and flat buffers."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubbleguard.ps.core.layout import ParamLayout
from bubbleguard.ps.training.model import SmallCNN

shapes = st.lists(st.lists(st.integers(1, 5), min_size=1, max_size=3), min_size=1, max_size=12)


@given(shapes, st.integers(1, 12))
def test_shards_are_contiguous_nonempty_key_ranges_covering_every_parameter(dims: list[list[int]], num_shards: int) -> None:
    named = [(f"p{i}", tuple(d)) for i, d in enumerate(dims)]
    if num_shards > len(named):
        with pytest.raises(ValueError, match="cannot split"):
            ParamLayout.from_shapes(named, num_shards)
        return
    layout = ParamLayout.from_shapes(named, num_shards)
    assert [s.name for s in layout.slots] == [n for n, _ in named]
    shard_ids = [s.shard for s in layout.slots]
    assert shard_ids == sorted(shard_ids) and set(shard_ids) == set(range(num_shards))
    for k in range(num_shards):
        offsets = [s.offset for s in layout.slots_of(k)]
        sizes = [s.numel for s in layout.slots_of(k)]
        assert offsets == [sum(sizes[:i]) for i in range(len(sizes))]


@given(shapes, st.integers(1, 4))
def test_flatten_then_unflatten_round_trips(dims: list[list[int]], num_shards: int) -> None:
    named = [(f"p{i}", tuple(d)) for i, d in enumerate(dims)]
    if num_shards > len(named):
        return
    layout = ParamLayout.from_shapes(named, num_shards)
    tensors = {n: torch.randn(s) for n, s in named}
    flats = layout.flatten(tensors)
    assert [f.numel() for f in flats] == [layout.shard_numel(k) for k in range(num_shards)]
    back = layout.unflatten(flats)
    assert all(torch.equal(back[n], tensors[n]) for n in tensors)
    for k in range(num_shards):
        assert torch.equal(layout.flatten_shard(k, layout.named_of(k, flats[k])), flats[k])


def test_the_cnn_splits_into_balanced_shards() -> None:
    layout = ParamLayout.from_module(SmallCNN((1, 8, 8), 10), 2)
    sizes = [layout.shard_numel(k) for k in range(2)]
    total = sum(p.numel() for p in SmallCNN((1, 8, 8), 10).parameters())
    assert sum(sizes) == total
    # The largest tensor (fc1.weight) decides how even a contiguous split can be.
    assert max(sizes) <= total - 4640


def test_flatten_names_missing_parameters() -> None:
    layout = ParamLayout.from_shapes([("a", (2,)), ("b", (3,))], 1)
    with pytest.raises(KeyError, match="b"):
        layout.flatten({"a": torch.zeros(2)})
