"""Tests for bubbleguard.data.corpus: the stdlib byte corpus and the resumable TokenBatches."""

from __future__ import annotations

import json
import sysconfig

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bubbleguard.data import TokenBatches, corpus_fingerprint, load_corpus


def counting_corpus(num_bytes: int) -> torch.Tensor:
    """Bytes 0, 1, 2, ... mod 251: every window's content says where it came from."""
    return (torch.arange(num_bytes) % 251).to(torch.uint8)


def take(batches: TokenBatches, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [batches.next_batch() for _ in range(n)]


def assert_same_batches(
    a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(xa, xb)
        assert torch.equal(ya, yb)


# --- load_corpus / corpus_fingerprint ---


def test_corpus_is_real_python_source_of_the_requested_size() -> None:
    corpus = load_corpus()
    assert corpus.dtype == torch.uint8
    assert corpus.shape == (2_000_000,)  # the stdlib's sources are larger than the cap
    text = corpus[:200_000].numpy().tobytes()
    assert b"def " in text
    assert b"import " in text


def test_corpus_is_deterministic_and_a_prefix_of_a_longer_one() -> None:
    short, long = load_corpus(10_000), load_corpus(50_000)
    assert torch.equal(short, load_corpus(10_000))
    assert torch.equal(short, long[:10_000])


def test_corpus_calls_return_independent_tensors() -> None:
    a = load_corpus(1_000)
    a.zero_()
    assert load_corpus(1_000).any()


def test_fingerprint_is_stable_short_hex_and_tells_corpora_apart() -> None:
    fp = corpus_fingerprint(load_corpus(10_000))
    assert fp == corpus_fingerprint(load_corpus(10_000))
    assert len(fp) == 16
    int(fp, 16)
    assert fp != corpus_fingerprint(load_corpus(10_001))


def test_fingerprint_rejects_non_byte_tensors() -> None:
    with pytest.raises(
        ValueError, match=r"corpus must be a 1-D torch.uint8 tensor, got a 1-D torch.int64"
    ):
        corpus_fingerprint(torch.zeros(4, dtype=torch.long))


def test_missing_stdlib_sources_raise_file_not_found(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=r"no standard library sources \(\*\.py\) found in"):
        load_corpus(1_000)


@pytest.mark.parametrize("bad", [0, -5])
def test_non_positive_max_bytes_is_rejected(bad: int) -> None:
    with pytest.raises(ValueError, match=rf"max_bytes must be a positive int, got {bad}"):
        load_corpus(bad)


# --- TokenBatches: contents ---


def test_next_token_targets_are_inputs_shifted_by_one() -> None:
    window = 8
    # Under 251 bytes, so a byte's value is its offset in the corpus.
    batches = TokenBatches(counting_corpus(250), window=window, batch_size=4, seed=0)
    inputs, targets = batches.next_batch()
    assert inputs.shape == targets.shape == (4, window)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    # Each row is one aligned, non-overlapping window of the corpus.
    for row, tgt in zip(inputs, targets, strict=True):
        start = int(row[0])
        assert start % (window + 1) == 0
        assert torch.equal(row, torch.arange(start, start + window))
        assert int(tgt[-1]) == start + window


def test_last_token_target_is_the_byte_after_the_inputs() -> None:
    corpus = counting_corpus(2_000)
    batches = TokenBatches(corpus, window=16, batch_size=5, seed=0, target="last_token")
    inputs, targets = batches.next_batch()
    assert inputs.shape == (5, 16)
    assert targets.shape == (5,)
    assert torch.equal(targets, (inputs[:, -1] + 1) % 251)


def test_real_corpus_batches_are_windows_of_it() -> None:
    corpus = load_corpus(100_000)
    batches = TokenBatches(corpus, window=64, batch_size=8, seed=0)
    inputs, targets = batches.next_batch()
    assert inputs.shape == targets.shape == (8, 64)
    windows = corpus[: batches.num_windows * 65].view(-1, 65).long()
    for row, tgt in zip(inputs, targets, strict=True):
        assert (windows[:, :-1] == row).all(dim=1).sum() >= 1
        assert (windows[:, 1:] == tgt).all(dim=1).sum() >= 1


def test_one_epoch_visits_every_window_once() -> None:
    window, num_windows = 3, 12
    batches = TokenBatches(
        counting_corpus(num_windows * (window + 1) + 2), window=window, batch_size=4, seed=9
    )
    assert batches.num_windows == num_windows
    starts = torch.cat([x[:, 0] for x, _ in take(batches, 3)])
    assert sorted(starts.tolist()) == [i * (window + 1) for i in range(num_windows)]
    assert batches.state_dict()["epoch"] == 1
    assert batches.state_dict()["position"] == 0


def test_batch_that_crosses_an_epoch_boundary_is_full() -> None:
    window, num_windows = 4, 7
    corpus = counting_corpus(num_windows * (window + 1))
    batches = TokenBatches(corpus, window=window, batch_size=3, seed=1)
    first_epoch = torch.cat([x[:, 0] for x, _ in take(batches, 2)])  # 6 of the 7 windows
    crossing, _ = batches.next_batch()
    assert crossing.shape == (3, window)
    missing = set(range(0, num_windows * (window + 1), window + 1)) - set(first_epoch.tolist())
    assert int(crossing[0, 0]) in missing  # the last window of epoch 0
    assert batches.state_dict()["epoch"] == 1
    assert batches.state_dict()["position"] == 2


# --- TokenBatches: order ---


def test_same_seed_same_batches_other_seed_other_batches() -> None:
    corpus = counting_corpus(5_000)
    a = take(TokenBatches(corpus, window=8, batch_size=4, seed=0), 5)
    b = take(TokenBatches(corpus, window=8, batch_size=4, seed=0), 5)
    c = take(TokenBatches(corpus, window=8, batch_size=4, seed=1), 5)
    assert_same_batches(a, b)
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c, strict=True))


