"""The data host: an actor that hands the training split to workers.

Workers are restartable actors; a restartable actor whose constructor takes object-store
arguments cannot be restarted once those go out of scope, and Ray warns about it on every
creation. Workers instead fetch the arrays from this actor when they start (and restart).
One actor per run; it is never a fault target.
"""

from __future__ import annotations

import numpy as np


class DataHost:
    """Holds the training images and labels.

    Args:
        train_x: float32 images ``[N, C, H, W]``.
        train_y: int64 labels ``[N]``.
    """

    def __init__(self, train_x: np.ndarray, train_y: np.ndarray) -> None:
        self._arrays = (train_x, train_y)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The training images and labels."""
        return self._arrays
