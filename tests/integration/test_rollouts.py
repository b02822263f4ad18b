"""Rollout workers: jobs on a work queue, the agent loop against a scripted OpenAI-compatible policy
(an aiohttp server these tests start, standing in for the user's model), tool calls as logged
sandbox steps, a worker killed mid-rollout taken over without running a step twice, an unreachable
policy waited for, bad policy replies and a dead sandbox recorded as typed errors in the job."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.auth import ANONYMOUS_USER, with_credentials
from bus.messages import RolloutJob

from bus.natsd import free_port
from sdk import AsyncSandbox
from sdk.errors import InvalidArgument, UnknownJob
from sdk.rollouts import AsyncRollouts, RolloutWorker
from sdk.rollouts._worker import sandbox_id_of as _sandbox_id_of
from tests.conftest import eventually
from tests.scripted_policy import Policy, answer, call
from tests.integration.conftest import PY, Child, Stack, needs_stack, run_process, subprocess_env

pytestmark = [pytest.mark.containerd, needs_stack]

COUNT = "echo x >> /tmp/count; wc -l < /tmp/count"  # not idempotent: says how often it ran


def sandbox_id_of(job_id: str) -> str:
    """A job's sandbox on this stack, which has no credentials: every client is the anonymous tenant."""
    return _sandbox_id_of(job_id, ANONYMOUS_USER)


def sandbox_steps(res: Any) -> list[Any]:
    return [s for s in res.steps if s.op != "model"]


@contextlib.asynccontextmanager
async def setup(stack: Stack, *, workers: int = 1) -> AsyncIterator[tuple[AsyncRollouts, Policy, str]]:
    queue = f"q-{uuid.uuid4().hex[:10]}"
    policy = await Policy().start()
    started = [RolloutWorker(stack.url, queue=queue, capacity=8, ack_wait_s=5.0, grace_s=5.0) for _ in range(workers)]
    try:
        for w in started:
            await w.start()
        yield AsyncRollouts(nats_url=stack.url, queue=queue), policy, queue
    finally:
        for w in started:
            await w.shutdown()
        await policy.stop()


async def _submit(ro: AsyncRollouts, stack: Stack, url: str, **kw: Any) -> str:
    return await ro.submit(task=kw.pop("task", "do it"), policy_url=url, pool=stack.pool, **kw)


async def _sandbox_gone(stack: Stack, job_id: str) -> None:
    sid = sandbox_id_of(job_id)
    await eventually(lambda: sid not in stack.host.live, timeout=30, what=f"{sid} to be removed")


async def test_a_rollout_runs_the_agent_loop_and_logs_every_sandbox_step(stack: Stack) -> None:
    async with setup(stack) as (ro, policy, _):
        url = policy.url("main", [
            answer(None, call("exec", cmd="echo hello > /tmp/h; cat /tmp/h"), token_ids=[11, 12], logprobs={"content": [{"logprob": -0.5}]}),
            answer("two at once", call("write_file", 1, path="/tmp/a", content="A"), call("read_file", 2, path="/tmp/a")),
            answer("done"),
        ])
        job = await _submit(ro, stack, url, metadata={"run": "t1"})
        res = await ro.wait(job, timeout=120)
        assert (res.state, res.finish_reason, res.turns, res.error_code) == ("done", "stop", 3, ""), res
        roles = [m["role"] for m in res.messages]
        assert roles == ["user", "assistant", "tool", "assistant", "tool", "tool", "assistant"]
        assert json.loads(res.messages[2]["content"]) == {"exit_code": 0, "stdout": "hello\n", "stderr": ""}
        assert [m["content"] for m in res.messages[4:6]] == ["ok", "A"] and res.messages[-1]["content"] == "done"
        assert res.metadata == {"run": "t1"} and res.deliveries == 1
        # Every changing sandbox step is in the trajectory log, under the job as client (a read is not a step).
        assert [(s.step, s.kind, s.client_id) for s in sandbox_steps(res)] == [(0, "ExecRequest", job), (1, "FileWrite", job)]
        # ... in one ordered log with the policy's turns (each logged before its tool calls ran).
        assert [(s.op, s.step) for s in res.steps] == [("model", 0), ("exec", 0), ("model", 1), ("files", 1), ("model", 2)]
        turns = res.model_turns
        assert [t["turn"] for t in turns] == [0, 1, 2] and all(t["policy_version"] == "v7" for t in turns)
        assert turns[0]["token_ids"] == [11, 12] and turns[0]["logprobs"] == {"content": [{"logprob": -0.5}]}
        assert turns[0]["prompt_token_ids"] == [7, 8, 9] and turns[1]["token_ids"] is None
        assert turns[0]["messages"] == [{"role": "user", "content": "do it"}] and turns[2]["message"]["content"] == "done"
        # What the policy was sent: the conversation so far and the job's tools.
        first = policy.requests["main"][0]
        assert first["messages"] == [{"role": "user", "content": "do it"}]
        assert {t["function"]["name"] for t in first["tools"]} == {"exec", "read_file", "write_file"}
        assert len(policy.requests["main"]) == 3
        await _sandbox_gone(stack, job)
        assert [r.job_id for r in await ro.results([job])] == [job]


