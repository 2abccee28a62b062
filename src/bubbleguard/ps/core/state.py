"""A shard's state: parameters, optimizer state, version and the log of applied gradients.

:class:`ShardState` is the frozen value that is checkpointed, replicated and compared in tests.
:class:`LiveShardState` is the mutable copy a server applies gradients to; it is not
thread-safe, the server serialises access.

The log holds one row per applied gradient, ``(uid, read_version, step_version)``, so the state
says exactly which gradients it contains and how stale each was when applied. Deduplication
needs less: one writer (a worker incarnation) pushes its ids in increasing order, so the highest
applied sequence number per writer (the *watermark*) decides whether an id is already in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bubbleguard.ps.core.messages import (
    Ack,
    BacklogEntry,
    Gradient,
    Weights,
    WireTensors,
    seq_of,
    writer_of,
)
from bubbleguard.ps.core.optim import backlog_gradient, sgd_step

LOG_COLUMNS = ("uid", "read_version", "step_version")


def digest_of(params: torch.Tensor, momentum: torch.Tensor, version: int) -> str:
    """A short hex digest of a model state; equal states have equal digests."""
    h = hashlib.blake2b(digest_size=16)
    h.update(version.to_bytes(8, "little", signed=True))
    # NumPy views expose the tensor's memory without a copy.
    h.update(params.detach().contiguous().numpy().data)
    h.update(momentum.detach().contiguous().numpy().data)
    return h.hexdigest()


@dataclass(frozen=True)
class ShardState(WireTensors):
    """Everything a shard's server must not lose.

    Attributes:
        shard: the shard index.
        params: flat float32 parameters of the shard.
        momentum: flat float32 momentum buffer, empty when momentum is off.
        version: optimizer steps applied so far (a backlog hand-over is one step).
        log: int64 ``[num_applied, 3]`` rows ``(uid, read_version, step_version)``.
    """

    shard: int
    params: torch.Tensor
    momentum: torch.Tensor
    version: int
    log: torch.Tensor

    @classmethod
    def initial(cls, shard: int, params: torch.Tensor, *, momentum: bool) -> ShardState:
        """The state before any update: version 0, empty log."""
        flat = params.detach().to(torch.float32).flatten().clone()
        buf = torch.zeros_like(flat) if momentum else torch.zeros(0)
        return cls(shard, flat, buf, 0, torch.zeros((0, 3), dtype=torch.int64))

    @property
    def num_applied(self) -> int:
        """How many gradients the state contains."""
        return int(self.log.shape[0])

    def applied_uids(self) -> list[int]:
        """Ids of the applied gradients, in the order they were applied."""
        return [int(u) for u in self.log[:, 0].tolist()]

    def digest(self) -> str:
        """Digest of parameters, momentum and version (see :func:`digest_of`)."""
        return digest_of(self.params, self.momentum, self.version)

    def equals(self, other: ShardState) -> bool:
        """Bitwise equality of every field."""
        return (
            self.shard == other.shard
            and self.version == other.version
            and torch.equal(self.params, other.params)
            and torch.equal(self.momentum, other.momentum)
            and torch.equal(self.log, other.log)
        )


class LiveShardState:
    """The mutable state a server applies gradients to.

    Args:
        state: the state to start from (copied).
        lr: learning rate of every SGD step.
        momentum: SGD momentum (0 disables the buffer).
    """

    def __init__(self, state: ShardState, *, lr: float, momentum: float) -> None:
        self.lr = lr
        self.momentum_factor = momentum
        self.shard = state.shard
        self._install(state)

    def _install(self, state: ShardState) -> None:
        self.params = state.params.clone()
        self.momentum = state.momentum.clone()
        if self.momentum_factor and self.momentum.numel() == 0:
            self.momentum = torch.zeros_like(self.params)
        self.version = state.version
        # The log grows by doubling so that appending is O(1) and freezing is one copy.
        n = state.num_applied
        self._log = torch.zeros((max(1024, 2 * n), 3), dtype=torch.int64)
        self._log[:n] = state.log
        self._num_applied = n
        self._watermark: dict[int, int] = {}
        for uid in state.log[:, 0].tolist():
            self._advance_watermark(int(uid))

    def replace(self, state: ShardState) -> None:
        """Overwrite everything with ``state`` (a chain replica taking a snapshot)."""
        if state.shard != self.shard:
            raise ValueError(f"state of shard {state.shard} offered to shard {self.shard}")
        self._install(state)

    @property
    def num_applied(self) -> int:
        """How many gradients the state contains."""
        return self._num_applied

    def holds(self, uid: int) -> bool:
        """Whether the gradient with id ``uid`` is already applied."""
        return seq_of(uid) <= self._watermark.get(writer_of(uid), -1)

    def apply(self, grad: Gradient) -> Ack:
        """Apply one gradient as one SGD step, unless the state already holds it."""
        if self.holds(grad.uid):
            return self._ack((), (grad.uid,), None)
        if grad.values.shape != self.params.shape:
            raise ValueError(
                f"gradient of shape {tuple(grad.values.shape)} for shard {self.shard} with "
                f"{self.params.numel()} parameters"
            )
        step_version = self.version
        sgd_step(self.params, self.momentum, grad.values, self.lr, self.momentum_factor)
        self.version += 1
        self._append(grad.uid, grad.read_version, step_version)
        return self._ack((grad.uid,), (), step_version)

    def apply_backlog(
        self, entries: Sequence[BacklogEntry], *, policy: str, backlog_lr_scale: float
    ) -> Ack:
        """Apply a worker's buffered gradients as one SGD step; held ids are skipped.

        Every id in ``entries`` is applied exactly once across repeated hand-overs: an entry whose
        ids the state already holds is acknowledged as a duplicate and contributes nothing.

        Raises:
            ValueError: an entry mixes held and new ids (entries must not straddle the writer's
                watermark; a worker keeps an uncertain gradient in an entry of its own).
        """
        fresh: list[BacklogEntry] = []
        duplicates: list[int] = []
        for entry in entries:
            held = [self.holds(uid) for uid in entry.uids]
            if all(held):
                duplicates.extend(entry.uids)
            elif not any(held):
                fresh.append(entry)
            else:
                raise ValueError(
                    f"backlog entry {entry.uids} mixes applied and new gradients of shard {self.shard}"
                )
        if not fresh:
            return self._ack((), tuple(duplicates), None)
        step_version = self.version
        direction = backlog_gradient(
            fresh, policy=policy, version=step_version, backlog_lr_scale=backlog_lr_scale
        )
        sgd_step(self.params, self.momentum, direction, self.lr, self.momentum_factor)
        self.version += 1
        applied: list[int] = []
        for entry in fresh:
            for uid in entry.uids:
                self._append(uid, entry.read_version, step_version)
                applied.append(uid)
        return self._ack(tuple(applied), tuple(duplicates), step_version)

    def weights(self) -> Weights:
        """A copy of the parameters for a reader."""
        return Weights(self.shard, self.version, self._num_applied, self.params.clone())

    def freeze(self) -> ShardState:
        """A frozen copy of the whole state."""
        return ShardState(
            self.shard,
            self.params.clone(),
            self.momentum.clone(),
            self.version,
            self._log[: self._num_applied].clone(),
        )

    def log_since(self, start: int) -> torch.Tensor:
        """Log rows appended after the first ``start`` (a copy)."""
        return self._log[start : self._num_applied].clone()

    def digest(self) -> str:
        """Digest of the current parameters, momentum and version."""
        return digest_of(self.params, self.momentum, self.version)

    def _append(self, uid: int, read_version: int, step_version: int) -> None:
        if self._num_applied == self._log.shape[0]:
            grown = torch.zeros((2 * self._log.shape[0], 3), dtype=torch.int64)
            grown[: self._num_applied] = self._log
            self._log = grown
        self._log[self._num_applied, 0] = uid
        self._log[self._num_applied, 1] = read_version
        self._log[self._num_applied, 2] = step_version
        self._num_applied += 1
        self._advance_watermark(uid)

    def _advance_watermark(self, uid: int) -> None:
        writer = writer_of(uid)
        self._watermark[writer] = max(self._watermark.get(writer, -1), seq_of(uid))

    def _ack(self, applied: tuple[int, ...], duplicates: tuple[int, ...], step: int | None) -> Ack:
        return Ack(self.shard, applied, duplicates, step, self.version, self.digest())
