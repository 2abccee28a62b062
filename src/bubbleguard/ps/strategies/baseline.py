"""``baseline``: one server per shard and no fault tolerance, the no-failure reference.

A killed baseline server stays dead (the configuration rejects server kills for it); workers
would wait for it until their deadline.
"""

from __future__ import annotations

from bubbleguard.ps.runtime.server import ShardServer
from bubbleguard.ps.strategies.checkpoint import SingleServerStrategy


class BaselineStrategy(SingleServerStrategy):
    """A plain server: no checkpoints, no replicas, no restarts."""

    name = "baseline"
    server_class = ShardServer
    max_restarts = 0
