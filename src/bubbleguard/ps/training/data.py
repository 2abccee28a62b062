"""Data sets behind one small interface, worker shards and seeded minibatches.

A data set is anything that returns a :class:`DataSplits` (images ``[N, C, H, W]`` float32,
labels int64) from ``load(seed)``. Built in: ``digits`` (scikit-learn's 8x8 handwritten digits,
shipped inside the package, no download) and ``npz:PATH`` (a NumPy archive with ``x_train``,
``y_train``, ``x_test``, ``y_test``, e.g. FashionMNIST saved by the user). Register more with
:func:`register_dataset`.

:func:`load_dataset` runs in the driver before Ray starts, so a data set that does not load
fails early with a message that says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class DataSplits:
    """A training and a test split.

    Attributes:
        train_x: float32 ``[N, C, H, W]``.
        train_y: int64 ``[N]`` class indices.
        test_x: float32 ``[M, C, H, W]``.
        test_y: int64 ``[M]``.
        num_classes: number of classes (labels are ``0 .. num_classes - 1``).
    """

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(C, H, W)`` of one example."""
        c, h, w = self.train_x.shape[1:]
        return int(c), int(h), int(w)

    def validate(self, name: str) -> None:
        """Raise ``ValueError`` naming the data set if the arrays are not usable."""
        for split, x, y in (("train", self.train_x, self.train_y), ("test", self.test_x, self.test_y)):
            if x.ndim != 4:
                raise ValueError(f"data set {name!r}: {split} images must be [N, C, H, W], got shape {x.shape}")
            if y.ndim != 1 or len(y) != len(x):
                raise ValueError(f"data set {name!r}: {split} has {len(x)} images but labels of shape {y.shape}")
            if len(x) == 0:
                raise ValueError(f"data set {name!r}: the {split} split is empty")
            if x.dtype != np.float32 or y.dtype != np.int64:
                raise ValueError(f"data set {name!r}: expected float32 images and int64 labels")
            if y.min() < 0 or y.max() >= self.num_classes:
                raise ValueError(f"data set {name!r}: {split} labels outside [0, {self.num_classes})")
        if self.train_x.shape[1:] != self.test_x.shape[1:]:
            raise ValueError(f"data set {name!r}: train and test images differ in shape")


DatasetFactory = Callable[[int], DataSplits]
_REGISTRY: dict[str, DatasetFactory] = {}


def register_dataset(name: str, factory: DatasetFactory) -> None:
    """Make ``name`` loadable; ``factory(seed)`` returns the splits."""
    if not name or ":" in name:
        raise ValueError(f"data set names must be non-empty and contain no ':', got {name!r}")
    _REGISTRY[name] = factory


def _digits(seed: int, test_fraction: float = 0.2) -> DataSplits:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    bunch = load_digits()
    # Pixel values are 0..16; scale to [0, 1] and add the channel axis.
    x = (np.asarray(bunch.data, dtype=np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = np.asarray(bunch.target, dtype=np.int64)
    train_x, test_x, train_y, test_y = train_test_split(
        x, y, test_size=test_fraction, random_state=seed, stratify=y
    )
    return DataSplits(train_x, train_y, test_x, test_y, num_classes=10)


def _npz(path: str) -> DataSplits:
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"data set file {file} does not exist")
    try:
        with np.load(file, allow_pickle=False) as arrays:
            missing = {"x_train", "y_train", "x_test", "y_test"} - set(arrays.files)
            if missing:
                raise ValueError(f"{file} lacks arrays {sorted(missing)}")
            train_x, test_x = (np.asarray(arrays[k], dtype=np.float32) for k in ("x_train", "x_test"))
            train_y, test_y = (np.asarray(arrays[k], dtype=np.int64) for k in ("y_train", "y_test"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read data set file {file}: {e}") from e
    # Grey-scale images may come as [N, H, W]; give them their channel.
    if train_x.ndim == 3:
        train_x, test_x = train_x[:, None], test_x[:, None]
    if train_x.max(initial=0.0) > 1.0:
        train_x, test_x = train_x / 255.0, test_x / 255.0
    num_classes = int(max(train_y.max(initial=0), test_y.max(initial=0))) + 1
    return DataSplits(train_x, train_y, test_x, test_y, num_classes)


register_dataset("digits", _digits)


def load_dataset(spec: str, seed: int) -> DataSplits:
    """Load the data set ``spec`` (a registered name or ``npz:PATH``) and check it.

    Raises:
        ValueError: unknown name, or arrays of the wrong shape or type.
        FileNotFoundError: an ``npz`` file that does not exist.
    """
    if spec.startswith("npz:"):
        splits = _npz(spec[len("npz:") :])
    elif spec in _REGISTRY:
        splits = _REGISTRY[spec](seed)
    else:
        raise ValueError(
            f"unknown data set {spec!r}; expected one of {', '.join(sorted(_REGISTRY))} or npz:PATH"
        )
    splits.validate(spec)
    return splits


def worker_shard(num_examples: int, num_workers: int, worker: int, seed: int) -> np.ndarray:
    """The training indices of ``worker``: a seeded permutation dealt round-robin.

    Shards are disjoint, cover every example and differ in size by at most one.
    """
    if not 0 <= worker < num_workers:
        raise ValueError(f"worker {worker} out of range for {num_workers} workers")
    if num_examples < num_workers:
        raise ValueError(f"{num_examples} training examples cannot feed {num_workers} workers")
    order = np.random.default_rng(seed).permutation(num_examples)
    return np.sort(order[worker::num_workers])


class MinibatchSampler:
    """Seeded minibatches from one worker's shard: shuffled epochs, no example twice per epoch.

    Args:
        indices: the shard's example indices.
        batch_size: examples per minibatch (the last of an epoch may be smaller).
        seed: the run's seed; the order also depends on ``worker`` and ``incarnation`` so a
            restarted worker does not replay its predecessor's batches.
    """

    def __init__(self, indices: np.ndarray, batch_size: int, *, seed: int, worker: int, incarnation: int) -> None:
        self._indices = indices
        self._batch_size = batch_size
        self._rng = np.random.default_rng([seed, worker, incarnation])
        self._order = self._rng.permutation(indices)
        self._pos = 0

    def next_indices(self) -> np.ndarray:
        """Indices of the next minibatch."""
        if self._pos >= len(self._order):
            self._order = self._rng.permutation(self._indices)
            self._pos = 0
        batch = self._order[self._pos : self._pos + self._batch_size]
        self._pos += self._batch_size
        return batch
