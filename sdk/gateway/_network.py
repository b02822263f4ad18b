"""E2B's sandbox network options over dsec's egress allowlist.

E2B's model: egress is open unless ``allow_internet_access`` is false; ``network={"deny_out": [...],
"allow_out": [...]}`` blocks what ``deny_out`` names except what ``allow_out`` names. dsec's model:
no egress unless ``allow_out`` names it (``bus.messages.NetworkSpec``). What maps:

- ``deny_out`` of all traffic (``0.0.0.0/0``, the SDK's ``ALL_TRAFFIC``) with ``allow_out``: dsec's
  allowlist, entry for entry (IPs, CIDRs, host names; a name is resolved at create).
- ``allow_internet_access`` false, or ``deny_out`` all traffic with no ``allow_out``: no egress
  (``allow_out`` wins over both, as in E2B).
- ``allow_out`` without ``deny_out``: the allowlist too (E2B would leave the rest open; dsec opens
  no egress that is not named).
- ``allow_internet_access`` true or absent, no ``network``: the sandbox profile's default, which is
  no egress here (dsec opens egress only to what an allowlist names).

A ``deny_out`` that is not all traffic (block a few, allow the rest) cannot be expressed as an
allowlist and is refused with ``invalid_argument``, as are E2B's proxy, DNS, masking and rules
options, rather than being silently ignored.
"""

from __future__ import annotations

from typing import Any

from bus.errors import InvalidArgument

ALL_TRAFFIC = "0.0.0.0/0"
_UNSUPPORTED = ("egressProxy", "dnsServers", "rules", "maskRequestHost", "httpsPorts")


def _selector(doc: dict[str, Any], key: str) -> list[str]:
    v = doc.get(key)
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, str) and x for x in v):
        raise InvalidArgument(f"network {key} must be a list of non-empty strings, got {v!r}")
    return list(v)


def allow_out(doc: dict[str, Any], *, network_key: str | None = "network") -> list[str] | None:
    """The dsec allowlist an E2B create (``network_key="network"``) or network update (``None``: the
    body is the network document) asks for; None: no allowlist (no egress)."""
    access = doc.get("allow_internet_access")
    if access is not None and not isinstance(access, bool):
        raise InvalidArgument(f"allow_internet_access must be a boolean, got {access!r}")
    net = doc.get(network_key) if network_key else doc
    if net is None:
        net = {}
    if not isinstance(net, dict):
        raise InvalidArgument(f"network must be an object, got {net!r}")
    for key in _UNSUPPORTED:
        if net.get(key):
            raise InvalidArgument(f"network {key} is not supported by dsec (its egress is an allowlist)")
    if net.get("allowPublicTraffic") is False:
        raise InvalidArgument("network allowPublicTraffic=false is not supported by dsec (sandbox ports need the gateway's token anyway)")
    allow, deny = _selector(net, "allowOut"), _selector(net, "denyOut")
    if deny and deny != [ALL_TRAFFIC]:
        raise InvalidArgument(
            f"network denyOut {deny!r}: dsec's egress is an allowlist, so only denyOut=[{ALL_TRAFFIC!r}] (all traffic) with allowOut is supported"
        )
    return allow or None


__all__ = ["ALL_TRAFFIC", "allow_out"]