async def test_bad_policy_replies_and_bad_input_are_typed_errors_and_the_worker_goes_on(stack: Stack) -> None:
    async with setup(stack) as (ro, policy, queue):
        cases = {
            "notjson": ["this is not json", "policy_error"],
            "unknown": [answer(None, call("rm_rf", path="/")), "policy_error"],
            "types": [answer(None, call("exec", cmd=5)), "policy_error"],
            "noargs": [answer(None, call("write_file", path="/tmp/x")), "policy_error"],
            "nochoices": [json.dumps({"choices": []}), "policy_error"],
        }
        jobs = {name: await _submit(ro, stack, policy.url(name, [script])) for name, (script, _) in cases.items()}
        for name, job in jobs.items():
            res = await ro.wait(job, timeout=120)
            assert (res.state, res.error_code) == ("failed", cases[name][1]), (name, res)
        assert "rm_rf" in (await ro.get(jobs["unknown"])).error
        # A template that does not exist: the sandbox is never made, the job says why.
        res = await ro.wait(await _submit(ro, stack, policy.url("nosb", [answer("unused")]), template="no-such-template"), timeout=120)
        assert (res.state, res.error_code) == ("failed", "unknown_template") and policy.requests["nosb"] == []
        # Positive control: the same worker still runs a good job, to max_steps.
        loop = policy.url("loop", [answer(None, call("exec", n, cmd="true")) for n in range(5)])
        res = await ro.wait(await _submit(ro, stack, loop, max_steps=2), timeout=120)
        assert (res.state, res.finish_reason, res.turns) == ("done", "max_steps", 2)
        with pytest.raises(UnknownJob) as exc:
            await ro.get("job-that-never-was")
        assert exc.value.code == "unknown_job"
        for bad in ({"tools": ["exec", "format_disk"]}, {"max_steps": 0}, {"policy_url": "ftp://x"}, {"task": ""}):
            with pytest.raises(InvalidArgument):
                await ro.submit(**{"task": "t", "policy_url": "http://127.0.0.1:1/v1", **bad})  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument):
            await ro.get("bad.id")
        # Malformed work on the queue is kept aside on DSEC_DLQ with its code, never retried forever.
        bad_job = RolloutJob(job_id="bad id!", task="t", policy_url="http://127.0.0.1:1/v1")
        for tail, data, code in (("garbage", b"\x00 not msgpack", "bad_request"), ("badid", codec.encode(bad_job), "invalid_argument")):
            subject = S.rollout_job(queue, ANONYMOUS_USER, tail)
            await stack.js.publish(subject, data)
            await eventually(lambda subject=subject: _dead_letter(stack, subject), timeout=30, what=f"{tail} dead-lettered")
            assert (await _dead_letter(stack, subject)).headers[S.HDR_ERROR_CODE] == code
        res = await ro.wait(await _submit(ro, stack, loop, max_steps=1), timeout=120)  # and the worker goes on
        assert (res.state, res.finish_reason) == ("done", "max_steps")
        for job in jobs.values():
            await _sandbox_gone(stack, job)


