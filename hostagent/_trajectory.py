"""The host's side of the trajectory log: every numbered operation (a request with ``step >= 0``,
bus.trajectory) is appended to ``dsec.traj.<tenant>.<sandbox>`` (DSEC_TRAJ; the
sandbox owner's tenant, so that only its owner and the operator read it).

The step is published before its reply, on the same connection: nats-server takes a connection's
messages in order, so a reply that reached its client had its step reach the stream first (a host
dying after it answered cannot lose the step). The stream's ack is not awaited before the reply (an
ack round trip per exec was a third of its latency): it comes in afterwards, and a step the stream
did not take is stored again (acked, de-duplicated by its msg id) until it is. The same client's next
step runs only once its previous one is in the log: a client learns of a log that stays unavailable
(``unavailable``, and the step is not run) one step late, never with a gap behind it on this host.
A reader may find a step missing for the moment between its reply and its ack; the SDK's own
``trajectory()`` waits for the steps it was answered (sdk/_trajectory).

A step this host already answered (a client that lost the reply, or a client taking over from one
that died while its step ran) is answered with the same outcome, awaited if it still runs, and never
run twice; the same step number with a different request is a ``trajectory_conflict``. This memory is
the recent steps only (``RECENT``): a client replaying older ones reads the log itself (sdk/_trajectory).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.client import Client as NATS

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, InternalError, TrajectoryConflict, Unavailable
from bus.runtime import StoreError, publisher_for
from bus.messages import ExecResult
from bus.trajectory import is_logged, make_step, normalized, output_cap

log = structlog.get_logger("dsec.hostagent.trajectory")

RECENT = 1024  # steps remembered (per host) for answering a repeated one without running it again
RECENT_BYTES = 64 << 20  # ... and at most this much command output among them
LOG_TIMEOUT_S = 10.0

Outcome = tuple[Any, DsecError | None]
Key = tuple[str, str, int]  # (sandbox, client, step)


class Trajectory:
    def __init__(self, nc: NATS, host_id: str) -> None:
        self.nc = nc
        self.host_id = host_id
        self.recent: OrderedDict[Key, tuple[str, asyncio.Future[Outcome]]] = OrderedDict()
        self.sizes: dict[Key, int] = {}
        self.held = 0  # bytes of output the remembered outcomes hold
        self.unlogged: dict[Key, tuple[str, bytes, dict[str, str]]] = {}  # published, not acked yet: what to store again
        self.waiters: dict[Key, asyncio.Future[None]] = {}  # a next step waiting for this one's ack
        self.again: dict[Key, None] = {}  # the stream did not take these: stored again by ``_store_again``
        self._retrier: asyncio.Task[None] | None = None
        self.cap = output_cap()  # read once: an environment lookup per step cost more than the rest of the step's making

    async def run(self, sid: str, op: str, req: Any, fn: Callable[[], Awaitable[Any]], tenant: str = S.OPERATOR_TENANT) -> Any:
        """``fn()``'s result for ``req``, logged (under ``tenant``, the sandbox owner's) when ``req``
        is a numbered step: published before this returns, acked afterwards."""
        if getattr(req, "step", -1) < 0 or not is_logged(req):
            return await fn()
        if not S.valid_token(req.client_id):
            raise BadRequest(f"a numbered step needs a client id (letters, digits, - and _), got {req.client_id!r}")
        key = (sid, req.client_id, req.step)
        encoded, d = normalized(req)
        seen = self.recent.get(key)
        if seen is not None:
            if seen[0] != d:
                raise TrajectoryConflict(f"step {req.step} of {req.client_id} was a different request", step=req.step, client_id=req.client_id)
            return _unwrap(await asyncio.shield(seen[1]))
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.recent[key] = (d, fut)  # before any wait: the same step arriving meanwhile waits for this one
        if (sid, req.client_id, req.step - 1) in self.unlogged:
            try:
                await self._previous_logged(key)
            except Unavailable as exc:
                self.recent.pop(key, None)  # not run: the client may send it again
                fut.set_result((None, exc))
                raise
        started, t0 = time.time(), time.perf_counter()
        outcome: Outcome
        try:
            outcome = (await fn(), None)
        except DsecError as exc:
            outcome = (None, exc)
        except Exception as exc:  # noqa: BLE001 - logged as the internal error the endpoint answers with
            outcome = (None, InternalError(f"{type(exc).__name__}: {exc}"))
        fut.set_result(outcome)
        self._remember(key, outcome[0])
        result = outcome[1].to_reply() if outcome[1] is not None else outcome[0]
        step = make_step(
            sid, op, req, result, started_at=started, duration_ms=(time.perf_counter() - t0) * 1000, host_id=self.host_id,
            req_digest=d, req_encoded=encoded, cap=self.cap,
        )
        await self._append(key, S.traj(sid, tenant), codec.encode(step))
        return _unwrap(outcome)

    def _remember(self, key: Key, result: Any) -> None:
        size = len(result.stdout) + len(result.stderr) if isinstance(result, ExecResult) else 0
        self.sizes[key] = size
        self.held += size
        recent = self.recent
        for _ in range(len(recent)):  # oldest first, without copying the keys per step (O(1) per step)
            if len(recent) <= RECENT and self.held <= RECENT_BYTES:
                break
            old = next(iter(recent))
            if recent[old][1].done():
                del recent[old]
                self.held -= self.sizes.pop(old, 0)
            else:
                recent.move_to_end(old)  # a step still running is kept

    # --- the log ------------------------------------------------------------------------------
    async def _previous_logged(self, key: Key) -> None:
        """Wait for the stream's ack of the client's previous step (long in, as a rule: its client
        had its reply first); Unavailable, and this step not run, when it does not come."""
        sid, client_id, step = key
        prev = (sid, client_id, step - 1)
        w = self.waiters.get(prev)
        if w is None:
            w = self.waiters[prev] = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(w), LOG_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise Unavailable(  # logged=False: the client may send this step number again
                f"step {step - 1} is not in the trajectory log yet (the log is unavailable): step {step} was not run", step=step, logged=False,
            ) from None

    async def _append(self, key: Key, subject: str, data: bytes) -> None:
        headers = {S.HDR_MSG_ID: S.traj_msg_id(*key)}
        self.unlogged[key] = (subject, data, headers)
        try:
            ack = await (await publisher_for(self.nc)).publish(subject, data, headers)
        except Exception as exc:  # noqa: BLE001 - the connection is closed or reconnecting: stored again later
            self._not_taken(key, exc)
            return
        ack.add_done_callback(lambda f: self._acked(key, f))  # a callback, not a task per step

    def _acked(self, key: Key, ack: asyncio.Future[Any]) -> None:
        exc = asyncio.CancelledError() if ack.cancelled() else ack.exception()
        if exc is None:
            self._logged(key)
        else:
            self._not_taken(key, exc)

    def _logged(self, key: Key) -> None:
        self.unlogged.pop(key, None)
        w = self.waiters.pop(key, None)
        if w is not None and not w.done():
            w.set_result(None)

    def _not_taken(self, key: Key, exc: BaseException) -> None:
        if key not in self.unlogged or self.nc.is_closed:
            return
        log.warning("trajectory step not logged yet: stored again", sandbox_id=key[0], client_id=key[1], step=key[2], err=str(exc) or type(exc).__name__)
        self.again[key] = None
        if self._retrier is None or self._retrier.done():
            self._retrier = asyncio.ensure_future(self._store_again())

    async def _store_again(self) -> None:
        """Store the steps the stream did not take, acked, until it takes them (one task per host)."""
        attempt = 0
        while self.again and not self.nc.is_closed:
            await asyncio.sleep(min(2.0, 0.05 * 2**attempt) * random.uniform(0.5, 1.0))
            keys = [k for k in self.again if k in self.unlogged]
            self.again.clear()
            outs = await asyncio.gather(*(self._store(k) for k in keys), return_exceptions=True)
            for k, o in zip(keys, outs, strict=True):
                if isinstance(o, BaseException):
                    self.again[k] = None
                else:
                    self._logged(k)
            attempt = attempt + 1 if self.again else 0

    async def _store(self, key: Key) -> None:
        subject, data, headers = self.unlogged[key]
        try:
            await asyncio.wait_for(await (await publisher_for(self.nc)).publish(subject, data, headers), LOG_TIMEOUT_S)
        except (StoreError, asyncio.TimeoutError) as exc:
            log.warning("trajectory step still not logged", sandbox_id=key[0], client_id=key[1], step=key[2], err=str(exc))
            raise

    async def stop(self, grace_s: float = 2.0) -> None:
        """Wait a little for the acks still out; what the stream has not taken by then is a gap in
        the log (said here: its client's replay finds it, sdk/_trajectory)."""
        if self.unlogged and not self.nc.is_closed:
            loop = asyncio.get_running_loop()
            acks = [self.waiters.setdefault(k, loop.create_future()) for k in self.unlogged]
            await asyncio.wait(acks, timeout=grace_s)
        if self._retrier is not None:
            self._retrier.cancel()
        if self.unlogged:
            log.error("trajectory steps not logged at shutdown", steps=[f"{s}:{c}:{n}" for s, c, n in list(self.unlogged)[:20]], count=len(self.unlogged))


def _unwrap(outcome: Outcome) -> Any:
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


__all__ = ["Trajectory", "RECENT"]
