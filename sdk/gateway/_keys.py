"""API keys: each key is one NATS client identity (``bus.auth``), so NATS itself checks it.

A key reads ``e2b_<hex>`` (the form every e2b SDK accepts: it checks ``e2b_`` and hex digits
before sending anything): 16 hex digits of key id, then 32 of secret; ``cli-<id>`` is the NATS
user, the secret its password. Keys of the earlier form ``dsec_<name>.<password>`` (user
``cli-<name>``) keep working. The gateway keeps no key list of its own: it connects to NATS as the
key's user, and a wrong or revoked key is refused by the server (HTTP 401). Issuing or revoking a
key edits the deployment's auth file; ``dsec up`` sees the file change and has nats-server reload
its users (which drops a revoked user's connections).
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from pathlib import Path

from bus.auth import CLIENT_USER_PREFIX, AuthConfig

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


def create_api_key(auth_file: str | Path, name: str = "key") -> str:
    """Issue a new key (its own NATS user, a tenant) into ``auth_file``; returns the key, shown once."""
    if not _NAME.match(name) or len(name) > 40:
        raise ValueError(f"--name must be 1-40 of [A-Za-z0-9_-], got {name!r}")
    path, cfg = _auth(auth_file)
    user, password = cfg.issue_client_credential(secrets.token_hex(_ID_HEX // 2), password=secrets.token_hex(_SECRET_HEX // 2), label=name)
    cfg.save(path)
    return make_key(user, password)


def list_api_keys(auth_file: str | Path) -> list[dict[str, str]]:
    """Every key's name, NATS user (its tenant) and creation time; never the secret."""
    _, cfg = _auth(auth_file)
    out = []
    for user in sorted(cfg.client_users):
        info = cfg.client_info.get(user, {})
        at = info.get("created_at")
        out.append({
            "name": str(info.get("name", user.removeprefix(CLIENT_USER_PREFIX))), "user": user,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at)) if isinstance(at, (int, float)) else "",
        })
    return out


def revoke_api_key(auth_file: str | Path, name: str) -> list[str]:
    """Remove every key named ``name`` (its label, NATS user or key id) from ``auth_file``; returns
    their users. ``dsec up`` reloads NATS, which refuses them from then on and drops their connections."""
    path, cfg = _auth(auth_file)
    users = [
        u for u in cfg.client_users
        if name in (u, u.removeprefix(CLIENT_USER_PREFIX), str(cfg.client_info.get(u, {}).get("name", "")))
    ]
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
    "E2B_PREFIX", "KEY_PREFIX", "BadKey", "create_api_key", "key_digest", "kill_tenant_sandboxes", "list_api_keys", "make_key", "parse_key",
    "revoke_api_key", "wait_usable",
]
