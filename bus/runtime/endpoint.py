"""Request/reply endpoints, in the spirit of nats.py's ``micro``: one typed decoder per subject, one
error boundary, per-endpoint stats.

Every request that can be answered is answered: a result, or an ``ErrorReply`` (a ``DsecError``
keeps its code; anything else becomes ``internal``). A reply larger than the connection's
``max_payload`` is replaced by a ``reply_too_large`` error reply, so the caller sees why instead of
waiting for its timeout. A request delivered by a stream (its reply is ``$JS.ACK.``) is refused
without an answer: a push consumer anyone may create can replay stored bytes onto a request subject,
and answering would ack the attacker's consumer.

Handlers run one task per request, so a slow request does not hold up the next one; subscriptions
take no task of their own (``subscribe_sync``), so thousands of them (one per sandbox) cost little.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from .. import log as _log
from ..codec import Decoder, encode
from ..errors import BadRequest, DsecError, ErrorReply, InternalError, ReplyTooLarge
from ..subjects import is_stream_delivery
from .publisher import subscribe_sync, unsubscribe_answering

logger = _log.get_logger("dsec.bus.endpoint")

# Room left under max_payload for the reply's protocol line and headers.
REPLY_HEADROOM = 1024

EndpointHandler = Callable[[Msg, Any], Awaitable[Any]]


def error_of(exc: BaseException) -> ErrorReply:
    """The wire error for an exception: a DsecError keeps its code, anything else is ``internal``."""
    if isinstance(exc, DsecError):
        return exc.to_reply()
    return InternalError(f"{type(exc).__name__}: {exc}").to_reply()


class EndpointStats(msgspec.Struct, kw_only=True):
    """Like micro's endpoint stats: counts, total and average processing time, the last error."""

    name: str
    num_requests: int = 0
    num_errors: int = 0
    processing_time_ns: int = 0
    average_processing_time_ns: int = 0
    last_error: str = ""
    replies_too_large: int = 0
    refused: int = 0  # stream-delivered requests refused unanswered


class NotMine(Exception):
    """Raised by a handler for a request it must not answer at all: another responder on the same
    subject owns it (a sandbox restored on another host while this one was cut off)."""


class Endpoint:
    """Answers requests on any number of subjects with one handler and one set of stats.

    ``decoder``: one ``Decoder`` for every subject, or a mapping from the subject's last token (the
    operation, as in ``dsec.sbx.<id>.<op>``) to its decoder; an unknown token is a ``bad_request``.
    The handler gets ``(msg, request)`` and returns a msgspec Struct (or raises).
    """

    def __init__(
        self,
        nc: NATS,
        name: str,
        handler: EndpointHandler,
        *,
        decoder: Decoder | Mapping[str, Decoder] | None = None,
        bind: Callable[[Msg], dict[str, str]] | None = None,
        encoder: Callable[[Any, int], bytes] | None = None,
    ) -> None:
        self.nc = nc
        self.name = name
        self.handler = handler
        self.decoder = decoder
        self.bind = bind  # structlog context of a request (e.g. sandbox_id), bound while it runs
        # encoder(result, limit): the reply's bytes, fitted to ``limit`` its own way (say, output cut
        # to fit, or an error that says what to do instead); the size check below still applies.
        self.encoder = encoder
        self.stats = EndpointStats(name=name)
        self._subs: dict[str, Subscription] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- subscriptions --------------------------------------------------------------------
    async def serve(self, subject: str, *, queue: str = "") -> None:
        """Answer requests on ``subject`` (idempotent)."""
        if subject not in self._subs:
            self._subs[subject] = await subscribe_sync(self.nc, subject, self._on_msg, queue=queue)

    async def unserve(self, subject: str) -> None:
        """Stop answering on ``subject``; requests already on their way still get an answer."""
        await unsubscribe_answering(self._subs.pop(subject, None))

    @property
    def subjects(self) -> list[str]:
        return list(self._subs)

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop taking requests; wait up to ``grace_s`` for those running, then cancel them."""
        for subject in list(self._subs):
            await self.unserve(subject)
        if self._tasks and grace_s > 0:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for t in list(self._tasks):
            t.cancel()

    def _on_msg(self, msg: Msg) -> None:
        t = asyncio.get_running_loop().create_task(self.handle(msg))
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # --- the boundary ---------------------------------------------------------------------
    def _decode(self, msg: Msg) -> Any:
        d = self.decoder
        if d is None:
            return None
        if isinstance(d, Decoder):
            return d.decode(msg.data)
        op = msg.subject.rsplit(".", 1)[-1]
        dec = d.get(op)
        if dec is None:
            raise BadRequest(f"unknown operation {op!r}; one of {', '.join(d)}")
        return dec.decode(msg.data)

    async def handle(self, msg: Msg) -> None:
        """Decode, run the handler, answer: the one error boundary."""
        if is_stream_delivery(msg.reply):
            self.stats.refused += 1
            logger.warning("stream_delivered_request_refused", endpoint=self.name, subject=msg.subject)
            return
        st = self.stats
        st.num_requests += 1
        ctx = self.bind(msg) if self.bind is not None else None
        if ctx:
            structlog.contextvars.bind_contextvars(**ctx)
        t0 = time.perf_counter_ns()
        try:
            try:
                result = await self.handler(msg, self._decode(msg))
            except NotMine:
                return  # another responder owns the request: its answer is the one
            except DsecError as exc:
                result = exc.to_reply()
            except Exception as exc:  # noqa: BLE001 - every request gets an answer
                logger.exception("request_failed", endpoint=self.name, subject=msg.subject)
                result = error_of(exc)
            if isinstance(result, ErrorReply):
                st.num_errors += 1
                st.last_error = f"{result.code}: {result.description}"[:512]
            if msg.reply:
                await self._reply(msg, result)
        finally:
            st.processing_time_ns += time.perf_counter_ns() - t0
            st.average_processing_time_ns = st.processing_time_ns // st.num_requests
            if ctx:
                structlog.contextvars.unbind_contextvars(*ctx)

    async def _reply(self, msg: Msg, result: Any) -> None:
        limit = self.nc.max_payload - REPLY_HEADROOM
        data = self.encoder(result, limit) if self.encoder is not None else encode(result)
        if len(data) > limit:
            self.stats.replies_too_large += 1
            self.stats.num_errors += 1
            err = ReplyTooLarge(
                f"the reply to {msg.subject} is {len(data)} bytes, over the server's payload limit ({self.nc.max_payload})",
                size=len(data), max_payload=self.nc.max_payload,
            )
            self.stats.last_error = str(err)[:512]
            logger.warning("reply_too_large", endpoint=self.name, subject=msg.subject, size=len(data))
            data = encode(err.to_reply())
        try:
            await msg.respond(data)
        except Exception as exc:  # noqa: BLE001 - the caller times out; counted, logged
            self.stats.num_errors += 1
            self.stats.last_error = f"reply_failed: {exc}"[:512]
            logger.warning("reply_failed", endpoint=self.name, subject=msg.subject, error=str(exc))


__all__ = ["Endpoint", "EndpointStats", "NotMine", "error_of"]
