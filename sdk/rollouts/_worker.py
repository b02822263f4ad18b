"""The rollout worker: takes jobs from a queue of DSEC_ROLLOUTS (one durable consumer, any number
of workers) and runs each agent loop in a sandbox of its own, built on the client (AsyncSandbox).

The job's state (KV ``dsec_rollouts``) is stored when the policy answered, before its tool calls
run, and after each of them; each tool call is a step of the sandbox's trajectory log under the
job id as client. A worker that dies mid-rollout leaves its job un-acked; JetStream hands it to
another, which reconnects to the sandbox at the stored step count with ``replay``: a step that ran
after the last stored state is answered from the log (or, still running, awaited by its host), so
no step runs twice. The message is acked once the job is done or failed, its error recorded.

A job is its tenant's (bus.subjects.rollout_job): nats-server lets a client submit and read only under
its own tenant token, and a worker binds each job to the tenant of its subject, refusing (to the dead
letters, ``permission_denied``) one whose body names another tenant; its state is kept under
``<tenant>.<job>`` and the model gateway answers a tenant about its own jobs only. Its sandbox is the
tenant's too (created with the tenant as ``client``: placement binds it so, with the workers as its
``delegate``, bus.auth.bind_tenant): charged to the tenant's quota, from templates the tenant may use,
its events and trajectory log under the tenant (the trainer reads its steps), and reached by no
other tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import socket
import time
import uuid
from typing import Any

import aiohttp
from nats.aio.msg import Msg

from bus import codec
from bus import subjects as S
from bus.errors import (
    BadRequest, DsecError, InternalError, PermissionDenied, PolicyTimeout, SandboxNotFound, SandboxNotRunning, SandboxTimeout, Unavailable, UnknownJob,
)
from bus.messages import SANDBOX_ENDED, ModelAnswer, ModelCall, RolloutJob, RolloutRecord, TrajStep
from bus.runtime import KV, Endpoint, Service, dead_letter
from bus.streams import ensure_kv, ensure_stream, stream_configs

from .. import _snapshots as _snap
from .._async import AsyncSandbox
from .._trajectory import TrajClient
from ..errors import CommandExitError, CommandTimeoutError
from . import _policy
from ._policy import Stopping

_JOB = codec.Decoder(RolloutJob)
OUTPUT_KEEP = 16 << 10  # characters of a tool's output the conversation keeps (head and tail)
_SANDBOX_GONE = (SandboxNotFound, SandboxNotRunning, SandboxTimeout)
SANDBOX_GRACE_S = 20.0  # a sandbox that does not answer is asked this long before its job fails
RETRY_DELAY_S = 1.0  # a job whose sandbox was unreachable for a moment is taken up again after this
MAX_DELIVERIES = 50  # ... but not forever: a sandbox that answers info and fails every step fails its job


class _Unreachable(Exception):
    """The job's sandbox did not answer for a moment but is there: the job is taken up again."""


def _cut(text: str) -> str:
    if len(text) <= OUTPUT_KEEP:
        return text
    half = OUTPUT_KEEP // 2
    return f"{text[:half]}\n[... {len(text) - OUTPUT_KEEP} characters cut ...]\n{text[-half:]}"


def model_client(job_id: str) -> str:
    """The trajectory log's client id of a job's policy turns."""
    return f"{job_id}-model"


def gateway_client(job_id: str) -> str:
    """The trajectory log's client id of the turns the model gateway forwarded for a job."""
    return f"{job_id}-gw"


def sandbox_id_of(job_id: str, tenant: str) -> str:
    """The job's sandbox: two tenants may choose the same job id."""
    return f"ro-{hashlib.sha256(tenant.encode()).hexdigest()[:10]}-{job_id}"


