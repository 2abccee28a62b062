"""Splitting models into stages: layer partition, whole-model names, shared modules."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from bubbleguard.models import build_model
from bubbleguard.pipeline.stage import partition_layers, plan_stages, split


@given(num_layers=st.integers(1, 64), num_stages=st.integers(1, 64))
def test_partition_is_contiguous_and_balanced(num_layers: int, num_stages: int) -> None:
    if num_stages > num_layers:
        with pytest.raises(ValueError, match="each stage needs at least one layer"):
            partition_layers(num_layers, num_stages)
        return
    parts = partition_layers(num_layers, num_stages)
    assert [i for r in parts for i in r] == list(range(num_layers))
    sizes = [len(r) for r in parts]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_gpt_plan_puts_embedding_first_and_head_last() -> None:
    plan = plan_stages(build_model("gpt", seed=0, num_layers=5), 3)
    assert plan.units == (("embed", "blocks.0", "blocks.1"), ("blocks.2", "blocks.3"),
                          ("blocks.4", "head"))


@pytest.mark.parametrize("num_stages", [1, 2, 3, 4])
def test_stages_keep_whole_model_names_and_compose_to_the_model(num_stages: int) -> None:
    model = build_model("gpt", seed=0, num_layers=4, seq_len=8, d_model=16, num_heads=2)
    whole = model.state_dict()
    stages = [split(model, num_stages, s) for s in range(num_stages)]
    names = [n for s in stages for n in s.state_dict()]
    assert sorted(names) == sorted(whole) and len(names) == len(set(names))
    for s in stages:
        for n, t in s.state_dict().items():
            assert t.data_ptr() == whole[n].data_ptr()  # shared, not copied
    ids = torch.randint(0, 256, (2, 8))
    x = ids
    for s in stages:
        x = s(x)
    assert torch.equal(x, model(ids))
    assert stages[0].is_first and stages[-1].is_last


def test_sequential_models_split_by_child() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    stage = split(model, 2, 1, layers=None)
    assert set(stage.state_dict()) == {"2.weight", "2.bias"}


def test_bad_splits_name_the_problem() -> None:
    model = build_model("mlp", seed=0, num_layers=2)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        split(model, 3, 0)
    with pytest.raises(ValueError, match="stage_index 2 is outside 0..1"):
        split(model, 2, 2)
    with pytest.raises(ValueError, match="model has no child 'layers'"):
        split(model, 2, 0, layers="layers")
    with pytest.raises(ValueError, match="model.embed is a MLPEmbed"):
        split(model, 2, 0, layers="embed")
