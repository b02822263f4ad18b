"""Tenants on the rollout surface: a tenant's jobs, their records and their model gateway are its own.

A real stack with NATS authentication, a rollout worker running as its own role (``rollouts``, with
only what it uses) and two tenants, each its own client credential. Every attack is made as an
attacker would (raw publishes, subscriptions and JetStream API calls, the SDK), and each refusal is
asserted precisely: the server's ``Permissions Violation`` for that subject, or the typed error the
worker answers (``unknown_job`` for another tenant's job, a forged job dead-lettered with
``permission_denied``); each has a positive control by the owner.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.auth import ROLLOUTS_ROLE
from bus.errors import PermissionDenied, QuotaExceeded, UnknownJob
from bus.messages import CreateSandbox, ExecRequest, ExecResult, ModelAnswer, ModelCall, RolloutJob, TenantLimits
from bus.runtime import KV, kv_keys
from sdk import AsyncSandbox, build_spec
from sdk.rollouts import AsyncRollouts, RolloutWorker
from sdk.rollouts._worker import sandbox_id_of
from tests.conftest import eventually
from tests.scripted_policy import Policy, answer, call
from tests.security.conftest import SKIP_REASON, Principal, RedTeam, SecStack, tenants

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

CONVO = [{"role": "user", "content": "x"}]


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    return await make_stack(auth=True)


@pytest_asyncio.fixture
async def worker(stack: SecStack) -> AsyncIterator[RolloutWorker]:
    """A rollout worker as the ``rollouts`` role (what `dsec up` runs), on a queue of its own."""
    w = RolloutWorker(stack.url_as(ROLLOUTS_ROLE), queue=f"q-{stack.uid}", capacity=4, ack_wait_s=10.0, grace_s=5.0)
    await w.start()
    try:
        yield w
    finally:
        await w.shutdown()


@pytest_asyncio.fixture
async def policy() -> AsyncIterator[Policy]:
    p = await Policy().start()
    try:
        yield p
    finally:
        await p.stop()


async def _model(nc: Any, job_id: str, tenant: str, subject_job: str | None = None) -> ModelAnswer:
    """A model gateway request (what the HTTP gateway sends as the key's tenant)."""
    body = json.dumps({"model": "m", "messages": CONVO}).encode()
    msg = await nc.request(S.model_call(subject_job or job_id, tenant), codec.encode(ModelCall(job_id=job_id, body=body)), timeout=60)
    return codec.decode_reply(msg.data, ModelAnswer)


async def _dead_letter(stack: SecStack, subject: str) -> Any:
    try:
        return await stack.nc.jetstream().get_last_msg(S.STREAM_DLQ, S.dlq(subject))
    except NotFoundError:
        return None


async def test_a_tenant_reaches_only_its_own_rollout_jobs(stack: SecStack, worker: RolloutWorker, policy: Policy, redteam: RedTeam) -> None:
    """B cannot submit in A's name, read A's job (its record, its queued message, the bucket's keys),
    listen on jobs or model calls, nor reach A's job through the model gateway; A does all of it."""
    a, b = await tenants(stack, "a", "b")
    q = worker.queue
    release = asyncio.Event()

    async def held() -> dict[str, Any]:
        await release.wait()  # A's job stays running while the gateway is tried
        return answer("bye")

    try:
        ra, rb = AsyncRollouts(nats_url=a.url, queue=q), AsyncRollouts(nats_url=b.url, queue=q)
        job = await ra.submit(task="secret task", policy_url=policy.url("a", [answer(None, call("exec", cmd="echo a")), held]))
        await eventually(lambda: len(policy.requests["a"]) == 2, timeout=120, what="A's job at its second turn")

        # The model gateway: A's own job answers A (positive control); B under its own tenant finds
        # nothing (unknown_job, as a job that does not exist), and may not publish under A's.
        got = await _model(a.nc, job, a.user)
        assert got.status == 200 and json.loads(got.body)["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "exec"  # its turn 0
        redteam.allowed("tenant a: its rollout's model gateway")
        for subject_job in (job, "job-of-b"):
            with pytest.raises(UnknownJob) as exc:
                await _model(b.nc, job, b.user, subject_job)
            assert exc.value.code == "unknown_job"
        redteam.blocked("tenant b: A's job through the model gateway under its own tenant [unknown_job]")
        model_req = codec.encode(ModelCall(job_id=job, body=b"{}"))
        await b.denied_publish(redteam, S.model_call(job, a.user), model_req, "A's job through the model gateway under A's tenant")
        release.set()
        res = await ra.wait(job, timeout=120, with_steps=False)
        assert (res.state, res.finish_reason) == ("done", "stop"), res
        assert [r.job_id for r in await ra.results()] == [job]
        assert json.loads(res.messages[2]["content"])["stdout"] == "a\n"
        redteam.allowed("tenant a: submit, wait, list its own jobs")

        # B's SDK reads are under its own tenant: nothing of A's.
        with pytest.raises(UnknownJob) as exc:
            await rb.get(job)
        assert exc.value.code == "unknown_job"
        assert await rb.results() == []
        redteam.blocked("tenant b: get / results of A's job through the SDK [unknown_job: its reads are under its own tenant]")

        # Raw: submissions in A's (and the operator's) name, reads of A's record and queued job.
        forged = codec.encode(RolloutJob(job_id="x", task="t", policy_url="http://127.0.0.1:1/v1", tenant=a.user))
        await b.denied_publish(redteam, S.rollout_job(q, a.user, "x"), forged, "submit a job in A's name")
        await b.denied_publish(redteam, S.rollout_job(q, S.OPERATOR_TENANT, "x"), forged, "submit a job in the operator's name")
        await b.denied_publish(redteam, f"{S.rollout_queue(q)}.x", forged, "submit a job without a tenant")
        rec = f"$KV.{S.KV_ROLLOUTS}.{S.rollout_key(a.user, job)}"
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.KV_{S.KV_ROLLOUTS}.{rec}", b"", "read A's job record (direct get)")
        await b.denied_publish(redteam, f"$JS.API.STREAM.MSG.GET.KV_{S.KV_ROLLOUTS}", json.dumps({"last_by_subj": rec}).encode(), "read A's job record")
        await b.denied_publish(redteam, f"$JS.API.STREAM.INFO.KV_{S.KV_ROLLOUTS}", b'{"subjects_filter":">"}', "list every job's key")
        spy = json.dumps({"stream_name": f"KV_{S.KV_ROLLOUTS}", "config": {"filter_subject": S.rollout_keys(a.user)}}).encode()
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.KV_{S.KV_ROLLOUTS}.spy.{S.rollout_keys(a.user)}", spy, "consumer on A's job records")
        await b.denied_publish(redteam, f"$JS.API.CONSUMER.CREATE.KV_{S.KV_ROLLOUTS}", spy, "consumer on the job records (filter in the body)")
        await b.denied_publish(redteam, f"$KV.{S.KV_ROLLOUTS}.{S.rollout_key(a.user, job)}", b"x", "overwrite A's job record")
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_ROLLOUTS}.{S.rollout_job(q, a.user, job)}", b"", "read A's queued job")
        await b.denied_publish(redteam, f"$JS.API.STREAM.MSG.GET.{S.STREAM_ROLLOUTS}", b'{"last_by_subj":"dsec.rollout.>"}', "read queued jobs")
        for subject, what in (
            (f"{S.PREFIX}.rollout.>", "every submitted job"), (f"{S.PREFIX}.model.>", "every model gateway call"),
            (S.model_tenant(a.user), "A's model gateway calls"), (f"$KV.{S.KV_ROLLOUTS}.>", "job record writes"),
        ):
            await b.denied_subscribe(redteam, subject, f"listen on {what}")
        # The rollout's sandbox is A's (operated by the workers): not B's to reach.
        sid = sandbox_id_of(job, a.user)
        await b.denied_publish(redteam, S.sbx(sid, "exec", ROLLOUTS_ROLE), codec.encode(ExecRequest(cmd="id")), "exec in a rollout's sandbox")
        assert b.nc.is_connected and a.no_violations(), a.errs

        # Positive control for B: its own job, its own reads.
        jb = await rb.submit(task="b's", policy_url=policy.url("b", [answer("ok")]))
        assert (await rb.wait(jb, timeout=120, with_steps=False)).state == "done"
        assert [r.job_id for r in await rb.results()] == [jb]
        redteam.allowed("tenant b: its own job")
    finally:
        release.set()
        for t in (a, b):
            await t.close()


async def test_the_worker_refuses_a_job_that_names_another_tenant(stack: SecStack, worker: RolloutWorker, policy: Policy, redteam: RedTeam) -> None:
    """A job on B's own subject whose body says it is A's is dead-lettered with ``permission_denied``
    (the worker binds a job to its subject's tenant) and never runs; the same job naming B runs."""
    (b,) = await tenants(stack, "b")
    q = worker.queue
    try:
        url = policy.url("forged", [answer("should never be asked")])
        subject = S.rollout_job(q, b.user, "forged")
        await b.nc.jetstream().publish(subject, codec.encode(RolloutJob(job_id="forged", task="t", policy_url=url, tenant=stack.client_user)))
        await eventually(lambda: _dead_letter(stack, subject), timeout=60, what="the forged job dead-lettered")
        assert (await _dead_letter(stack, subject)).headers[S.HDR_ERROR_CODE] == "permission_denied"
        assert policy.requests["forged"] == []
        assert not [k for k in await kv_keys(stack.nc.jetstream(), S.KV_ROLLOUTS) if k.endswith(".forged")]
        redteam.blocked("tenant b: a job whose body names another tenant [dead-lettered: permission_denied]")
        # A job on a subject of another shape (the services' own publish) is refused too, typed.
        bare = f"{S.rollout_queue(q)}.bare"
        await stack.nc.jetstream().publish(bare, codec.encode(RolloutJob(job_id="bare", task="t", policy_url=url)))
        await eventually(lambda: _dead_letter(stack, bare), timeout=60, what="the tenantless job dead-lettered")
        assert (await _dead_letter(stack, bare)).headers[S.HDR_ERROR_CODE] == "invalid_argument"

        # Positive control: the same job naming its own tenant runs.
        ok = policy.url("own", [answer("done")])
        await b.nc.jetstream().publish(S.rollout_job(q, b.user, "own"), codec.encode(RolloutJob(job_id="own", task="t", policy_url=ok, tenant=b.user)))
        res = await AsyncRollouts(nats_url=b.url, queue=q).wait("own", timeout=120, with_steps=False)
        assert (res.state, res.finish_reason) == ("done", "stop")
        redteam.allowed("tenant b: a job naming itself")
    finally:
        await b.close()


async def test_the_rollouts_role_has_only_what_it_uses(stack: SecStack, worker: RolloutWorker, policy: Policy, redteam: RedTeam) -> None:
    """The rollout workers' credential (its own role, not ``dsec.>``) cannot reach a tenant's
    sandboxes, records, host work or the image service; with it the worker runs a job end to end."""
    (a,) = await tenants(stack, "a")
    ro = await Principal.open(stack.url_as(ROLLOUTS_ROLE), "rollouts role")
    try:
        sa = await AsyncRollouts(nats_url=a.url, queue=worker.queue).submit(task="t", policy_url=policy.url("p", [answer("ok")]))
        res = await AsyncRollouts(nats_url=a.url, queue=worker.queue).wait(sa, timeout=120, with_steps=False)
        assert res.state == "done", res
        redteam.allowed("rollouts role: the worker runs a tenant's job end to end")
        sb = await AsyncSandbox.create(nats_url=a.url, sandbox_id=f"sb-{stack.uid}-ro")
        stack.sandboxes.append(sb)
        exec_req = codec.encode(ExecRequest(cmd="id"))
        await ro.denied_publish(redteam, S.sbx(sb.sandbox_id, "exec", a.user), exec_req, "exec in a tenant's sandbox")
        await ro.denied_publish(redteam, S.sbx(sb.sandbox_id, "exec", S.OPERATOR_TENANT), exec_req, "exec as the operator")
        spec = codec.encode(CreateSandbox(spec=build_spec("base", sandbox_id=f"x-{stack.uid}")))
        await ro.denied_publish(redteam, S.req_create(a.user), spec, "create in a tenant's name")
        await ro.denied_publish(redteam, S.REQ_CREATE, spec, "create on the services' subject")
        await ro.denied_publish(redteam, S.host_create(stack.host_id), b"x", "hand work to a host")
        rec = f"$KV.{S.KV_SANDBOXES}.{sb.sandbox_id}"
        await ro.denied_publish(redteam, f"$JS.API.DIRECT.GET.KV_{S.KV_SANDBOXES}.{rec}", b"", "read a sandbox record (envs)")
        await ro.denied_publish(redteam, f"$KV.{S.KV_PROFILES}.default", b"x", "replace a security profile")
        await ro.denied_publish(redteam, S.IMG_BUILD, b"x", "build a template as the operator")
        await ro.denied_publish(redteam, S.img_build(ROLLOUTS_ROLE), b"x", "build a template of its own")
        await ro.denied_publish(redteam, S.rollout_job(worker.queue, a.user, "x"), b"x", "submit a job in a tenant's name")
        await ro.denied_publish(redteam, f"$JS.API.STREAM.DELETE.{S.STREAM_EVT}", b"", "delete the event stream")
        await ro.denied_publish(redteam, S.evt_sandbox(sb.sandbox_id, "ready", a.user), b"x", "forge a sandbox event")
        for subject, what in (("dsec.sbx.>", "sandbox ops"), (S.EVT_ALL, "every event"), ("_INBOX.>", "every inbox"),
                              (S.evt_tenant(a.user), "a tenant's events"), ("$KV.>", "KV writes"), ("dsec.host.>", "host work")):
            await ro.denied_subscribe(redteam, subject, f"listen on {what}")
        # On its own subject, a tenant's sandbox that no job of it runs in: the host agent refuses (no delegate).
        with pytest.raises(PermissionDenied) as exc:
            codec.decode_reply((await ro.nc.request(S.sbx(sb.sandbox_id, "exec", ROLLOUTS_ROLE), exec_req, timeout=30)).data, ExecResult)
        assert exc.value.code == "permission_denied"
        redteam.blocked("rollouts role: exec in a tenant's sandbox no job runs in, on its own subject [permission_denied at the host]")
        assert (await sb.commands.run("echo mine")).stdout == "mine\n"  # the tenant's own sandbox untouched
    finally:
        await ro.close()
        await a.close()



async def test_a_rollouts_sandbox_is_its_submitters(stack: SecStack, worker: RolloutWorker, policy: Policy, redteam: RedTeam) -> None:
    """A job's sandbox belongs to the tenant that submitted it, not to the workers: it starts from A's
    private template, counts against A's quota, A reaches it and reads its steps; B reaches none of it
    (the host agent's ``permission_denied`` on B's own subject, the server's violation on A's and the
    workers'), and A's quota is free again once the job is done."""
    from tests.security.test_tenant_templates import private_template

    a, b = await tenants(stack, "a", "b")
    release = asyncio.Event()

    async def held() -> dict[str, Any]:
        await release.wait()  # the job's sandbox stays up while it is tried
        return answer("bye")

    try:
        template = await private_template(stack, a)
        limits = await KV.open(stack.nc.jetstream(), S.KV_TENANTS, codec.TENANT_LIMITS)
        await limits.put(a.user, TenantLimits(max_sandboxes=1))
        await eventually(lambda: stack.placement.quotas.limits_for(a.user) is not None, timeout=15, what="placement to see A's limits")
        ra = AsyncRollouts(nats_url=a.url, queue=worker.queue)
        job = await ra.submit(task="t", template=template, policy_url=policy.url("a", [answer(None, call("exec", cmd="echo own > /tmp/o; cat /tmp/o")), held]))
        await eventually(lambda: len(policy.requests["a"]) == 2, timeout=120, what="A's job at its second turn")
        sid = sandbox_id_of(job, a.user)
        rec = await (await KV.open(stack.nc.jetstream(), S.KV_SANDBOXES, codec.SANDBOX_RECORD)).get(sid)
        assert rec is not None and rec.spec.client == a.user and rec.spec.delegate == ROLLOUTS_ROLE and rec.spec.template == template, rec

        # A reaches its rollout's sandbox; its one sandbox place is the rollout's (quota charged to A).
        mine = await AsyncSandbox.connect(sid, nats_url=a.url)
        assert (await mine.commands.run("cat /tmp/o")).stdout == "own\n"
        with pytest.raises(QuotaExceeded) as qe:
            await AsyncSandbox.create(nats_url=a.url, sandbox_id=f"sb-{stack.uid}-a2", create_timeout=60)
        assert qe.value.code == "quota_exceeded" and "1 of max 1" in qe.value.description, qe.value
        redteam.allowed("tenant a: exec in its rollout's sandbox (from its private template, on its quota)")

        # B: the SDK and a raw request on its own subject (the host agent refuses), A's and the workers' subjects (the server).
        with pytest.raises(PermissionDenied):
            await AsyncSandbox.connect(sid, nats_url=b.url)
        exec_req = codec.encode(ExecRequest(cmd="cat /tmp/o"))
        with pytest.raises(PermissionDenied) as exc:
            codec.decode_reply((await b.nc.request(S.sbx(sid, "exec", b.user), exec_req, timeout=30)).data, ExecResult)
        assert exc.value.code == "permission_denied"
        redteam.blocked("tenant b: connect / exec in A's rollout sandbox under its own tenant [permission_denied at the host]")
        await b.denied_publish(redteam, S.sbx(sid, "exec", a.user), exec_req, "exec in A's rollout sandbox in A's name")
        await b.denied_publish(redteam, S.sbx(sid, "exec", ROLLOUTS_ROLE), exec_req, "exec in A's rollout sandbox as the workers")
        await b.denied_subscribe(redteam, S.evt_tenant(a.user), "listen on A's rollout sandbox's events")
        await b.denied_publish(redteam, f"$JS.API.DIRECT.GET.{S.STREAM_TRAJ}.{S.traj(sid, a.user)}", b"", "read A's rollout's trajectory log")
        sb_b = await AsyncSandbox.create(nats_url=b.url, sandbox_id=f"sb-{stack.uid}-b1")
        stack.sandboxes.append(sb_b)
        redteam.allowed("tenant b: its own sandbox while A's quota is full")

        # Done: A reads its rollout's steps (the log is under A), and its place is free again.
        release.set()
        res = await ra.wait(job, timeout=120, with_steps=True)
        assert (res.state, res.finish_reason) == ("done", "stop"), res
        execs = [s for s in res.steps if s.op == "exec"]
        assert execs and execs[0].result.stdout == b"own\n", res.steps
        assert any(s.op == "model" for s in res.steps)
        await eventually(lambda: sid not in stack.host.live, timeout=30, what="the rollout's sandbox killed")
        a2 = await AsyncSandbox.create(nats_url=a.url, sandbox_id=f"sb-{stack.uid}-a3", create_timeout=60)
        stack.sandboxes.append(a2)
        redteam.allowed("tenant a: its rollout's steps; a sandbox once the rollout is done")
        assert a.no_violations(), a.errs
    finally:
        release.set()
        for t in (a, b):
            await t.close()
