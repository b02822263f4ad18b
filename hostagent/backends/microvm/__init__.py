"""The ``microvm`` backend (``MicroVMBackend``), one module per concern:

- ``backend``: sandboxes as QEMU microVMs, their disks, recovery and reconcile
- ``qemu``: the command line, the KVM-or-TCG probe, QMP
- ``kernel``: Debian's cloud kernel, fetched and extracted; the initramfs with the agent as /init
- ``serialmux``: the host end of the agent's virtio-serial link
- ``net``: the VM's NIC, a tap on the sandbox network ``hostagent.network`` makes for containers

Settings from the environment: ``DSEC_MICROVM_ACCEL`` (kvm | tcg: skip the probe),
``DSEC_MICROVM_KERNEL_CACHE`` (where the extracted kernel is kept; default under the data dir),
``DSEC_MICROVM_LAYERS`` (blk: the layers as virtio-blk disks even where virtio-pmem with DAX works;
pmem: try virtio-pmem again after a guest here found no DAX). The mode in use is in the heartbeat's
backend detail ``layers``: virtio-pmem+dax, virtio-pmem (no guest has reported yet) or virtio-blk.
"""

from __future__ import annotations

import os

from ..._backend import Backend
from ..._config import HostAgentConfig
from ...network import network_config
from .backend import MicroVMBackend


def from_config(config: HostAgentConfig) -> Backend:  # (mypy checks it implements the protocol)
    return MicroVMBackend(
        config.data_dir, kernel_cache=os.environ.get("DSEC_MICROVM_KERNEL_CACHE") or None,
        accel=os.environ.get("DSEC_MICROVM_ACCEL") or None,
        layers=os.environ.get("DSEC_MICROVM_LAYERS") or None, network=network_config(config.net_prefix),
    )


__all__ = ["MicroVMBackend", "from_config"]