def test_epochs_have_different_orders() -> None:
    batches = TokenBatches(counting_corpus(40 * 5), window=4, batch_size=40, seed=0)
    e0, _ = batches.next_batch()
    e1, _ = batches.next_batch()
    assert not torch.equal(e0, e1)
    assert sorted(e0[:, 0].tolist()) == sorted(e1[:, 0].tolist())


def test_order_does_not_depend_on_the_global_rng() -> None:
    corpus = counting_corpus(3_000)
    torch.manual_seed(0)
    a = TokenBatches(corpus, window=8, batch_size=4, seed=3)
    first_a = take(a, 4)
    torch.manual_seed(999)
    b = TokenBatches(corpus, window=8, batch_size=4, seed=3)
    first_b = []
    for _ in range(4):
        torch.rand(10)  # model code drawing random numbers between batches
        first_b.append(b.next_batch())
    assert_same_batches(first_a, first_b)


# --- TokenBatches: cursor ---


@settings(max_examples=40, deadline=None)
@given(
    window=st.integers(1, 6),
    batch_size=st.integers(1, 5),
    extra_windows=st.integers(0, 6),
    consumed=st.integers(0, 12),
    seed=st.integers(-(2**40), 2**40),
    target=st.sampled_from(["next_token", "last_token"]),
)
def test_restored_cursor_yields_the_same_next_batches(
    window: int, batch_size: int, extra_windows: int, consumed: int, seed: int, target: str
) -> None:
    corpus = counting_corpus((batch_size + extra_windows) * (window + 1))
    kwargs = {"window": window, "batch_size": batch_size, "seed": seed, "target": target}
    original = TokenBatches(corpus, **kwargs)
    take(original, consumed)
    state = json.loads(json.dumps(original.state_dict()))  # as it would travel in a checkpoint
    restored = TokenBatches(corpus, **kwargs)
    restored.load_state_dict(state)
    # Several epochs' worth, so the comparison always crosses at least one boundary.
    assert_same_batches(take(original, 8), take(restored, 8))


