"""A worker's bounded buffer of gradients for one shard whose server is down.

Call order (one worker thread): :meth:`GradientBuffer.add` for each gradient computed while the
server is down (``uncertain=True`` for the gradient whose push failed, which the server may or
may not have applied); :meth:`GradientBuffer.entries` to hand the backlog over; :meth:`clear`
once the server has acknowledged it, or :meth:`seal` if the hand-over failed (the server may
have applied some of it), then keep adding and hand over again: the server skips every entry
whose ids it already holds.

The buffer holds at most ``cap`` open entries, plus the sealed ones: the uncertain gradient
and whatever a failed hand-over left (both bounded by what was open before). Past the cap:

- ``coalesce``: the new gradient is added into the newest entry computed on the same weights
  (or, if none, the newest entry, which then keeps the older read version). Nothing is lost,
  memory stays at ``cap`` entries, and every id is still applied exactly once.
- ``drop-oldest``: the oldest entry is discarded and its ids are recorded in
  :attr:`GradientBuffer.dropped_uids`; they are never applied.

Sealed entries are never coalesced into and never dropped: if the server did apply them they
must be skipped whole, and a new gradient inside one would be skipped with them (see
:meth:`LiveShardState.apply_backlog`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from bubbleguard.ps.config import OVERFLOW_POLICIES
from bubbleguard.ps.core.messages import BacklogEntry, Gradient


@dataclass
class _Entry:
    uids: list[int]
    read_version: int
    values: torch.Tensor


class GradientBuffer:
    """Bounded buffer of one worker's gradients for one shard (see the module docstring).

    Args:
        cap: most open entries held (sealed ones are not counted).
        overflow: ``coalesce`` or ``drop-oldest``.
    """

    def __init__(self, cap: int, overflow: str) -> None:
        if cap < 1:
            raise ValueError(f"buffer cap must be >= 1 entry, got {cap}")
        if overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"unknown overflow policy {overflow!r}; expected {OVERFLOW_POLICIES}")
        self.cap = cap
        self.overflow = overflow
        self._sealed: list[BacklogEntry] = []
        self._entries: list[_Entry] = []
        self.dropped_uids: list[int] = []
        self.num_coalesced = 0

    def __len__(self) -> int:
        """Entries held, sealed ones included."""
        return len(self._entries) + len(self._sealed)

    @property
    def num_gradients(self) -> int:
        """Gradients held, sealed ones included."""
        return sum(len(e.uids) for e in self._entries) + sum(e.num_gradients for e in self._sealed)

    def add(self, grad: Gradient, *, uncertain: bool = False) -> None:
        """Buffer ``grad``; ``uncertain`` marks a gradient whose push failed (it is sealed).

        The buffer takes ownership of ``grad.values`` (it may add other gradients into it).
        """
        if uncertain:
            self.seal()
            self._sealed.append(BacklogEntry((grad.uid,), grad.read_version, grad.values))
            return
        if len(self._entries) < self.cap:
            self._entries.append(_Entry([grad.uid], grad.read_version, grad.values))
            return
        if self.overflow == "drop-oldest":
            self.dropped_uids.extend(self._entries.pop(0).uids)
            self._entries.append(_Entry([grad.uid], grad.read_version, grad.values))
            return
        target = next(
            (e for e in reversed(self._entries) if e.read_version == grad.read_version),
            self._entries[-1],
        )
        target.values.add_(grad.values)
        target.uids.append(grad.uid)
        target.read_version = min(target.read_version, grad.read_version)
        self.num_coalesced += 1

    def entries(self) -> list[BacklogEntry]:
        """The backlog to hand over, oldest first.

        The entries share memory with the buffer: send them (Ray copies arguments when the call
        is made) before adding more gradients.
        """
        out = list(self._sealed)
        out.extend(BacklogEntry(tuple(e.uids), e.read_version, e.values) for e in self._entries)
        return out

    def seal(self) -> None:
        """Close every open entry to coalescing and dropping (a hand-over may have applied it)."""
        self._sealed.extend(BacklogEntry(tuple(e.uids), e.read_version, e.values) for e in self._entries)
        self._entries = []

    def clear(self) -> None:
        """Forget the handed-over backlog (the dropped ids stay recorded)."""
        self._sealed = []
        self._entries = []
