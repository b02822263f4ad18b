"""API keys: each key is one NATS client identity (``bus.auth``), so NATS itself checks it.

A key reads ``e2b_<hex>`` (the form every e2b SDK accepts: it checks ``e2b_`` and hex digits
before sending anything): 16 hex digits of key id, then 32 of secret; ``cli-<id>`` is the NATS
user, the secret its password. Keys of the earlier form ``dsec_<name>.<password>`` (user
``cli-<name>``) keep working. The gateway keeps no key list of its own: it connects to NATS as the
key's user, and a wrong or revoked key is refused by the server (HTTP 401). Issuing or revoking a
key edits the deployment's auth file; ``dsec up`` sees the file change and has nats-server reload
its users (which drops a revoked user's connections).

A key may carry quotas (``--max-sandboxes``, ``--max-cpu``, ``--max-memory-mb``; 0: no limit), kept
with the key in the auth file and, for placement, in KV ``dsec_tenants`` under its NATS user, which
only the operator may write (:func:`sync_limits` brings the bucket in step with the file). A key
without quotas of its own gets the deployment's defaults (``dsec api-key defaults``), if any.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from pathlib import Path
from typing import Any

import msgspec

from bus.auth import CLIENT_USER_PREFIX, AuthConfig
from bus.messages import TenantLimits

KEY_PREFIX = "dsec_"
E2B_PREFIX = "e2b_"
_ID_HEX, _SECRET_HEX = 16, 32
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_E2B = re.compile(rf"^{E2B_PREFIX}([0-9a-f]{{{_ID_HEX}}})([0-9a-f]{{{_SECRET_HEX}}})\Z")
_BAD = "not a dsec API key (expected e2b_<hex> or dsec_<name>.<secret>; see `dsec api-key create`)"


class BadKey(ValueError):
    """Not a dsec API key at all (malformed), as opposed to a key NATS refuses."""


def make_key(user: str, password: str) -> str:
    """The key of a NATS client user: the e2b form when the user and password are an issued id
    and secret, else the earlier ``dsec_`` form."""
    name = user.removeprefix(CLIENT_USER_PREFIX)
    key = f"{E2B_PREFIX}{name}{password}"
    return key if _E2B.match(key) else f"{KEY_PREFIX}{name}.{password}"


def parse_key(key: str) -> tuple[str, str]:
    """The NATS (user, password) of an API key."""
    if not isinstance(key, str):
        raise BadKey(_BAD)
    m = _E2B.match(key)
    if m:
        return CLIENT_USER_PREFIX + m.group(1), m.group(2)
    if not key.startswith(KEY_PREFIX) or "." not in key:
        raise BadKey(_BAD)
    name, _, password = key[len(KEY_PREFIX):].partition(".")
    if not _NAME.match(name) or not password or len(password) > 256:
        raise BadKey(_BAD)
    return CLIENT_USER_PREFIX + name, password


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _auth(auth_file: str | Path) -> tuple[Path, AuthConfig]:
    path = Path(auth_file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `dsec up --data-dir ...` with authentication first")
    return path, AuthConfig.load_or_create(path)


def check_limits(lim: TenantLimits) -> TenantLimits:
    """``lim`` when every figure is 0 (no limit) or more; ValueError otherwise."""
    for f in msgspec.structs.fields(lim):
        if getattr(lim, f.name) < 0:
            raise ValueError(f"--{f.name.replace('_', '-')} must be 0 (no limit) or more, got {getattr(lim, f.name)}")
    return lim


def _limits_dict(lim: TenantLimits | None) -> dict[str, Any] | None:
    return None if lim is None else {f.name: getattr(lim, f.name) for f in msgspec.structs.fields(lim)}


def create_api_key(auth_file: str | Path, name: str = "key", limits: TenantLimits | None = None) -> str:
    """Issue a new key (its own NATS user, a tenant) into ``auth_file``, with its quotas (None: the
    defaults); returns the key, shown once."""
    if not _NAME.match(name) or len(name) > 40:
        raise ValueError(f"--name must be 1-40 of [A-Za-z0-9_-], got {name!r}")
    path, cfg = _auth(auth_file)
    user, password = cfg.issue_client_credential(secrets.token_hex(_ID_HEX // 2), password=secrets.token_hex(_SECRET_HEX // 2), label=name)
    if limits is not None:
        cfg.client_info[user]["limits"] = _limits_dict(check_limits(limits))
    cfg.save(path)
    return make_key(user, password)


def _users_named(cfg: AuthConfig, name: str) -> list[str]:
    return [
        u for u in cfg.client_users
        if name in (u, u.removeprefix(CLIENT_USER_PREFIX), str(cfg.client_info.get(u, {}).get("name", "")))
    ]


def set_key_limits(auth_file: str | Path, name: str, limits: TenantLimits | None) -> list[str]:
    """Set the quotas of every key named ``name`` (None: back to the defaults); returns their users."""
    path, cfg = _auth(auth_file)
    users = _users_named(cfg, name)
    for u in users:
        info = cfg.client_info.setdefault(u, {"name": u.removeprefix(CLIENT_USER_PREFIX)})
        if limits is None:
            info.pop("limits", None)
        else:
            info["limits"] = _limits_dict(check_limits(limits))
    if users:
        cfg.save(path)
    return users


def set_default_limits(auth_file: str | Path, limits: TenantLimits | None) -> None:
    """The quotas of every key without its own (None: none)."""
    path, cfg = _auth(auth_file)
    cfg.default_limits = (_limits_dict(check_limits(limits)) if limits is not None else None) or {}
    cfg.save(path)


def _limits_of(d: Any) -> TenantLimits | None:
    return msgspec.convert(d, TenantLimits) if isinstance(d, dict) else None


def describe_limits(lim: TenantLimits | None) -> str:
    """For ``api-key ls``: ``defaults``, ``unlimited``, or the limits that are set."""
    if lim is None:
        return "defaults"
    parts = [
        f"{label}<={v:g}" for label, v in (("sandboxes", lim.max_sandboxes), ("cpu", lim.max_cpu), ("memory_mb", lim.max_memory_mb)) if v > 0
    ]
    return " ".join(parts) or "unlimited"


async def sync_limits(auth_file: str | Path, nats_url: str | None = None) -> int:
    """Bring KV ``dsec_tenants`` in step with the auth file, as the operator: each key's quotas (a key
    without them, and a revoked key: no record) and the defaults. Returns the records written."""
    from bus import codec
    from bus import subjects as S
    from bus.runtime import KV, connect

    _, cfg = _auth(auth_file)
    want: dict[str, TenantLimits] = {}
    for u in cfg.client_users:
        lim = _limits_of(cfg.client_info.get(u, {}).get("limits"))
        if lim is not None:
            want[u] = lim
    default = _limits_of(cfg.default_limits) if cfg.default_limits else None
    if default is not None:
        want[S.TENANT_DEFAULTS] = default
    nc = await connect(nats_url, name="dsec-api-key", connect_attempts=2, connect_timeout_s=5.0)
    try:
        kv: KV[TenantLimits] = await KV.open(nc.jetstream(), S.KV_TENANTS, codec.TENANT_LIMITS)
        written = 0
        for key in await kv.keys():
            if key not in want and (key == S.TENANT_DEFAULTS or key.startswith(CLIENT_USER_PREFIX)) and await kv.exists(key):
                await kv.delete(key)
        for key, lim in want.items():
            if await kv.get(key) != lim:
                await kv.put(key, lim)
                written += 1
        return written
    finally:
        await nc.close()


def list_api_keys(auth_file: str | Path) -> list[dict[str, Any]]:
    """Every key's name, NATS user (its tenant), creation time and quotas (None: the defaults); never the secret."""
    _, cfg = _auth(auth_file)
    out = []
    for user in sorted(cfg.client_users):
        info = cfg.client_info.get(user, {})
        at = info.get("created_at")
        out.append({
            "name": str(info.get("name", user.removeprefix(CLIENT_USER_PREFIX))), "user": user,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)) if isinstance(at, (int, float)) else "",
            "limits": _limits_dict(_limits_of(info.get("limits"))),
        })
    return out


