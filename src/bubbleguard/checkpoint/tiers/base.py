"""The ``Tier`` interface: where a snapshot lives (memory, peer, durable storage).

Call order -- writers, for the snapshot of step k (the state after ``optimizer.step()`` k):

1. every rank: ``tier.write(state)`` -- this rank's part of step k is stored and checked. The
   memory tier also offers the chunked form ``begin(state)``, ``copy_chunk(i)`` ... ``finish()``
   that the runtime spreads over the bubbles of iteration k+1; ``write`` is all three at once.
2. ``tier.commit(k)`` -- step k becomes visible once every rank's part is in. Who calls it is the
   tier's business and is documented there: the durable tier needs all ranks (its collective is
   on the process group it was given); the memory tier needs one process per node that knows
   every rank finished (the runtime learns it from messages the step already sends).

Readers -- any process, with or without ``torch.distributed``:

* ``tier.latest()`` -- the newest committed step, or None. Anything without a valid commit
  marker is ignored.
* ``tier.read(step)`` -- a :class:`~bubbleguard.checkpoint.state.StageState` (checked), ready for
  :func:`~bubbleguard.checkpoint.state.restore_state`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from bubbleguard.checkpoint.state import StageState


class Tier(ABC):
    """A place to keep snapshots; see the module docstring for who calls what, in which order."""

    kind: ClassVar[str]
    """Short name used in records and messages: ``"memory"``, ``"durable"``."""

    @abstractmethod
    def write(self, state: StageState) -> None:
        """Store this rank's part of the snapshot of ``state.step`` (not yet visible)."""

    @abstractmethod
    def commit(self, step: int) -> None:
        """Make step ``step`` visible once every rank's part is stored and checked."""

    @abstractmethod
    def latest(self) -> int | None:
        """The newest committed step, or None if there is none."""

    @abstractmethod
    def read(self, step: int | None = None) -> StageState:
        """This rank's state of ``step`` (default: :meth:`latest`), checked.

        Raises:
            FileNotFoundError: nothing committed (or not that step).
            CorruptSnapshotError: stored bytes fail their checksums.
        """
