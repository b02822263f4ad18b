"""API keys: each key is one NATS client identity (``bus.auth``), so NATS itself checks it.

A key reads ``dsec_<name>.<password>``: ``cli-<name>`` is the NATS user, the rest its password.
The gateway keeps no key list of its own: it connects to NATS as the key's user, and a wrong key
is refused by the server (HTTP 401). Issuing a key adds the user to the deployment's auth file;
``dsec up`` sees the file change and has nats-server reload its users.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

from bus.auth import CLIENT_USER_PREFIX, AuthConfig

KEY_PREFIX = "dsec_"
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


class BadKey(ValueError):
    """Not a dsec API key at all (malformed), as opposed to a key NATS refuses."""


def make_key(user: str, password: str) -> str:
    return f"{KEY_PREFIX}{user.removeprefix(CLIENT_USER_PREFIX)}.{password}"


def parse_key(key: str) -> tuple[str, str]:
    """The NATS (user, password) of an API key."""
    if not isinstance(key, str) or not key.startswith(KEY_PREFIX) or "." not in key:
        raise BadKey("not a dsec API key (expected dsec_<name>.<secret>; see `dsec api-key create`)")
    name, _, password = key[len(KEY_PREFIX):].partition(".")
    if not _NAME.match(name) or not password or len(password) > 256:
        raise BadKey("not a dsec API key (expected dsec_<name>.<secret>; see `dsec api-key create`)")
    return CLIENT_USER_PREFIX + name, password


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def create_api_key(auth_file: str | Path, name: str = "key") -> str:
    """Issue a new key (its own NATS user) into ``auth_file``; returns the key, shown once."""
    if not _NAME.match(name) or len(name) > 40:
        raise ValueError(f"--name must be 1-40 of [A-Za-z0-9_-], got {name!r}")
    path = Path(auth_file)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: run `dsec up --data-dir ...` with authentication first")
    cfg = AuthConfig.load_or_create(path)
    user, password = cfg.issue_client_credential(f"{name}-{secrets.token_hex(4)}")
    cfg.save(path)
    return make_key(user, password)


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


__all__ = ["KEY_PREFIX", "BadKey", "create_api_key", "key_digest", "make_key", "parse_key", "wait_usable"]