def default_limits(auth_file: str | Path) -> TenantLimits | None:
    _, cfg = _auth(auth_file)
    return _limits_of(cfg.default_limits) if cfg.default_limits else None


def revoke_api_key(auth_file: str | Path, name: str) -> list[str]:
    """Remove every key named ``name`` (its label, NATS user or key id) from ``auth_file``; returns
    their users. ``dsec up`` reloads NATS, which refuses them from then on and drops their connections."""
    path, cfg = _auth(auth_file)
    users = _users_named(cfg, name)
    for u in users:
        cfg.revoke_client(u)
    if users:
        cfg.save(path)
    return users


async def kill_tenant_sandboxes(user: str, nats_url: str | None = None) -> list[str]:
    """Kill every live sandbox of tenant ``user`` (as the operator); returns their ids."""
    from bus import codec
    from bus import subjects as S
    from bus.runtime import KV, connect

    from .._async import AsyncSandbox
    from ._tenants import LIVE_STATES

    nc = await connect(nats_url, name="dsec-api-key", connect_attempts=2, connect_timeout_s=5.0)
    try:
        kv = await KV.bind(nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        killed = []
        for k in await kv.keys():
            rec = await kv.get(k)
            if rec is not None and rec.spec.client == user and rec.state in LIVE_STATES:
                await AsyncSandbox(rec.spec.sandbox_id, nc).kill()
                killed.append(rec.spec.sandbox_id)
        return killed
    finally:
        await nc.close()


async def _quiet(_exc: Exception) -> None:
    """Refusals while the server reloads are expected; the caller reports the outcome."""


async def wait_usable(key: str, nats_url: str | None = None, timeout: float = 15.0) -> bool:
    """True once NATS accepts the key's user (``dsec up`` reloads its users when the file changes)."""
    import asyncio

    from bus.errors import Unavailable
    from bus.runtime import connect
    from bus.runtime import nats_url as default_url

    from ._tenants import url_with_user

    user, password = parse_key(key)
    url = url_with_user(default_url(nats_url), user, password)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.1
    while loop.time() < deadline:
        try:
            nc = await connect(url, name="dsec-api-key", connect_attempts=1, connect_timeout_s=3.0, error_cb=_quiet)
        except Unavailable:
            await asyncio.sleep(delay)  # retry back-off while the server reloads
            delay = min(delay * 2, 1.0)
            continue
        await nc.close()
        return True
    return False


__all__ = [
    "E2B_PREFIX", "KEY_PREFIX", "BadKey", "check_limits", "create_api_key", "default_limits", "describe_limits", "key_digest", "kill_tenant_sandboxes",
    "list_api_keys", "make_key", "parse_key", "revoke_api_key", "set_default_limits", "set_key_limits", "sync_limits", "wait_usable",
]
