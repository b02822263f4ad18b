"""The host's side of the trajectory log: every numbered operation (a request with ``step >= 0``,
bus.trajectory) is appended to ``dsec.traj.<tenant>.<sandbox>`` (DSEC_TRAJ; the
sandbox owner's tenant, so that only its owner and the operator read it) before its reply is sent.

A step this host already answered (a client that lost the reply, or a client taking over from one
that died while its step ran) is answered with the same outcome, awaited if it still runs, and never
run twice; the same step number with a different request is a ``trajectory_conflict``. This memory is
the recent steps only (``RECENT``): a client replaying older ones reads the log itself (sdk/_trajectory).

The step goes to the log before the reply, on the same connection (so the server has it before the
client can have the reply), but the reply does not wait for the stream's acknowledgement: that
round trip would be most of what logging costs an exec. The acknowledgement is checked when it
comes; a step the stream did not store (it was away, or the connection dropped) is stored again
with back-off until it is, and meanwhile a client asking that step again is answered from memory.
"""

from __future__ import annotations

import asyncio
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
from bus.trajectory import digest, is_logged, make_step

log = structlog.get_logger("dsec.hostagent.trajectory")

RECENT = 1024  # steps remembered (per host) for answering a repeated one without running it again
RECENT_BYTES = 64 << 20  # ... and at most this much command output among them
STORE_RETRY_START_S = 0.25
STORE_RETRY_CAP_S = 5.0

Outcome = tuple[Any, DsecError | None]


class Trajectory:
    def __init__(self, nc: NATS, host_id: str) -> None:
        self.nc = nc
        self.host_id = host_id
        self.recent: OrderedDict[tuple[str, str, int], tuple[str, asyncio.Future[Outcome]]] = OrderedDict()
        self.sizes: dict[tuple[str, str, int], int] = {}
        self.held = 0  # bytes of output the remembered outcomes hold
        self.unconfirmed = 0  # steps answered whose store failed and is being retried
        self._retries: set[asyncio.Task[None]] = set()

    async def run(self, sid: str, op: str, req: Any, fn: Callable[[], Awaitable[Any]], tenant: str = S.OPERATOR_TENANT) -> Any:
        """``fn()``'s result for ``req``, logged first (under ``tenant``, the sandbox owner's) when
        ``req`` is a numbered step."""
        if getattr(req, "step", -1) < 0 or not is_logged(req):
            return await fn()
        if not S.valid_token(req.client_id):
            raise BadRequest(f"a numbered step needs a client id (letters, digits, - and _), got {req.client_id!r}")
        key, d = (sid, req.client_id, req.step), digest(req)
        seen = self.recent.get(key)
        if seen is not None:
            if seen[0] != d:
                raise TrajectoryConflict(f"step {req.step} of {req.client_id} was a different request", step=req.step, client_id=req.client_id)
            return _unwrap(await asyncio.shield(seen[1]))
        fut: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self.recent[key] = (d, fut)
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
        step = make_step(sid, op, req, result, started_at=started, duration_ms=(time.perf_counter() - t0) * 1000, host_id=self.host_id, req_digest=d)
        await self._append(step.sandbox_id, tenant, step.client_id, step.step, codec.encode(step))
        return _unwrap(outcome)

    def _remember(self, key: tuple[str, str, int], result: Any) -> None:
        size = len(result.stdout) + len(result.stderr) if isinstance(result, ExecResult) else 0
        self.sizes[key] = size
        self.held += size
        for old in list(self.recent):  # oldest first; a step still running is kept
            if len(self.recent) <= RECENT and self.held <= RECENT_BYTES:
                break
            if self.recent[old][1].done():
                del self.recent[old]
                self.held -= self.sizes.pop(old, 0)

    async def _append(self, sid: str, tenant: str, client_id: str, step: int, data: bytes) -> None:
        """Send the step to the log; its store is confirmed off the reply's path (see the module note)."""
        subject, headers = S.traj(sid, tenant), {S.HDR_MSG_ID: S.traj_msg_id(sid, client_id, step)}
        try:
            fut = await (await publisher_for(self.nc)).publish(subject, data, headers)
        except Exception as exc:  # noqa: BLE001 - not even sent (the connection is closed): the caller hears it
            log.warning("trajectory step not logged", sandbox_id=sid, client_id=client_id, step=step, err=str(exc))
            raise Unavailable(f"step {step} ran but could not be logged ({exc}); the trajectory log is unavailable", step=step) from None
        fut.add_done_callback(lambda f: self._confirmed(f, subject, data, headers))

    def _confirmed(self, fut: asyncio.Future[Any], subject: str, data: bytes, headers: dict[str, str]) -> None:
        if fut.cancelled() or fut.exception() is None:
            return
        log.warning("trajectory step not stored yet, storing it again", subject=subject, msg_id=headers[S.HDR_MSG_ID], err=str(fut.exception()))
        self.unconfirmed += 1
        task = asyncio.ensure_future(self._store_again(subject, data, headers))
        self._retries.add(task)
        task.add_done_callback(self._retries.discard)

    async def _store_again(self, subject: str, data: bytes, headers: dict[str, str]) -> None:
        """Until the log holds the step (its message id makes a copy already stored harmless)."""
        delay = STORE_RETRY_START_S
        while not self.nc.is_closed:
            try:
                await (await publisher_for(self.nc)).store(subject, data, headers)
                self.unconfirmed -= 1
                return
            except (StoreError, asyncio.TimeoutError) as exc:
                log.warning("trajectory step still not stored", subject=subject, msg_id=headers[S.HDR_MSG_ID], err=str(exc))
            await asyncio.sleep(delay)  # back-off while the log's stream is away
            delay = min(delay * 2, STORE_RETRY_CAP_S)
        log.error("trajectory step lost: the connection closed before it was stored", subject=subject, msg_id=headers[S.HDR_MSG_ID])


def _unwrap(outcome: Outcome) -> Any:
    if outcome[1] is not None:
        raise outcome[1]
    return outcome[0]


__all__ = ["Trajectory", "RECENT"]