def test_restore_in_the_middle_of_an_epoch_crossing_batch() -> None:
    corpus = counting_corpus(7 * 5)  # 7 windows of 5 bytes
    original = TokenBatches(corpus, window=4, batch_size=3, seed=2)
    take(original, 2)  # next batch straddles epochs 0 and 1
    state = original.state_dict()
    assert (state["epoch"], state["position"]) == (0, 6)
    restored = TokenBatches(corpus, window=4, batch_size=3, seed=2)
    restored.load_state_dict(state)
    assert_same_batches(take(original, 5), take(restored, 5))


def test_state_dict_is_plain_json() -> None:
    batches = TokenBatches(
        counting_corpus(1_000), window=8, batch_size=4, seed=5, target="last_token"
    )
    batches.next_batch()
    state = batches.state_dict()
    assert json.loads(json.dumps(state)) == state
    assert state == {
        "seed": 5,
        "epoch": 0,
        "position": 4,
        "window": 8,
        "batch_size": 4,
        "target": "last_token",
        "num_windows": 111,
    }


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"window": 7}, r"saved with window=8 but this iterator has window=7"),
        ({"batch_size": 2}, r"saved with batch_size=4 but this iterator has batch_size=2"),
        ({"seed": 6}, r"saved with seed=5 but this iterator has seed=6"),
        (
            {"target": "last_token"},
            r"saved with target='next_token' but this iterator has target='last_token'",
        ),
    ],
)
def test_load_state_dict_rejects_other_settings(changes: dict[str, object], message: str) -> None:
    corpus = counting_corpus(1_000)
    kwargs: dict[str, object] = {"window": 8, "batch_size": 4, "seed": 5, "target": "next_token"}
    state = TokenBatches(corpus, **kwargs).state_dict()
    other = TokenBatches(corpus, **(kwargs | changes))
    with pytest.raises(ValueError, match=message):
        other.load_state_dict(state)


def test_load_state_dict_rejects_another_corpus_size() -> None:
    state = TokenBatches(counting_corpus(1_000), window=8, batch_size=4, seed=0).state_dict()
    other = TokenBatches(counting_corpus(2_000), window=8, batch_size=4, seed=0)
    with pytest.raises(
        ValueError, match=r"saved with num_windows=111 but this iterator has num_windows=222"
    ):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"position": 111}, r"position=111, outside \[0, 111\)"),
        ({"epoch": -1}, r"invalid epoch=-1"),
    ],
)
def test_load_state_dict_rejects_cursor_out_of_range(
    changes: dict[str, object], message: str
) -> None:
    batches = TokenBatches(counting_corpus(1_000), window=8, batch_size=4, seed=0)
    with pytest.raises(ValueError, match=message):
        batches.load_state_dict(batches.state_dict() | changes)


def test_load_state_dict_names_missing_keys() -> None:
    batches = TokenBatches(counting_corpus(1_000), window=8, batch_size=4, seed=0)
    state = batches.state_dict()
    del state["position"]
    with pytest.raises(ValueError, match=r"missing key\(s\): position"):
        batches.load_state_dict(state)


# --- TokenBatches: validation ---


def test_corpus_too_small_for_one_batch_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"holds 2 windows of 5 bytes .* fewer than batch_size=3"):
        TokenBatches(counting_corpus(12), window=4, batch_size=3, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window": 0}, r"window must be a positive int, got 0"),
        ({"batch_size": -1}, r"batch_size must be a positive int, got -1"),
        ({"target": "next_byte"}, r"unknown target 'next_byte'; accepted: next_token, last_token"),
    ],
)
def test_invalid_arguments_are_rejected(kwargs: dict[str, object], message: str) -> None:
    args: dict[str, object] = {"window": 4, "batch_size": 2, "seed": 0} | kwargs
    with pytest.raises(ValueError, match=message):
        TokenBatches(counting_corpus(100), **args)


def test_non_byte_corpus_is_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"corpus must be a 1-D torch.uint8 tensor, got a 2-D torch.uint8"
    ):
        TokenBatches(torch.zeros(4, 25, dtype=torch.uint8), window=4, batch_size=2, seed=0)
