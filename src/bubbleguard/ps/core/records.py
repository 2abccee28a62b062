"""What a run records: one row per worker iteration, per evaluation and per fault event.

Times are ``time.time()`` seconds (comparable across processes of one machine); the run
converts them to seconds since the start of training when it reports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

PushOutcome = Literal["acked", "buffered", "failed"]
EventKind = Literal["kill", "recovered", "rejoined", "worker_restarted"]
ServerStatus = Literal["up", "degraded", "down"]


@dataclass(frozen=True)
class IterationRecord:
    """One gradient computed by one worker.

    Attributes:
        worker: worker index.
        incarnation: how many times Ray restarted the worker before this iteration.
        uid: the update id of the gradient.
        clock: clocks the worker had finished when it started this one.
        t_start: when the iteration began (before the consistency gate).
        t_gate: when the gate let it through.
        t_compute_start: when computing the gradient began (weights in hand).
        t_compute_end: when the gradient was ready.
        t_end: when the push returned (acknowledged or buffered); the clock advances after it.
        loss: the minibatch loss.
        read_versions: per shard, the version of the weights used.
        outcomes: per shard, ``acked`` or ``buffered``.
    """

    worker: int
    incarnation: int
    uid: int
    clock: int
    t_start: float
    t_gate: float
    t_compute_start: float
    t_compute_end: float
    t_end: float
    loss: float
    read_versions: tuple[int, ...]
    outcomes: tuple[PushOutcome, ...]


@dataclass(frozen=True)
class AckRecord:
    """A server acknowledged these ids to a worker (at push time or in a backlog hand-over)."""

    worker: int
    shard: int
    time: float
    uids: tuple[int, ...]
    state_version: int
    state_digest: str


@dataclass(frozen=True)
class Event:
    """A fault or a recovery.

    Attributes:
        time: when it happened.
        kind: ``kill`` (SIGKILL sent), ``recovered`` (the shard serves again: a restarted or
            replaced server is ready, or a chain's successor took over), ``rejoined`` (a chain
            is back to full length), ``worker_restarted``.
        shard: the shard (-1 for worker events).
        actor: the actor's name.
        detail: free text for people.
    """

    time: float
    kind: EventKind
    shard: int
    actor: str
    detail: str = ""


@dataclass(frozen=True)
class Sample:
    """One evaluation of the served model.

    Attributes:
        time: seconds since the start of training.
        updates: gradients in the served state (the smallest over shards).
        steps: optimizer steps of the served state (the smallest over shards).
        accuracy: test accuracy, ``nan`` while a shard cannot be read.
        loss: test loss, ``nan`` likewise.
        status: ``up``, ``degraded`` (serving with fewer replicas than configured) or ``down``.
    """

    time: float
    updates: int
    steps: int
    accuracy: float
    loss: float
    status: ServerStatus