async def test_a_policy_that_times_out_fails_the_job_with_policy_timeout(stack: Stack) -> None:
    async with setup(stack) as (ro, policy, _):
        job = await _submit(ro, stack, policy.url("slow", ["hang"]), policy_timeout=0.3)
        res = await ro.wait(job, timeout=120)
        assert (res.state, res.error_code) == ("failed", "policy_timeout"), res
        assert len(policy.requests["slow"]) == 3  # three tries, then the typed error
        await _sandbox_gone(stack, job)


async def test_an_unreachable_policy_is_waited_for_and_the_job_resumes(stack: Stack) -> None:
    async with setup(stack) as (ro, _, _):
        port = free_port()
        late = Policy()
        job = await _submit(ro, stack, f"http://127.0.0.1:{port}/late/v1", pause_while_waiting=True)
        await eventually(lambda: _state_is(ro, job, "waiting_policy"), timeout=60, what="the job to wait for its policy")
        sid = sandbox_id_of(job)
        await eventually(lambda: stack.host.registry.get(sid).state == "paused", timeout=30, what="the sandbox to be frozen meanwhile")
        late.url("late", [answer(None, call("exec", cmd=COUNT)), answer("finished")])
        await late.start(port)  # the GPU pool is back
        try:
            res = await ro.wait(job, timeout=120)
        finally:
            await late.stop()
        assert (res.state, res.finish_reason) == ("done", "stop") and res.policy_retries >= 1
        assert json.loads(res.messages[2]["content"])["stdout"] == "1\n"


async def _dead_letter(stack: Stack, subject: str) -> Any:
    try:
        return await stack.js.get_last_msg(S.STREAM_DLQ, S.dlq(subject))
    except NotFoundError:
        return None


async def _state_is(ro: AsyncRollouts, job: str, state: str) -> bool:
    return (await ro.get(job)).state == state


async def test_a_sandbox_that_died_mid_rollout_fails_the_job_with_its_error(stack: Stack) -> None:
    async with setup(stack) as (ro, policy, _):
        job_box: list[str] = []

        async def kill_then_answer() -> dict[str, Any]:
            await (await AsyncSandbox.connect(sandbox_id_of(job_box[0]), nats_url=stack.url)).kill()
            return answer(None, call("exec", 1, cmd="echo too late"))

        url = policy.url("dies", [answer(None, call("exec", cmd="echo first")), kill_then_answer])
        job_box.append(await _submit(ro, stack, url))
        res = await ro.wait(job_box[0], timeout=120)
        assert res.state == "failed" and res.error_code in ("sandbox_not_found", "not_running"), res
        assert [s.step for s in sandbox_steps(res)] == [0]  # the first step ran; the second never did


async def test_a_worker_killed_mid_rollout_is_taken_over_without_running_a_step_twice(stack: Stack, tmp_path: Any) -> None:
    queue = f"q-{uuid.uuid4().hex[:10]}"
    policy = await Policy().start()
    env = subprocess_env(stack.url)
    argv = [PY, "-m", "sdk.rollouts", "--queue", queue, "--ack-wait", "2"]
    a = Child(argv, env, tmp_path / "a.log").start()
    b: Child | None = None
    try:
        ro = AsyncRollouts(nats_url=stack.url, queue=queue)
        slow = "echo run >> /tmp/ran; while [ ! -e /tmp/go ]; do sleep 0.05; done; wc -l < /tmp/ran"
        url = policy.url("kill", [answer(None, call("exec", cmd=COUNT)), answer(None, call("exec", 1, cmd=slow)), answer("done")])
        job = await _submit(ro, stack, url)
        sid = sandbox_id_of(job)
        await eventually(lambda: sid in stack.host.live, timeout=90, what="the job's sandbox")
        watcher = await AsyncSandbox.connect(sid, nats_url=stack.url)
        await eventually(lambda: _running(watcher, "while"), timeout=60, what="the second step to run")
        a.signal(signal.SIGKILL)  # mid-step: its command still runs in the sandbox
        await a.wait(10)
        b = Child(argv, env, tmp_path / "b.log").start()
        await watcher.files.write("/tmp/go", "")
        res = await ro.wait(job, timeout=120)
        assert (res.state, res.finish_reason, res.deliveries) == ("done", "stop", 2), (res, b.log())
        outs = [json.loads(m["content"])["stdout"] for m in res.messages if m["role"] == "tool"]
        assert outs == ["1\n", "1\n"]  # each command ran once
        assert [s.step for s in sandbox_steps(res)] == [0, 1]  # each step logged once
        assert [s.step for s in res.steps if s.op == "model"] == [0, 1, 2]
        assert len(policy.requests["kill"]) == 3  # no turn asked twice
    finally:
        for c in (a, b):
            if c is not None:
                await c.stop()
        await policy.stop()


