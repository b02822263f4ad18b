"""The client's side of the trajectory log (DSEC_TRAJ): numbering steps, reading the log, fast-forward.

Each sandbox object is one client: its changing requests (bus.trajectory.LOGGED) carry its id and
the next step number, and the host logs each before answering. ``AsyncSandbox.connect(id,
replay=True)`` starts a client at step 0 under the id of the log's last client (or ``client_id=``):
a step the log holds is answered from it, without running again, when the request is the same
(its digest), and is a ``trajectory_conflict`` otherwise; past the log, steps run live.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import DsecError, ErrorReply, InvalidArgument, TrajectoryConflict, TrajectoryGap, TrajectoryTrimmed, from_reply
from bus.messages import ExecResult, TrajStep
from bus.runtime import KV, connection_of, reads_records, tenant_of
from bus.trajectory import STEP_DECODER, decode_request, digest, is_logged

from ._admin import _tenant_consumer

READ_IDLE_S = 5.0  # a log read that hears nothing this long (the server went away) stops
SETTLE_S = 10.0  # how long a reader waits for a step answered a moment ago to be in the log
SETTLE_POLL_S = 0.01
_ANY_REPLY = msgspec.msgpack.Decoder(Any)


@dataclass
class TrajectoryStep:
    """One logged operation: the request as sent (without inboxes), its outcome, and where and when."""

    step: int
    client_id: str
    op: str
    kind: str
    digest: str
    request: Any
    result: Any  # the reply (ExecResult, FileWritten, ...); None for an error
    error_code: str = ""
    error: str = ""
    digests: dict[str, str] = field(default_factory=dict)  # sha256 of outputs the log keeps only the head of
    started_at: float = 0.0
    duration_ms: float = 0.0
    host_id: str = ""
    seq: int = 0  # the stream sequence (global order of the sandbox's log)
    sandbox_id: str = ""  # where it was logged: a fork's parent for the steps it inherited
    policy_version: str = ""  # a policy's turn (op "model"): the version its endpoint reported

    def to_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k not in ("request", "result")}
        out["request"] = _plain(self.request)
        out["result"] = _plain(self.result)
        return out


def _plain(v: Any) -> Any:
    if v is None:
        return None
    d = msgspec.to_builtins(v, builtin_types=(bytes,), enc_hook=repr)
    if isinstance(d, dict):
        d = {k: (x if not isinstance(x, (bytes, bytearray)) else bytes(x).decode("utf-8", "replace")) for k, x in d.items()}
        d.setdefault("type", type(v).__name__)
    return d


def log_subject(nc: Any, sandbox_id: str, owner: str | None = None) -> str:
    """Where ``nc`` reads a sandbox's log: a client tenant under its own tenant (the only logs its
    credential may read: bus.auth), or ``owner``'s (the rollout workers, of their jobs' sandboxes);
    the operator and services whoever owns it."""
    if reads_records(nc):
        return S.traj_any(sandbox_id)
    return S.traj(sandbox_id, owner or tenant_of(nc))


async def read_log(js: Any, sandbox_id: str, owner: str | None = None) -> list[tuple[int, TrajStep]]:
    """Every step logged for ``sandbox_id``, in the log's order, with its stream sequence."""
    subject = log_subject(connection_of(js), sandbox_id, owner)
    try:  # direct gets and a consumer named with its filter: the server checks both subjects against the tenant's prefix
        last = await js.get_last_msg(S.STREAM_TRAJ, subject, direct=True)
    except NotFoundError:
        return []
    queue: asyncio.Queue[Any] = asyncio.Queue()
    sub = await _tenant_consumer(connection_of(js), subject, ConsumerConfig(deliver_policy=DeliverPolicy.ALL), queue, stream=S.STREAM_TRAJ)
    if sub is None:
        return []
    out: list[tuple[int, TrajStep]] = []
    try:
        while True:
            msg = await asyncio.wait_for(queue.get(), READ_IDLE_S)
            seq = msg.metadata.sequence.stream
            try:
                out.append((seq, STEP_DECODER.decode(msg.data)))
            except msgspec.DecodeError:
                pass  # not a step (nothing else publishes there); skipped
            if seq >= last.seq or msg.metadata.num_pending == 0:
                return out
    finally:
        await sub.unsubscribe()


def view(seq: int, s: TrajStep) -> TrajectoryStep:
    if s.op == "model":  # a policy's turn: its request and response bodies (JSON)
        request, result = _json(s.request), _json(s.result)
    else:
        try:
            request = decode_request(s)
        except msgspec.DecodeError:
            request = None
        result = None if s.error_code or not s.result else _decode_result(s.op, s.result)
    return TrajectoryStep(
        step=s.step, client_id=s.client_id, op=s.op, kind=s.kind, digest=s.digest, request=request, result=result, error_code=s.error_code,
        error=s.error, digests=dict(s.digests), started_at=s.started_at, duration_ms=s.duration_ms, host_id=s.host_id, seq=seq,
        sandbox_id=s.sandbox_id, policy_version=s.policy_version,
    )


