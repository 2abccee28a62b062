"""Start a local Ray cluster on loopback, or join an existing one.

``with RayCluster(ClusterConfig()):`` starts a single-node cluster bound to 127.0.0.1 (no
dashboard) and shuts it down on exit; ``ClusterConfig(address="HOST:PORT")`` joins a running
cluster instead and leaves it running. If Ray is already initialised in this process (a test
session, a notebook), the context manager uses that and leaves it alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from types import TracebackType

import ray

NAMESPACE = "bubbleguard-ps"
"""Ray namespace of every actor and key-value entry this package creates."""


@dataclass(frozen=True)
class ClusterConfig:
    """How to get a Ray cluster.

    Attributes:
        address: ``None`` starts a local cluster; ``"HOST:PORT"`` or ``"auto"`` joins one.
        num_cpus: CPUs the local cluster advertises (``None``: all).
        object_store_memory_bytes: object store size of the local cluster (``None``: Ray's default).
        loopback_only: bind the local cluster to 127.0.0.1 instead of the machine's address.
        log_to_driver: forward actors' stdout and stderr to this process.
    """

    address: str | None = None
    num_cpus: int | None = None
    object_store_memory_bytes: int | None = None
    loopback_only: bool = True
    log_to_driver: bool = False


def _pin_to_loopback() -> None:
    # Ray 2.60 rewrites 127.0.0.1 to the machine's routable address (services.
    # resolve_ip_for_localhost) unless multi-node clusters are disabled, which is what makes it
    # use the loopback address for the node. The flag is read from the environment by child
    # processes and from this module attribute by the driver.
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


class RayCluster:
    """Context manager that provides a Ray cluster for a run (see the module docstring)."""

    def __init__(self, config: ClusterConfig | None = None) -> None:
        self.config = config or ClusterConfig()
        self._owned = False

    def __enter__(self) -> RayCluster:
        """Start or join the cluster."""
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Shut the cluster down if this object started it."""
        self.stop()

    def start(self) -> None:
        """Start a local cluster or join ``config.address``; no-op if Ray is already up."""
        if ray.is_initialized():
            return
        cfg = self.config
        if cfg.address is None:
            if cfg.loopback_only:
                _pin_to_loopback()
            ray.init(
                num_cpus=cfg.num_cpus,
                object_store_memory=cfg.object_store_memory_bytes,
                include_dashboard=False,
                log_to_driver=cfg.log_to_driver,
                namespace=NAMESPACE,
                configure_logging=True,
                logging_level=logging.WARNING,
            )
        else:
            ray.init(address=cfg.address, log_to_driver=cfg.log_to_driver, namespace=NAMESPACE, logging_level=logging.WARNING)
        self._owned = True

    def stop(self) -> None:
        """Shut Ray down if :meth:`start` started or joined it here."""
        if self._owned and ray.is_initialized():
            ray.shutdown()
        self._owned = False

    @staticmethod
    def node_ip() -> str:
        """The address of this process's Ray node."""
        return str(ray.util.get_node_ip_address())
