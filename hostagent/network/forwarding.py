"""The host's ``ip_forward``: turned on when the first sandbox network is made, and what it was
before kept in the state dir (across restarts), so a purge can put it back and the base ruleset
knows whether to guard forwarding that is not sandbox traffic."""

from __future__ import annotations

import json
import os

from .config import NetworkConfig

__all__ = ["enable", "restore"]

_SYSCTL = "/proc/sys/net/ipv4/ip_forward"


def _state_path(cfg: NetworkConfig) -> str:
    return os.path.join(cfg.state_dir, f"net-{cfg.table}.json")


def enable(cfg: NetworkConfig) -> bool:
    """Turn forwarding on; True when nobody forwarded before us (then forward nothing but sandbox
    traffic)."""
    os.makedirs(cfg.state_dir, mode=0o700, exist_ok=True)
    path = _state_path(cfg)
    try:
        with open(path) as f:
            state = json.load(f)
    except (OSError, ValueError):
        state = {}
    with open(_SYSCTL) as f:
        fwd = f.read().strip()
    if "forward_was" not in state:
        state["forward_was"] = fwd
    if fwd != "1":
        with open(_SYSCTL, "w") as f:
            f.write("1")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(state, f)
    os.replace(tmp, path)
    return bool(state["forward_was"] == "0")


def restore(cfg: NetworkConfig) -> None:
    """Forget this config's state; put forwarding back off if we turned it on and no other dsec
    table's state is left."""
    path = _state_path(cfg)
    try:
        with open(path) as f:
            was = json.load(f).get("forward_was")
        os.unlink(path)
    except (OSError, ValueError):
        was = None
    others = [x for x in os.listdir(cfg.state_dir) if x.startswith("net-")] if os.path.isdir(cfg.state_dir) else []
    if was == "0" and not others:
        with open(_SYSCTL, "w") as f:
            f.write("0")
