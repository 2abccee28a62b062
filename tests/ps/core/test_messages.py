"""Tests for bubbleguard.ps.core.messages: update ids and the wire format."""

from __future__ import annotations

import pickle

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from bubbleguard.ps.core.messages import (
    BacklogEntry,
    Gradient,
    Weights,
    make_update_id,
    seq_of,
    split_update_id,
    writer_of,
)


@given(st.integers(0, 2**15 - 1), st.integers(0, 2**16 - 1), st.integers(0, 2**32 - 1))
def test_update_id_round_trips_and_stays_a_positive_int64(worker: int, incarnation: int, seq: int) -> None:
    uid = make_update_id(worker, incarnation, seq)
    assert split_update_id(uid) == (worker, incarnation, seq)
    assert 0 <= uid < 2**63
    assert seq_of(uid) == seq
    assert writer_of(uid) == writer_of(make_update_id(worker, incarnation, 0))


def test_ids_of_one_writer_grow_with_the_sequence_and_differ_across_incarnations() -> None:
    assert make_update_id(3, 0, 5) < make_update_id(3, 0, 6)
    assert writer_of(make_update_id(3, 0, 5)) != writer_of(make_update_id(3, 1, 5))
    assert writer_of(make_update_id(3, 0, 5)) != writer_of(make_update_id(4, 0, 5))


@pytest.mark.parametrize(("worker", "incarnation", "seq"), [(-1, 0, 0), (2**15, 0, 0), (0, 2**16, 0), (0, 0, 2**32)])
def test_update_id_rejects_fields_that_do_not_fit(worker: int, incarnation: int, seq: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        make_update_id(worker, incarnation, seq)


def test_messages_pickle_tensors_as_writable_tensors() -> None:
    values = torch.arange(6, dtype=torch.float32)
    for message in (
        Gradient(7, 3, values),
        Weights(0, 4, 9, values),
        BacklogEntry((1, 2), 3, values),
    ):
        copy = pickle.loads(pickle.dumps(message))
        assert type(copy) is type(message)
        got = copy.values
        assert isinstance(got, torch.Tensor) and torch.equal(got, values)
        got.add_(1)  # writable, and not the sender's memory
        assert torch.equal(values, torch.arange(6, dtype=torch.float32))
