"""The ``vm`` backend (``VMBackend``): a full PC (QEMU q35) with a display, for GUI tasks, on the
microvm backend's parts (initramfs with the agent as /init, layers, serial mux, snapshots) with
Debian's generic kernel (``linux-image-amd64``: DRM and framebuffer drivers);
screenshots and input (``sb.screenshot()``, ``sb.input.*``) are QMP calls. The GUI template's
rootfs (Xorg, twm, xterm) is built by ``compose/gui-rootfs.sh``."""

from __future__ import annotations

import os

from ..._backend import Backend
from ..._config import HostAgentConfig
from ...network import network_config
from .backend import VMBackend


def from_config(config: HostAgentConfig) -> Backend:  # (mypy checks it implements the protocol)
    return VMBackend(
        config.data_dir, kernel_cache=os.environ.get("DSEC_MICROVM_KERNEL_CACHE") or None,
        accel=os.environ.get("DSEC_MICROVM_ACCEL") or None,
        layers=os.environ.get("DSEC_MICROVM_LAYERS") or None, network=network_config(config.net_prefix),
    )


__all__ = ["VMBackend", "from_config"]
