"""Connecting to NATS: bounded first-connect retries, the user's inbox prefix, one-line error logs."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import weakref
from typing import Any
from urllib.parse import unquote, urlsplit

import nats.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from ..auth import ANONYMOUS_USER, split_urls, CLIENT_USER_PREFIX, ROLLOUTS_ROLE, SANDBOX_USER_PREFIX, inbox_prefix, load_client_context
from ..errors import Unavailable
from ..subjects import valid_token

DEFAULT_URL = "nats://127.0.0.1:4222"


def nats_url(url: str | None = None) -> str:
    """``url``, else $DSEC_NATS_URL, else the client context `dsec up` wrote (bus.auth), else the default.

    Any of them may be a seed list, ``nats://a:4222,nats://b:4222,nats://c:4222`` (a NATS cluster's
    nodes): the client connects to one of them, learns the rest of the cluster from it, and moves to
    another node when its node goes away."""
    if url or os.environ.get("DSEC_NATS_URL"):
        return url or os.environ["DSEC_NATS_URL"]
    ctx = load_client_context()
    return ctx.url if ctx else DEFAULT_URL


async def connect(
    url: str | None = None,
    *,
    name: str = "dsec",
    connect_attempts: int = 20,
    connect_timeout_s: float = 30.0,
    max_reconnect_attempts: int = 120,
    user_credentials: str | None = None,
    **kwargs: Any,
) -> NATS:
    """Connect to NATS, retrying the first connect a bounded number of times (in attempts and time)."""
    servers = split_urls(nats_url(url))
    first = urlsplit(servers[0])
    if first.username and first.password is not None and "user" not in kwargs and "password" not in kwargs:
        # A cluster's nodes tell the client of each other (their URLs, without credentials): a reconnect
        # to one it learnt of that way must present the seed list's credentials too.
        kwargs.update(user=unquote(first.username), password=unquote(first.password))
    user = kwargs.get("user") or first.username
    user = unquote(user) if user else ANONYMOUS_USER
    if valid_token(user):  # each user may only receive under its own prefix (bus.auth): replies must come back there
        kwargs.setdefault("inbox_prefix", inbox_prefix(user))
    if user_credentials is None:
        user_credentials = os.environ.get("DSEC_NATS_CREDS") or None
    user_cb = kwargs.pop("error_cb", None) or _log_nats_error
    holder: list[NATS] = []
    connected: list[bool] = []  # once the first connect is done (its own refusals are retried below)

    async def on_error(exc: Exception) -> None:
        await user_cb(exc)
        # A credential the server refuses once connected was revoked (`dsec api-key revoke`: the
        # reload drops its connections): stop, rather than retry it for minutes as a reconnect.
        if connected and _refused(exc) and not holder[0].is_closed:
            asyncio.ensure_future(holder[0].close())

    kwargs["error_cb"] = on_error
    deadline = time.monotonic() + connect_timeout_s
    delay = 0.05
    last: Exception | None = None
    for _ in range(connect_attempts):
        # nats-py retries a first connect max_reconnect_attempts times by itself: bound it by our deadline.
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        nc = NATS()
        holder[:] = [nc]
        try:
            await asyncio.wait_for(
                nc.connect(
                    servers=servers,
                    name=name,
                    connect_timeout=2,
                    allow_reconnect=True,
                    max_reconnect_attempts=max_reconnect_attempts,
                    reconnect_time_wait=0.5,  # type: ignore[arg-type]  # nats-py annotates int; it sleeps for it, a float works
                    user_credentials=user_credentials,
                    **kwargs,
                ),
                remaining,
            )
            if valid_token(user):
                _tenants[nc] = user
            _ping_behind_pending(nc)
            connected.append(True)
            return nc
        except (nats.errors.NoServersError, OSError, asyncio.TimeoutError, nats.errors.Error) as exc:
            last = exc if not isinstance(exc, asyncio.TimeoutError) else nc.last_error or exc
            try:
                await nc.close()
            except Exception:  # noqa: BLE001 - never connected
                pass
            if time.monotonic() + delay > deadline:
                break
            await asyncio.sleep(delay)  # retry back-off
            delay = min(delay * 2, 1.0)
    raise Unavailable(f"cannot reach NATS at {','.join(servers)}: {last or 'timed out'}")


_tenants: "weakref.WeakKeyDictionary[NATS, str]" = weakref.WeakKeyDictionary()


def _ping_behind_pending(nc: NATS) -> None:
    """Make the connection's PINGs (``flush()``, keep-alives) leave behind what is queued before them.

    nats-py 2.x (``Client._send_ping``) writes its PING straight to the socket while earlier commands
    still wait in ``_pending`` for the flusher task. So ``flush()`` could return before the server had
    a SUB sent just before it, and a publish from another connection then met no responders: 52 of
    3,000 tries here; a CI run hung on it. nats.py2 had the same fault (nats-io/nats.py2#24).
    """
    send_ping = nc._send_ping
    c: Any = nc

    async def ping_behind_pending(future: asyncio.Future[Any] | None = None) -> None:
        if c.is_connected and c._pending_data_size > 0 and c._transport is not None:
            c._transport.writelines(c._pending[:])
            c._pending = []
            c._pending_data_size = 0
        await send_ping(future)

    c._send_ping = ping_behind_pending


def _refused(exc: Exception) -> bool:
    return isinstance(exc, nats.errors.AuthorizationError) or "authorization violation" in str(exc).lower()


def tenant_of(nc: NATS) -> str:
    """The tenant a connection speaks for: its NATS user (bus.auth), ``client`` without one."""
    t = _tenants.get(nc)
    if t is None:
        u = nc.connected_url
        user = unquote(u.username) if u is not None and u.username else ANONYMOUS_USER
        t = user if valid_token(user) else ANONYMOUS_USER
    return t


def connection_of(js: JetStreamContext) -> NATS:
    """The connection behind a JetStream context (nats-py 2.16 keeps it private: ``_nc``)."""
    nc: NATS = js._nc
    return nc


def reads_records(nc: NATS) -> bool:
    """Whether this connection may read sandbox records (KV dsec_sandboxes): services and the
    operator may, a client tenant may not (the server would refuse it, after a timeout); nor may the
    rollout workers, a client tenant of their own."""
    t = tenant_of(nc)
    return t != ROLLOUTS_ROLE and not t.startswith((CLIENT_USER_PREFIX, SANDBOX_USER_PREFIX))


async def _log_nats_error(exc: Exception) -> None:
    """One line per connection error (nats-py's default prints a whole traceback for each retry)."""
    logging.getLogger("dsec.nats").warning("nats: %s: %s", type(exc).__name__, exc)


__all__ = ["DEFAULT_URL", "connect", "connection_of", "nats_url", "reads_records", "tenant_of"]