class RolloutWorker(Service):
    name = "rollouts"

    def __init__(
        self, nats_url: str | None = None, *, queue: str = S.ROLLOUT_QUEUE, capacity: int = 16, ack_wait_s: float = 30.0,
        worker_id: str | None = None, grace_s: float = 10.0,
    ) -> None:
        super().__init__(nats_url, grace_s=grace_s)
        self.queue = queue
        self.capacity = capacity
        self.ack_wait_s = ack_wait_s
        self.worker_id = worker_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.kv: KV[RolloutRecord] | None = None
        self.session: aiohttp.ClientSession | None = None
        self.model_ep: Endpoint | None = None

    async def setup(self) -> None:
        assert self.js is not None and self.nc is not None
        for cfg in stream_configs():
            if cfg.name == S.STREAM_ROLLOUTS:
                await ensure_stream(self.js, cfg)
        await ensure_kv(self.js, S.KV_ROLLOUTS)
        self.kv = await KV.bind(self.js, S.KV_ROLLOUTS, RolloutRecord)
        self.session = aiohttp.ClientSession()
        self.model_ep = Endpoint(self.nc, "model", self._on_model, decoder=codec.Decoder(ModelCall))
        await self.model_ep.serve(S.MODEL_WILDCARD, queue=S.ROLLOUT_WORKERS)
        await self.add_worker(
            stream=S.STREAM_ROLLOUTS, durable=S.rollout_durable(self.queue), filter_subject=S.rollout_queue(self.queue) + ".>",
            capacity=self.capacity, handler=self._on_job, ack_wait_s=self.ack_wait_s,
        )

    async def teardown(self) -> None:
        if self.model_ep is not None:
            await self.model_ep.stop()
        if self.session is not None:
            await self.session.close()

    # --- one job ------------------------------------------------------------------------------
    async def _on_job(self, msg: Msg) -> None:
        assert self.publisher is not None
        try:
            job = _JOB.decode(msg.data)
        except Exception as exc:  # noqa: BLE001 - malformed work is kept aside, not retried forever
            await dead_letter(self.publisher, msg, "bad_request", f"not a rollout job: {exc}")
            return
        if len(job.job_id) > 100 or not S.valid_token(job.job_id):  # it names a KV key, a sandbox and log clients
            await dead_letter(self.publisher, msg, "invalid_argument", f"not a job id: {job.job_id[:200]!r}")
            return
        where = S.parse_rollout(msg.subject)
        if where is None or where[2] != job.job_id:
            await dead_letter(self.publisher, msg, "invalid_argument", f"not a job's subject (dsec.rollout.<queue>.<tenant>.<job>): {msg.subject[:200]}")
            return
        # The subject's tenant is the one nats-server let publish it: a body naming another is forged.
        if job.tenant and job.tenant != where[1]:
            self.log.warning("rollout_tenant_mismatch", job_id=job.job_id, subject_tenant=where[1], job_tenant=job.tenant)
            await dead_letter(self.publisher, msg, PermissionDenied.code, f"job {job.job_id} names tenant {job.tenant!r}, submitted as {where[1]!r}")
            return
        job.tenant = where[1]
        beat = asyncio.ensure_future(self._heartbeat(msg))
        try:
            await self._run(job)
        except Stopping:
            return  # left un-acked: another worker takes it up
        except _Unreachable:
            await msg.nak(delay=RETRY_DELAY_S)  # taken up again from its stored state: a step that ran is answered from the log
            return
        finally:
            beat.cancel()
        await msg.ack()

    async def _heartbeat(self, msg: Msg) -> None:
        """Keep a long rollout's message ours (JetStream redelivers one silent for ack_wait)."""
        while not await self.pause(self.ack_wait_s / 3):
            with contextlib.suppress(Exception):
                await msg.in_progress()

    async def _put(self, rec: RolloutRecord) -> None:
        assert self.kv is not None
        rec.updated_at = time.time()
        await self.kv.put(S.rollout_key(rec.job.tenant, rec.job.job_id), rec)

    async def _run(self, job: RolloutJob) -> None:
        assert self.kv is not None
        rec = await self.kv.get(S.rollout_key(job.tenant, job.job_id)) or RolloutRecord(job=job)
        if rec.state in ("done", "failed") or rec.job.tenant != job.tenant:
            return  # (a record under the tenant's key is the tenant's: the second is a bug, never another's job run)
        rec.deliveries += 1
        rec.worker = self.worker_id
        sb: AsyncSandbox | None = None
        try:
            sb = await self._sandbox(rec)
            await self._loop(rec, sb)
        except Stopping:
            raise
        except _SANDBOX_GONE as exc:
            if rec.sandbox_id and rec.deliveries < MAX_DELIVERIES and await self._still_there(rec.sandbox_id):
                raise _Unreachable() from None
            rec.state, rec.error_code, rec.error = "failed", exc.code, exc.description
        except DsecError as exc:
            rec.state, rec.error_code, rec.error = "failed", exc.code, exc.description
        except Exception as exc:  # noqa: BLE001 - recorded in the job: a worker never gets stuck on one
            err = InternalError(f"{type(exc).__name__}: {exc}")
            rec.state, rec.error_code, rec.error = "failed", err.code, err.description
        rec.finished_at = time.time()
        await self._put(rec)
        if sb is not None:
            with contextlib.suppress(Exception):
                await sb.kill()

    async def _still_there(self, sandbox_id: str) -> bool:
        """Whether a sandbox that did not answer is there after all: its record says it ended (when
        this worker may read records), else it is asked for up to ``SANDBOX_GRACE_S``. A control
        plane coming back (nats-server restarted: its host agent not subscribed again yet) answers
        "no responders" for a moment, which the SDK reports as not found."""
        assert self.nc is not None
        with contextlib.suppress(Exception):  # no record to read (a client tenant) or NATS away: asked below
            rec = await _snap.sandbox_record(self.nc, sandbox_id)
            if rec is None or rec.state in SANDBOX_ENDED:
                return False
        deadline = time.monotonic() + SANDBOX_GRACE_S
        delay = 0.25
        while True:
            try:
                await AsyncSandbox(sandbox_id, self.nc).get_info()
                return True
            except DsecError:
                pass  # not answering (yet): asked again until the grace is over
            if time.monotonic() >= deadline:
                return False
            if await self.pause(delay):
                raise Stopping()
            delay = min(delay * 2, 2.0)

    async def _sandbox(self, rec: RolloutRecord) -> AsyncSandbox:
        job = rec.job
        if not rec.sandbox_id:
            rec.sandbox_id = sandbox_id_of(job.job_id, job.tenant)
            rec.state = "running"
            if not rec.messages:
                rec.messages = ([{"role": "system", "content": job.system_prompt}] if job.system_prompt else []) + [{"role": "user", "content": job.task}]
            await self._put(rec)
            return await self._create(rec)
        try:
            sb = await AsyncSandbox.connect(rec.sandbox_id, nats_url=self.nats_url, replay=True, client_id=job.job_id, owner=job.tenant)
        except SandboxNotFound:
            if rec.turns == 0 and rec.sandbox_steps == 0:
                return await self._create(rec)  # the worker before died before its sandbox was up
            raise SandboxNotFound(f"the rollout's sandbox {rec.sandbox_id} ended mid-rollout (after {rec.turns} policy turns)") from None
        sb._traj.next = rec.sandbox_steps  # steps past it are answered from the log
        return sb

    async def _create(self, rec: RolloutRecord) -> AsyncSandbox:
        job = rec.job
        size: dict[str, Any] = {"memory_mb": job.memory_mb} if job.memory_mb > 0 else {}
        if job.cpu > 0:
            size["cpu"] = job.cpu
        sb = await AsyncSandbox.create(
            job.template, sandbox_id=rec.sandbox_id, pool=job.pool, timeout=job.sandbox_timeout_s,
            metadata={**job.metadata, "rollout": job.job_id}, nats_url=self.nats_url, client=job.tenant, **size,
        )
        sb._traj = TrajClient(job.job_id)
        return sb

    async def _loop(self, rec: RolloutRecord, sb: AsyncSandbox) -> None:
        job = rec.job
        assert self.session is not None
        if rec.state == "queued":
            rec.state = "running"
        while True:
            pending = _pending_calls(rec.messages)
            if pending:
                for call in pending:
                    content = await self._tool(sb, call)
                    rec.messages.append({"role": "tool", "tool_call_id": call["id"], "content": content})
                    rec.sandbox_steps = sb._traj.next
                    await self._put(rec)
                continue
            if rec.messages[-1]["role"] == "assistant":
                rec.state, rec.finish_reason = "done", "stop"
                return
            if rec.turns >= job.max_steps:
                rec.state, rec.finish_reason = "done", "max_steps"
                return

            async def waiting(why: str) -> None:
                if job.pause_while_waiting and rec.state != "waiting_policy":
                    await sb.pause()
                rec.state, rec.error = "waiting_policy", why
                rec.policy_retries += 1
                await self._put(rec)

            done = await _policy.ask(
                self.session, policy_url=job.policy_url, model=job.model, messages=rec.messages, tools=job.tools,
                timeout_s=job.policy_timeout_s, wait_s=job.policy_wait_s, on_wait=waiting, pause=self._pause_or_stop,
            )
            if rec.state == "waiting_policy" and job.pause_while_waiting:
                await sb.resume()
            rec.state, rec.error = "running", ""
            rec.messages.append(done.message)
            rec.turns += 1
            await self._put(rec)
            await self._log_model_turn(rec, done)

    async def _log_model_turn(self, rec: RolloutRecord, c: _policy.Completion) -> None:
        """The policy's turn in the sandbox's trajectory log, beside its steps (client ``<job>-model``,
        step = the turn). Stored after the job's state: a turn asked again after a crash is the one
        logged; a repeated store of it is dropped by its message id."""
        await self._log_turn(rec, model_client(rec.job.job_id), rec.turns - 1, c)

    async def _log_turn(self, rec: RolloutRecord, client: str, turn: int, c: _policy.Completion) -> None:
        """A policy's turn in the sandbox's trajectory log; ``turn`` -1: numbered by its place in the
        log (de-duplicated by its digest)."""
        assert self.publisher is not None
        digest = hashlib.sha256(json.dumps(c.request, sort_keys=True).encode()).hexdigest()
        step = TrajStep(
            sandbox_id=rec.sandbox_id, client_id=client, step=turn, op="model", kind="ChatCompletion", digest=digest,
            request=json.dumps(c.request).encode(), result=c.response.encode(), started_at=c.started_at, duration_ms=c.duration_ms,
            policy_version=c.policy_version,
        )
        msg_id = S.traj_msg_id(rec.sandbox_id, client, turn) if turn >= 0 else f"{rec.sandbox_id}:{client}:{digest[:32]}"
        # the job's sandbox is its tenant's (bus.auth.bind_tenant): its log is under that tenant
        await self.publisher.store(S.traj(rec.sandbox_id, rec.job.tenant), codec.encode(step), {S.HDR_MSG_ID: msg_id})

    # --- the model gateway -------------------------------------------------------------------------
    async def _on_model(self, msg: Msg, call: ModelCall) -> ModelAnswer:
        """Forward a chat-completions request to the job's policy and log the exchange in its
        sandbox's trajectory (client ``<job>-gw``, in the log's order; a retried identical request,
        same conversation, is stored once). Only the job's tenant (the subject's) is answered:
        another's job is ``unknown_job``, as one that does not exist."""
        assert self.kv is not None and self.session is not None and self.publisher is not None
        where = S.parse_model(msg.subject)
        mine = where is not None and where[1] == call.job_id and S.valid_token(call.job_id)
        rec = await self.kv.get(S.rollout_key(where[0], call.job_id)) if where is not None and mine else None
        if rec is None or where is None or rec.job.tenant != where[0]:
            raise UnknownJob(f"no rollout job {call.job_id}", job_id=call.job_id)
        if not rec.sandbox_id or rec.state in ("done", "failed", "queued"):
            raise SandboxNotRunning(f"rollout {call.job_id} is {rec.state}: its model gateway serves it while it runs", state=rec.state)
        try:
            request = json.loads(call.body)
        except ValueError:
            raise BadRequest("the request body is not JSON") from None
        started, t0 = time.time(), time.perf_counter()
        try:
            async with self.session.post(
                _policy.chat_url(rec.job.policy_url), data=call.body, headers={"Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=rec.job.policy_timeout_s),
            ) as r:
                text = await r.text()
                version = next((r.headers[h] for h in _policy.POLICY_VERSION_HEADERS if h in r.headers), "")
                status = r.status
        except asyncio.TimeoutError:
            raise PolicyTimeout(f"the policy did not answer within {rec.job.policy_timeout_s:g}s") from None
        except aiohttp.ClientError as exc:
            raise Unavailable(f"the policy is unreachable: {type(exc).__name__}: {exc}") from None
        c = _policy.Completion({}, request, text, version, started, (time.perf_counter() - t0) * 1000)
        await self._log_turn(rec, gateway_client(call.job_id), -1, c)
        return ModelAnswer(status=status, body=text.encode(), policy_version=version)

    async def _pause_or_stop(self, seconds: float) -> bool:
        return await self.pause(seconds)

    async def _tool(self, sb: AsyncSandbox, call: dict[str, Any]) -> str:
        """What the policy sees of one tool call; a failed call is an observation, a gone sandbox fails the job."""
        name = call["function"]["name"]
        args = json.loads(call["function"]["arguments"])
        try:
            if name == "exec":
                try:
                    r = await sb.commands.run(args["cmd"], timeout=float(args.get("timeout", 60)))
                except (CommandExitError, CommandTimeoutError) as exc:
                    r = exc.result
                return json.dumps({"exit_code": r.exit_code, "stdout": _cut(r.stdout), "stderr": _cut(r.stderr)})
            if name == "read_file":
                return _cut(await sb.files.read(args["path"]))
            await sb.files.write(args["path"], args["content"])
            return "ok"
        except _SANDBOX_GONE:
            raise
        except DsecError as exc:
            return f"error: {exc}"


def _pending_calls(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls of the last assistant message that have no answer yet (answers follow in order)."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i]["role"] == "assistant":
            calls: list[dict[str, Any]] = messages[i].get("tool_calls") or []
            return calls[len(messages) - 1 - i:]
    return []


__all__ = ["RolloutWorker", "sandbox_id_of", "model_client", "gateway_client"]
