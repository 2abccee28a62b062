"""The server's optimizer step and the three ways a backlog becomes one step.

A normal push is one SGD step with the gradient. A backlog hand-over (the ``stateless``
strategy) is also one step, with a direction built from the buffered gradients ``g_1 .. g_N``
(oldest first) by the chosen policy:

- ``sum-scaled`` (the paper's): ``backlog_lr_scale * sum_i g_i``, i.e. the sum with a reduced
  learning rate;
- ``mean``: ``(1 / N) * sum_i g_i``, one ordinary step's worth however long the outage;
- ``staleness-weighted``: ``sum_i g_i / (1 + tau_i)`` with ``tau_i = (version - read_version_i) + i``,
  as if the gradients were applied one after another, each with the staleness-aware rate
  ``lr / (1 + staleness)``. The weights fall like ``1 / i``, so a long backlog adds about
  ``log N`` steps' worth instead of ``N``. Inside a coalesced entry the positions' weights are
  averaged (exact when the entry holds one gradient).

Plain SGD is linear in the gradients, so applying the gradients of one bulk-synchronous clock
one by one equals applying their sum once; with momentum it does not.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bubbleguard.ps.core.messages import BacklogEntry


def sgd_step(
    params: torch.Tensor,
    momentum_buf: torch.Tensor,
    grad: torch.Tensor,
    lr: float,
    momentum: float,
) -> None:
    """One in-place SGD step (PyTorch's convention: ``buf = momentum * buf + grad``)."""
    if momentum:
        momentum_buf.mul_(momentum).add_(grad)
        params.add_(momentum_buf, alpha=-lr)
    else:
        params.add_(grad, alpha=-lr)


def backlog_gradient(
    entries: Sequence[BacklogEntry], *, policy: str, version: int, backlog_lr_scale: float
) -> torch.Tensor:
    """The direction one backlog step takes (see the module docstring).

    Args:
        entries: buffered entries, oldest first; none may be empty.
        policy: ``sum-scaled``, ``mean`` or ``staleness-weighted``.
        version: the shard version the step is applied at.
        backlog_lr_scale: the factor of ``sum-scaled``.

    Raises:
        ValueError: no entries, or an unknown policy.
    """
    if not entries:
        raise ValueError("a backlog step needs at least one entry")
    total = torch.zeros_like(entries[0].values)
    if policy == "sum-scaled":
        for entry in entries:
            total.add_(entry.values)
        return total.mul_(backlog_lr_scale)
    if policy == "mean":
        for entry in entries:
            total.add_(entry.values)
        return total.div_(sum(e.num_gradients for e in entries))
    if policy == "staleness-weighted":
        position = 0
        for entry in entries:
            # Negative only if the state rolled back past the weights the entry was computed
            # on; such an entry is treated as fresh rather than given a weight above 1.
            base = max(version - entry.read_version, 0)
            weights = [1.0 / (1 + base + position + k) for k in range(entry.num_gradients)]
            total.add_(entry.values, alpha=sum(weights) / len(weights))
            position += entry.num_gradients
        return total
    raise ValueError(
        f"unknown backlog policy {policy!r}; expected sum-scaled, mean or staleness-weighted"
    )
