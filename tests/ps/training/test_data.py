"""Tests for bubbleguard.ps.training.data: data sets, worker shards, seeded minibatches."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bubbleguard.ps.training.data import (
    DataSplits,
    MinibatchSampler,
    load_dataset,
    register_dataset,
    worker_shard,
)


def test_digits_loads_with_a_seeded_stratified_split() -> None:
    a, b, c = load_dataset("digits", 0), load_dataset("digits", 0), load_dataset("digits", 1)
    assert a.input_shape == (1, 8, 8) and a.num_classes == 10
    assert len(a.train_x) + len(a.test_x) == 1797 and len(a.test_x) == 360
    assert a.train_x.min() >= 0.0 and a.train_x.max() <= 1.0
    assert np.array_equal(a.test_y, b.test_y) and not np.array_equal(a.test_y, c.test_y)
    assert set(np.bincount(a.test_y)) <= {35, 36, 37}  # stratified: every class about 36 times


def test_npz_files_load_and_grey_images_get_a_channel(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "fashion.npz"
    np.savez(
        path,
        x_train=rng.integers(0, 256, (20, 28, 28)).astype(np.uint8),
        y_train=np.arange(20) % 10,
        x_test=rng.integers(0, 256, (5, 28, 28)).astype(np.uint8),
        y_test=np.arange(5),
    )
    splits = load_dataset(f"npz:{path}", 0)
    assert splits.input_shape == (1, 28, 28) and splits.num_classes == 10
    assert splits.train_x.dtype == np.float32 and splits.train_x.max() <= 1.0


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("mnist", ValueError, "unknown data set 'mnist'"),
        ("npz:/no/such/file.npz", FileNotFoundError, "does not exist"),
    ],
)
def test_data_sets_that_do_not_load_say_why(spec: str, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        load_dataset(spec, 0)


def test_npz_with_missing_arrays_or_garbage_is_rejected(tmp_path: Path) -> None:
    partial = tmp_path / "partial.npz"
    np.savez(partial, x_train=np.zeros((2, 1, 2, 2)), y_train=np.zeros(2))
    with pytest.raises(ValueError, match="lacks arrays"):
        load_dataset(f"npz:{partial}", 0)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file")
    with pytest.raises(ValueError, match="cannot read"):
        load_dataset(f"npz:{garbage}", 0)


def test_registered_data_sets_are_validated() -> None:
    def broken(seed: int) -> DataSplits:
        x = np.zeros((4, 1, 2, 2), np.float32)
        return DataSplits(x, np.array([0, 1, 2, 3]), x, np.zeros(4, np.int64), num_classes=2)

    register_dataset("broken-for-test", broken)
    with pytest.raises(ValueError, match="int64 labels|labels outside"):
        load_dataset("broken-for-test", 0)


def test_worker_shards_are_disjoint_and_cover_the_split() -> None:
    shards = [worker_shard(103, 4, w, seed=3) for w in range(4)]
    together = np.concatenate(shards)
    assert sorted(together.tolist()) == list(range(103))
    assert {len(s) for s in shards} <= {25, 26}
    assert np.array_equal(shards[1], worker_shard(103, 4, 1, seed=3))
    with pytest.raises(ValueError, match="cannot feed"):
        worker_shard(3, 4, 0, seed=0)


def test_sampler_is_seeded_and_visits_every_example_once_per_epoch() -> None:
    indices = np.arange(10, 20)

    def epoch(incarnation: int) -> list[int]:
        sampler = MinibatchSampler(indices, 3, seed=1, worker=0, incarnation=incarnation)
        return [int(i) for _ in range(4) for i in sampler.next_indices()]

    assert sorted(epoch(0)) == list(range(10, 20))
    assert epoch(0) == epoch(0) and epoch(0) != epoch(1)