async def _running(sb: AsyncSandbox, word: str) -> bool:
    return any(word in p.cmd for p in await sb.commands.list())



async def test_dsec_up_runs_rollout_workers_and_the_model_gateway(tmp_path: Any) -> None:
    """The whole stack with its NATS users: the worker's own role; an API key's tenant submits a job
    and its OpenAI client talks to the rollout's policy through the gateway, its turn logged in the
    same ordered log; the operator reads the key's job and its steps. The key reaches only its own
    jobs: the operator's job through the key's gateway is ``unknown_job``."""
    import aiohttp

    from tests.integration.test_up import running_up
    from sdk.gateway._keys import parse_key, wait_usable

    policy = await Policy().start()
    release = asyncio.Event()

    async def second_turn() -> dict[str, Any]:
        await release.wait()  # the job's own second turn waits until the gateway's call went through
        return answer("bye")

    try:
        async with running_up("ro") as up:
            svc = up.services()["rollouts"]
            assert svc["state"] == "running" and svc["restarts"] == 0, svc
            rc, key, err = await run_process(PY, "-m", "sdk.cli", "api-key", "create", "--name", "trainer", "--data-dir", str(up.data), env=up.env())
            assert rc == 0, err
            user, pw = parse_key(key.strip())
            trainer = AsyncRollouts(nats_url=with_credentials(up.url, user, pw))
            operator = AsyncRollouts(nats_url=up.operator_url)  # the operator (nothing connects without credentials)
            url = policy.url("up", [answer(None, call("exec", cmd="echo via-up")), second_turn, answer("from the gateway", token_ids=[5, 6])])
            assert await wait_usable(key.strip(), up.url)  # once nats-server reloaded its users
            job = await trainer.submit(task="say it", policy_url=url)
            theirs = await operator.submit(task="the operator's", policy_url=policy.url("op", [answer("done")]))
            await eventually(lambda: len(policy.requests["up"]) == 2, timeout=180, what="the job's second turn")

            argv = up.child.argv
            gw = f"http://127.0.0.1:{argv[argv.index('--http-port') + 1]}"
            convo = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}]
            auth = {"Authorization": f"Bearer {key.strip()}"}
            async with aiohttp.ClientSession(headers=auth) as http:
                async with http.post(f"{gw}/rollouts/{job}/v1/chat/completions", json={"model": "m", "messages": convo}) as r:
                    assert r.status == 200, await r.text()
                    assert r.headers["X-Policy-Version"] == "v7"
                    assert (await r.json())["choices"][0]["message"]["content"] == "from the gateway"
                for other in ("job-none", theirs):
                    async with http.post(f"{gw}/rollouts/{other}/v1/chat/completions", json={"messages": convo}) as r:
                        assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_job"
            release.set()

            res = await trainer.wait(job, timeout=180, with_steps=False)
            assert (res.state, res.finish_reason) == ("done", "stop"), res
            assert json.loads(res.messages[2]["content"])["stdout"] == "via-up\n"
            # its sandbox is the workers' tenant's: the operator reads its steps
            res = await AsyncRollouts(nats_url=up.operator_url, tenant=user).get(job, with_steps=True)
            assert [(s.op, s.client_id.removeprefix(job)) for s in res.steps] == [("model", "-model"), ("exec", ""), ("model", "-gw"), ("model", "-model")]
            gw_turn = res.model_turns[1]
            assert gw_turn["via_gateway"] and gw_turn["messages"] == convo and gw_turn["token_ids"] == [5, 6] and gw_turn["policy_version"] == "v7"
            assert (await operator.wait(theirs, timeout=180, with_steps=False)).state == "done"
            assert up.services()["rollouts"]["restarts"] == 0
    finally:
        release.set()
        await policy.stop()