def _json(data: bytes) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        return data.decode("utf-8", "replace")


def _decode_result(op: str, data: bytes) -> Any:
    try:
        return codec.decode_reply(data, codec.REPLY_TYPES[op])
    except Exception:  # noqa: BLE001 - a reply type this client does not know: shown as plain data
        return _ANY_REPLY.decode(data)


_ID_PREFIX = uuid.uuid4().hex[:12]
_ID_SEQ = itertools.count()


def _new_process_ids() -> None:
    global _ID_PREFIX, _ID_SEQ
    _ID_PREFIX, _ID_SEQ = uuid.uuid4().hex[:12], itertools.count()


os.register_at_fork(after_in_child=_new_process_ids)  # a forked client must not reuse its parent's ids


def new_client_id() -> str:
    """A client id unique across processes: a random prefix per process and a counter. A uuid4 per
    sandbox object cost a fifth of a batch-creating client's CPU (os.urandom per id)."""
    return f"c-{_ID_PREFIX}{next(_ID_SEQ):x}"


class TrajClient:
    """A sandbox object's step counter and, when replaying, the steps still to be answered from the log."""

    def __init__(self, client_id: str | None = None) -> None:
        self.client_id = client_id or new_client_id()
        self.next = 0
        self.answered = -1  # the last step its host answered (and logs: the ack may come just after the reply)
        self.logged: dict[int, TrajStep] = {}
        self.replayed = 0  # steps answered from the log

    def start_replay(self, log: list[tuple[int, TrajStep]], client_id: str | None) -> None:
        if client_id is None and log:
            client_id = log[-1][1].client_id
        if client_id is not None:
            if not S.valid_token(client_id):
                raise InvalidArgument(f"client_id must be letters, digits, - and _, got {client_id!r}")
            self.client_id = client_id
        self.next = 0
        self.logged = {s.step: s for _, s in log if s.client_id == self.client_id}
        if self.logged and min(self.logged) > 0:
            raise TrajectoryTrimmed(
                f"the log of client {self.client_id} starts at step {min(self.logged)}: earlier steps were trimmed", step=min(self.logged),
            )
        missing = next((n for n in range(len(self.logged)) if n not in self.logged), None)
        if missing is not None:  # answered by its host, never taken by the stream (hostagent/_trajectory): it would run again
            raise TrajectoryGap(
                f"the log of client {self.client_id} lacks step {missing} (it has steps up to {max(self.logged)})", step=missing, client_id=self.client_id,
            )

    def stamp(self, req: Any) -> TrajStep | None:
        """Number ``req``; the logged step when the log answers it."""
        if not is_logged(req):
            return None
        req.step, req.client_id = self.next, self.client_id
        self.next += 1
        hit = self.logged.pop(req.step, None)
        if hit is None:
            return None
        if hit.digest != digest(req):
            self.next -= 1
            self.logged[req.step] = hit
            raise TrajectoryConflict(
                f"step {req.step} was logged as a different {hit.kind} request than this {type(req).__name__}", step=req.step, client_id=self.client_id,
            )
        self.replayed += 1
        return hit


NOT_LOGGED = frozenset({"trajectory_conflict", "permission_denied", "bad_request"})  # refusals of a step before it ran


def note_reply(traj: TrajClient, req: Any, exc: DsecError | None = None) -> None:
    """The host answered ``req`` (with ``exc``): a step it logs, unless refused before it ran. A step
    its host did not run because its previous one is not in the log yet gives its number back."""
    step = getattr(req, "step", -1)
    if getattr(req, "client_id", "") != traj.client_id:
        return
    if exc is not None and exc.context.get("logged") is False:
        if step == traj.next - 1:
            traj.next = step
        return
    if step > traj.answered and (exc is None or exc.code not in NOT_LOGGED):
        traj.answered = step


def replayed(hit: TrajStep, result_type: Any) -> Any:
    """The logged outcome of a step, as its reply would have been (an error raised again)."""
    if hit.error_code:
        raise from_reply(msgspec.msgpack.decode(hit.result, type=ErrorReply) if hit.result else ErrorReply(code=hit.error_code, description=hit.error))
    res = codec.decode_reply(hit.result, result_type)
    if isinstance(res, ExecResult):
        res.chunks = 0  # nothing is streamed again: the output is in the result
    return res


MAX_FORK_DEPTH = 32


