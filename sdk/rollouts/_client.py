"""The trainer's side: submit rollout jobs to a queue, collect finished trajectories whenever it comes back."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import InvalidArgument, UnknownJob
from bus.messages import ROLLOUT_TOOLS, RolloutJob, RolloutRecord
from bus.runtime import KV, tenant_of

from .._async import _js, _nc, _store
from .._trajectory import TrajectoryStep, steps as _steps
from ._worker import gateway_client, model_client

ENDED = ("done", "failed")


@dataclass
class RolloutResult:
    """A job as it stands: its conversation (OpenAI chat messages) and, when asked for, its sandbox steps."""

    job_id: str
    state: str
    finish_reason: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    sandbox_id: str = ""
    error_code: str = ""
    error: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    deliveries: int = 0
    policy_retries: int = 0
    worker: str = ""  # the worker that last took it up
    steps: list[TrajectoryStep] = field(default_factory=list)

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    @property
    def model_turns(self) -> list[dict[str, Any]]:
        """The policy's turns, training-ready: the messages it was sent, what it answered, and the token
        ids and logprobs when its backend returned them (vLLM/SGLang style), with its version."""
        out = []
        for s in self.steps:  # the worker's own turns and those the model gateway forwarded, in the log's order
            if s.op != "model":
                continue
            resp = s.result if isinstance(s.result, dict) else {}
            choices = resp.get("choices") or [{}]
            choice = choices[0] if isinstance(choices[0], dict) else {}
            out.append({
                "turn": s.step, "via_gateway": s.client_id.endswith("-gw"), "messages": (s.request or {}).get("messages", []), "message": choice.get("message"),
                "prompt_token_ids": resp.get("prompt_token_ids"), "token_ids": choice.get("token_ids"), "logprobs": choice.get("logprobs"),
                "policy_version": s.policy_version, "duration_ms": s.duration_ms,
            })
        return out


def _result(rec: RolloutRecord) -> RolloutResult:
    return RolloutResult(
        job_id=rec.job.job_id, state=rec.state, finish_reason=rec.finish_reason, messages=rec.messages, turns=rec.turns,
        sandbox_id=rec.sandbox_id, error_code=rec.error_code, error=rec.error, metadata=dict(rec.job.metadata),
        deliveries=rec.deliveries, policy_retries=rec.policy_retries, worker=rec.worker,
    )


def _check_job_id(job_id: Any) -> str:
    if not isinstance(job_id, str) or len(job_id) > 100 or not S.valid_token(job_id):
        raise InvalidArgument(f"not a job id: {job_id!r}")
    return job_id


class AsyncRollouts:
    """``await AsyncRollouts().submit(task=..., policy_url=...)`` -> job id; ``wait``, ``get``, ``results``.

    Jobs are the connection's tenant's; ``tenant`` (the operator's) reads and submits another
    tenant's (a client credential may not: nats-server refuses it)."""

    def __init__(self, *, nats_url: str | None = None, queue: str = S.ROLLOUT_QUEUE, tenant: str | None = None) -> None:
        if not S.valid_token(queue):
            raise InvalidArgument(f"not a queue name: {queue!r}")
        if tenant is not None and not S.valid_token(tenant):
            raise InvalidArgument(f"not a tenant: {tenant!r}")
        self.nats_url = nats_url
        self.queue = queue
        self.tenant = tenant

    async def submit(
        self, *, task: str, policy_url: str, template: str = "base", max_steps: int = 20, tools: list[str] | None = None,
        metadata: dict[str, str] | None = None, model: str = "", system_prompt: str = "", pool: str = "default",
        sandbox_timeout: float = 3600.0, policy_timeout: float = 60.0, policy_wait: float = 600.0, job_id: str | None = None,
        pause_while_waiting: bool = False, memory_mb: int | None = None, cpu: float | None = None,
    ) -> str:
        if not isinstance(task, str) or not task:
            raise InvalidArgument("task must be a non-empty string")
        if not isinstance(policy_url, str) or not policy_url.startswith(("http://", "https://")):
            raise InvalidArgument(f"policy_url must be an http(s) URL, got {policy_url!r}")
        if isinstance(max_steps, bool) or not isinstance(max_steps, int) or not 1 <= max_steps <= 10_000:
            raise InvalidArgument(f"max_steps must be an integer between 1 and 10000, got {max_steps!r}")
        tools = list(ROLLOUT_TOOLS) if tools is None else tools
        if not isinstance(tools, list) or not tools or any(t not in ROLLOUT_TOOLS for t in tools):
            raise InvalidArgument(f"tools must be a non-empty list of {', '.join(ROLLOUT_TOOLS)}, got {tools!r}")
        if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
            raise InvalidArgument("metadata must be a dict of str to str")
        for name, v in (("sandbox_timeout", sandbox_timeout), ("policy_timeout", policy_timeout), ("policy_wait", policy_wait)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 30 * 86400:
                raise InvalidArgument(f"{name} must be a positive number of seconds, got {v!r}")
        if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb <= 0):
            raise InvalidArgument(f"memory_mb must be a positive integer, got {memory_mb!r}")
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, (int, float)) or not cpu > 0):
            raise InvalidArgument(f"cpu must be a positive number, got {cpu!r}")
        job_id = _check_job_id(job_id) if job_id is not None else f"job-{uuid.uuid4().hex[:20]}"
        job = RolloutJob(
            job_id=job_id, task=task, policy_url=policy_url, template=template, max_steps=max_steps, tools=list(tools),
            metadata=dict(metadata or {}), model=model, system_prompt=system_prompt, pool=pool, sandbox_timeout_s=float(sandbox_timeout),
            policy_timeout_s=float(policy_timeout), policy_wait_s=float(policy_wait), submitted_at=time.time(),
            pause_while_waiting=bool(pause_while_waiting), memory_mb=memory_mb or 0, cpu=float(cpu or 0.0),
        )
        nc = await _nc(self.nats_url)
        job.tenant = await self._tenant()  # the job is the submitter's: under its tenant token (bus.subjects.rollout_job)
        await _store(nc, S.rollout_job(self.queue, job.tenant, job_id), codec.encode(job), {S.HDR_MSG_ID: f"rollout:{job.tenant}:{job_id}"})
        return job_id

    async def _tenant(self) -> str:
        return self.tenant or tenant_of(await _nc(self.nats_url))

    async def _kv(self) -> KV[RolloutRecord]:
        # by direct gets of its own keys: a tenant may not read the bucket's stream info (every tenant's keys)
        return KV.direct(_js(await _nc(self.nats_url)), S.KV_ROLLOUTS, RolloutRecord)

    async def get(self, job_id: str, *, with_steps: bool = False) -> RolloutResult:
        """The job as it stands: ``queued`` while no worker took it up; ``unknown_job`` when there is none."""
        _check_job_id(job_id)
        tenant = await self._tenant()
        rec = await (await self._kv()).get(S.rollout_key(tenant, job_id))
        if rec is None:
            try:
                await _js(await _nc(self.nats_url)).get_last_msg(S.STREAM_ROLLOUTS, S.rollout_job(self.queue, tenant, job_id), direct=True)
            except NotFoundError:
                raise UnknownJob(f"no rollout job {job_id}", job_id=job_id) from None
            return RolloutResult(job_id=job_id, state="queued")
        res = _result(rec)
        if with_steps and rec.sandbox_id:
            mine = (job_id, model_client(job_id), gateway_client(job_id))
            logged = await _steps(_js(await _nc(self.nats_url)), rec.sandbox_id, until=(job_id, rec.sandbox_steps - 1))  # the worker's steps it was answered
            res.steps = [s for s in logged if s.client_id in mine]
        return res

    async def wait(self, job_id: str, *, timeout: float | None = None, with_steps: bool = True) -> RolloutResult:
        """The job once done or failed (``TimeoutError`` past ``timeout`` seconds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        interval = 0.05
        while True:
            res = await self.get(job_id)
            if res.ended:
                return await self.get(job_id, with_steps=with_steps) if with_steps else res
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"rollout job {job_id} is still {res.state} after {timeout:g}s")
            await asyncio.sleep(interval)  # polling the job's record, at a growing interval
            interval = min(interval * 1.5, 1.0)

    async def results(self, job_ids: list[str] | None = None, *, wait: bool = False, timeout: float | None = None) -> list[RolloutResult]:
        """The ended jobs among ``job_ids`` (every ended job when None); ``wait``: wait for each of them."""
        if job_ids is None:
            recs = (await (await self._kv()).values_under(await self._tenant())).values()
            return [_result(r) for r in recs if r.state in ENDED]
        if wait:
            return list(await asyncio.gather(*(self.wait(j, timeout=timeout) for j in job_ids)))
        out = [await self.get(j) for j in job_ids]
        return [r for r in out if r.ended]


class Rollouts:
    """The synchronous ``AsyncRollouts``."""

    def __init__(self, *, nats_url: str | None = None, queue: str = S.ROLLOUT_QUEUE, tenant: str | None = None) -> None:
        self._a = AsyncRollouts(nats_url=nats_url, queue=queue, tenant=tenant)

    def submit(self, **kwargs: Any) -> str:
        from .._sync import _run

        return _run(self._a.submit(**kwargs))

    def get(self, job_id: str, **kwargs: Any) -> RolloutResult:
        from .._sync import _run

        return _run(self._a.get(job_id, **kwargs))

    def wait(self, job_id: str, **kwargs: Any) -> RolloutResult:
        from .._sync import _run

        return _run(self._a.wait(job_id, **kwargs))

    def results(self, job_ids: list[str] | None = None, **kwargs: Any) -> list[RolloutResult]:
        from .._sync import _run

        return _run(self._a.results(job_ids, **kwargs))


__all__ = ["AsyncRollouts", "Rollouts", "RolloutResult"]
