"""The ``container`` backend (containerd + runc), one module per concern:

- ``backend``: the ``ContainerBackend`` that composes the parts below
- ``layers``: read-only image layers, mounted once per host
- ``shims``: containers sharing containerd shims
- ``warmpool``: started containers kept ready (``WarmKey``)
- ``criu``: checkpoint and restore of a sandbox's processes
- ``cgroups``: cgroup v1 limits, leftovers and metrics
- ``reconcile``: leftovers, drift against containerd, recovery after a restart
- ``containerd``, ``daemon``: containerd's gRPC API, and the private containerd
- ``freezer``: the cgroup v1 freezer; ``cleanup``: ``python -m hostagent --cleanup``
(the errno translation of the in-sandbox agent is shared by every agent-running backend: ``hostagent._agent_errors``)
"""

from __future__ import annotations

from ..._backend import Backend
from ..._config import HostAgentConfig
from ...network import network_config
from .backend import ContainerBackend
from .cgroups import START_CPU
from .layers import mount_erofs


def from_config(config: HostAgentConfig) -> Backend:  # (mypy checks it implements the protocol)
    return ContainerBackend(
        config.data_dir, containerd_address=config.containerd_address, warm_pool=config.warm_pool,
        network=network_config(config.net_prefix), containerd_calls=config.containerd_calls,
        write_reserve_mb=config.write_reserve_mb,
    )


__all__ = ["START_CPU", "ContainerBackend", "from_config", "mount_erofs", "network_config"]
