"""One sandbox's network as the manager records it, and the names it is known by in the kernel
(host-side veth, netns path)."""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any

from .config import IFNAMSIZ, NetworkConfig

__all__ = ["Attachment", "host_ifname", "random_ifname", "netns_path"]


@dataclass
class Attachment:
    """One sandbox's network: what it was given and what must be removed again (JSON-able)."""

    sandbox_id: str
    slot: int
    ifname: str
    ip: str
    gateway: str
    netns: str
    elements: dict[str, list[str]]
    hosts: list[tuple[str, str]] = field(default_factory=list)
    setup_ms: float = 0.0

    def to_extra(self) -> dict[str, Any]:
        return {"slot": self.slot, "ifname": self.ifname, "ip": self.ip, "gateway": self.gateway, "netns": self.netns, "elements": self.elements}

    @classmethod
    def from_extra(cls, sid: str, d: dict[str, Any]) -> "Attachment":
        return cls(sid, int(d["slot"]), d["ifname"], d["ip"], d["gateway"], d["netns"], {k: list(v) for k, v in d.get("elements", {}).items()})


def host_ifname(cfg: NetworkConfig, sid: str) -> str:
    """The host end of a network made for ``sid`` itself: derived from the id, so an agent that lost
    its records still finds it."""
    return _ifname(cfg, hashlib.blake2b(sid.encode(), digest_size=10).digest())


def random_ifname(cfg: NetworkConfig) -> str:
    """The host end of a pre-made network (its owner is not known yet; the alias names it later)."""
    return _ifname(cfg, os.urandom(10))


def _ifname(cfg: NetworkConfig, raw: bytes) -> str:
    return cfg.ifprefix + base64.b32encode(raw).decode().lower()[: IFNAMSIZ - len(cfg.ifprefix)]


def netns_path(cfg: NetworkConfig, name: str) -> str:
    return os.path.join(cfg.netns_dir, cfg.netns_prefix + name)