async def steps(js: Any, sandbox_id: str, *, inherit: bool = True, until: tuple[str, int] | None = None, _depth: int = 0) -> list[TrajectoryStep]:
    """The sandbox's steps; a fork's (a sandbox started from another's snapshot) begin with its
    parent's up to the fork point: the snapshot step that made it (else: the parent's steps until
    the snapshot was taken). ``until`` (client, step): read again until the log holds that step (a
    host stores a step right after its reply: hostagent/_trajectory), for ``SETTLE_S`` at most."""
    log = await read_log(js, sandbox_id)
    deadline = time.monotonic() + SETTLE_S
    while until is not None and until[1] >= 0 and not any(s.client_id == until[0] and s.step >= until[1] for _, s in log):
        if time.monotonic() > deadline:
            break  # the host could not log it (it says so to the client's next step): the log as it is
        await asyncio.sleep(SETTLE_POLL_S)
        log = await read_log(js, sandbox_id)
    own = [view(seq, s) for seq, s in log]
    fork = await _fork_point(js, sandbox_id) if inherit and _depth < MAX_FORK_DEPTH else None
    if fork is None:
        return own
    parent_id, snapshot_id, taken_at = fork
    parent = await steps(js, parent_id, _depth=_depth + 1)
    cut = next((i for i, p in enumerate(parent) if p.kind == "SnapshotRequest" and getattr(p.result, "snapshot_id", None) == snapshot_id), None)
    return (parent[:cut + 1] if cut is not None else [p for p in parent if p.started_at <= taken_at]) + own


async def _fork_point(js: Any, sandbox_id: str) -> tuple[str, str, float] | None:
    """(parent sandbox, snapshot, when it was taken) of a sandbox started from another's snapshot;
    None for a client tenant, which may not read the records that say it (sandbox and snapshot
    records hold other tenants' envs: bus.auth)."""
    if not reads_records(connection_of(js)):
        return None
    try:
        rec = await (await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)).get(sandbox_id)
        if rec is None or not rec.spec.snapshot:
            return None
        snap = await (await KV.bind(js, S.KV_SNAPSHOTS, codec.SNAPSHOT)).get(rec.spec.snapshot)
    except NotFoundError:  # a bucket not there (yet)
        return None
    if snap is None or snap.sandbox_id == sandbox_id:  # a persisted pause resumed: its own log goes on
        return None
    return snap.sandbox_id, snap.snapshot_id, snap.created_at




# --- replay in a fresh sandbox ------------------------------------------------------------------
@dataclass
class ReplayDiff:
    """One logged step run again: ``same``, ``differs`` (``detail`` says how) or ``skipped`` (why)."""

    index: int
    client_id: str
    step: int
    kind: str
    status: str
    detail: str = ""


def _compare(logged: TrajectoryStep, code: str, result: Any) -> str:
    """How a step's new outcome differs from the logged one ("" when it does not)."""
    if logged.error_code or code:
        return "" if logged.error_code == code else f"outcome {logged.error_code or 'ok'} then, {code or 'ok'} now"
    old = logged.result
    if not isinstance(old, ExecResult) or not isinstance(result, ExecResult):
        return ""  # a file op that succeeded both times: its times and inode numbers differ anyway
    diffs = []
    if old.exit_code != result.exit_code:
        diffs.append(f"exit code {old.exit_code} then, {result.exit_code} now")
    for name in ("stdout", "stderr"):
        was, now = getattr(old, name), getattr(result, name)
        full = logged.digests.get(name)
        same = hashlib.sha256(now).hexdigest() == full if full else was == now
        if not same:
            diffs.append(f"{name} {was[:60]!r} then, {now[:60]!r} now")
    return "; ".join(diffs)


async def replay_in_fresh(sandbox_id: str, *, nats_url: str | None = None, template: str | None = None, **create: Any) -> list[ReplayDiff]:
    """Run the sandbox's logged steps (a fork's inherited ones first) again, in order, in a new
    sandbox of its template, and say where the outcomes differ. A write whose data the log keeps
    only by digest, and snapshots, are skipped."""
    from ._async import AsyncSandbox, _js, _nc

    js = _js(await _nc(nats_url))
    logged = [s for s in await steps(js, sandbox_id) if s.op != "model"]
    if template is None:
        rec = await (await KV.bind(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)).get(sandbox_id)
        if rec is None:
            raise InvalidArgument(f"no record of sandbox {sandbox_id} says its template: name it (template=)")
        template = rec.spec.template
    out: list[ReplayDiff] = []
    async with await AsyncSandbox.create(template, nats_url=nats_url, **create) as fresh:
        for i, s in enumerate(logged):
            diff = ReplayDiff(index=i, client_id=s.client_id, step=s.step, kind=s.kind, status="skipped")
            out.append(diff)
            if s.request is None or s.kind == "SnapshotRequest" or "data" in s.digests:
                diff.detail = "a snapshot" if s.kind == "SnapshotRequest" else "the log keeps its request by digest only"
                continue
            code, result = "", None
            try:
                result = await fresh._request(s.op, s.request, codec.REPLY_TYPES[s.op], timeout=float(getattr(s.request, "timeout_s", 0) or 3600) + 10)
            except DsecError as exc:
                code = exc.code
            diff.detail = _compare(s, code, result)
            diff.status = "differs" if diff.detail else "same"
    return out


__all__ = ["ReplayDiff", "replay_in_fresh", "TrajectoryStep", "TrajClient", "read_log", "steps", "replayed", "view"]
