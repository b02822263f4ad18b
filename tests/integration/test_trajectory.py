"""The trajectory log (DSEC_TRAJ): every changing operation logged by its host (published before the reply), a
client replaying it fast-forwards (logged steps are not run again), a different request at a
logged step is a ``trajectory_conflict``; on real containerd sandboxes (the session ``stack``)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from typing import Any

import pytest
from nats.js.errors import NotFoundError

from bus import codec
from bus import subjects as S
from bus.messages import ExecRequest, ExecResult, TrajStep
from bus.trajectory import STEP_DECODER, digest
from sdk import AsyncSandbox, CommandExitError
from sdk import _trajectory as _sdk_traj
from sdk._trajectory import TrajClient
from hostagent import _trajectory as _host_traj
from sdk.errors import FileNotFound, TrajectoryConflict, TrajectoryGap, TrajectoryTrimmed, Unavailable
from tests.conftest import eventually
from tests.imaged.conftest import needs_fuse
from tests.integration.conftest import PY, REPO, Stack, needs_stack, run_process, subprocess_env

COUNT = "echo x >> /tmp/count; wc -l < /tmp/count"  # not idempotent: says how often it ran


async def _last_step(stack: Stack, sid: str, step: int) -> TrajStep:
    """The sandbox's last logged step once it is ``step``: the host publishes a step before its
    reply and has the stream's ack just after (hostagent/_trajectory)."""
    got: list[TrajStep] = []

    async def logged() -> bool:
        try:
            msg = await stack.js.get_last_msg(S.STREAM_TRAJ, S.traj_any(sid))
        except NotFoundError:  # nothing stored yet: the stream takes a write after the reply may have come in
            return False
        got.append(STEP_DECODER.decode(msg.data))
        return got[-1].step == step

    await eventually(logged, timeout=10, what=f"step {step} in the log")
    return got[-1]


@pytest.mark.containerd
@needs_stack
async def test_every_change_is_logged_reads_are_not(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        sid = sb.sandbox_id
        assert (await sb.commands.run("echo hi")).stdout == "hi\n"
        last = await _last_step(stack, sid, 0)
        assert (last.step, last.kind, last.op, last.client_id, last.error_code) == (0, "ExecRequest", "exec", sb._traj.client_id, "")
        assert codec.decode_reply(last.result, ExecResult).stdout == b"hi\n"
        assert last.host_id == stack.host_id and last.duration_ms > 0
        await sb.files.write("/tmp/f", "data")
        assert (await _last_step(stack, sid, 1)).kind == "FileWrite"
        assert await sb.files.read("/tmp/f") == "data"  # a read changes nothing: not a step
        assert await sb.files.exists("/tmp/f")
        await sb.files.make_dir("/tmp/d")
        await sb.files.remove("/tmp/f")
        with pytest.raises(CommandExitError):
            await sb.commands.run("exit 3")
        with pytest.raises(FileNotFound):
            await sb.files.rename("/tmp/nothing", "/tmp/else")
        # Output past the log's cap (64 KiB a stream) is kept as its head and its digest.
        big = await sb.commands.run("head -c 200000 /dev/zero | tr '\\0' y")
        assert len(big.stdout) == 200000
        steps = await sb.trajectory()
        assert [(s.step, s.kind) for s in steps] == [
            (0, "ExecRequest"), (1, "FileWrite"), (2, "FileMakeDir"), (3, "FileRemove"), (4, "ExecRequest"), (5, "FileRename"), (6, "ExecRequest"),
        ]
        assert [s.seq for s in steps] == sorted(s.seq for s in steps)
        assert steps[4].result.exit_code == 3 and steps[4].error_code == ""
        assert steps[5].error_code == "file_not_found" and steps[5].result is None
        assert steps[0].request.cmd == "echo hi" and steps[0].digest == digest(ExecRequest(cmd="echo hi", timeout_s=60.0, acks=True))
        assert len(steps[6].result.stdout) == 64 << 10 and steps[6].result.stdout_truncated and steps[6].result.stdout_bytes == 200000
        assert steps[6].digests["stdout"] == hashlib.sha256(b"y" * 200000).hexdigest()


@pytest.mark.containerd
@needs_stack
async def test_replay_fast_forwards_logged_steps_without_running_them_again(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        first = [(await sb.commands.run(COUNT)).stdout for _ in range(3)]
        assert first == ["1\n", "2\n", "3\n"]
        with pytest.raises(FileNotFound):
            await sb.files.remove("/tmp/absent")
        # A new client (the trainer came back) starts at step 0 of the log's last client.
        again = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url, replay=True)
        assert again._traj.client_id == sb._traj.client_id and again._traj.next == 0
        assert [(await again.commands.run(COUNT)).stdout for _ in range(3)] == first  # the logged results
        with pytest.raises(FileNotFound):  # a logged error is raised again
            await again.files.remove("/tmp/absent")
        assert again._traj.replayed == 4
        # Past the log it runs live: the command had run 3 times, not 6.
        assert (await again.commands.run(COUNT)).stdout == "4\n"
        assert [s.step for s in await sb.trajectory()] == [0, 1, 2, 3, 4]


@pytest.mark.containerd
@needs_stack
async def test_a_different_request_at_a_logged_step_is_a_trajectory_conflict(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        await sb.commands.run("echo one")
        await sb.files.write("/tmp/a", "1")
        other = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url, replay=True)
        with pytest.raises(TrajectoryConflict) as exc:
            await other.commands.run("echo two")
        assert exc.value.code == "trajectory_conflict" and exc.value.context["step"] == 0
        # Positive control: the logged request at that step replays (the step was not used up).
        assert (await other.commands.run("echo one")).stdout == "one\n"
        with pytest.raises(TrajectoryConflict) as exc:
            await other.files.write("/tmp/a", "2")  # same path, other data
        assert exc.value.context["step"] == 1
        # The host refuses it too (a client that does not read the log first).
        raw = ExecRequest(cmd="echo three", step=0, client_id=sb._traj.client_id)
        reply = await stack.nc.request(S.sbx(sb.sandbox_id, "exec"), codec.encode(raw), timeout=30)
        with pytest.raises(TrajectoryConflict):
            codec.decode_reply(reply.data, ExecResult)
        raw.cmd = "echo one"  # positive control: the logged request is answered from the host's memory
        reply = await stack.nc.request(S.sbx(sb.sandbox_id, "exec"), codec.encode(raw), timeout=30)
        assert codec.decode_reply(reply.data, ExecResult).stdout == b"one\n"


@pytest.mark.containerd
@needs_stack
async def test_a_step_still_running_when_its_client_died_is_awaited_not_run_twice(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        cmd = "echo run >> /tmp/ran; while [ ! -e /tmp/go ]; do sleep 0.05; done; wc -l < /tmp/ran"
        first = asyncio.ensure_future(sb.commands.run(cmd, timeout=30))
        await eventually(lambda: _running(sb, "while"), timeout=15, what="the first client's step to run")
        # Its client "died" (we stop listening); a new one replays: the log has nothing for step 0 yet.
        again = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url, client_id=sb._traj.client_id)
        second = asyncio.ensure_future(again.commands.run(cmd, timeout=30))
        observer = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url)
        await observer.files.write("/tmp/go", "")
        assert (await second).stdout == "1\n" and (await first).stdout == "1\n"
        assert await observer.files.read("/tmp/ran") == "run\n"  # ran once
        assert [s.step for s in await sb.trajectory() if s.client_id == sb._traj.client_id] == [0]


async def _running(sb: AsyncSandbox, word: str) -> bool:
    return any(word in p.cmd for p in await sb.commands.list())


def test_a_log_that_lost_its_first_steps_is_trajectory_trimmed() -> None:
    def step(n: int) -> TrajStep:
        return TrajStep(sandbox_id="s", client_id="c-1", step=n, op="exec", kind="ExecRequest", digest="d")

    tc = TrajClient()
    with pytest.raises(TrajectoryTrimmed) as exc:
        tc.start_replay([(10, step(2)), (11, step(3))], None)
    assert exc.value.code == "trajectory_trimmed" and exc.value.context["step"] == 2
    tc.start_replay([(9, step(0)), (10, step(1))], None)  # positive control: a whole log replays
    assert tc.client_id == "c-1" and sorted(tc.logged) == [0, 1]


def test_a_log_that_skips_a_step_is_a_trajectory_gap() -> None:
    def step(n: int) -> TrajStep:
        return TrajStep(sandbox_id="s", client_id="c-1", step=n, op="exec", kind="ExecRequest", digest="d")

    tc = TrajClient()
    with pytest.raises(TrajectoryGap) as exc:  # step 1 answered, never stored: replaying would run it again
        tc.start_replay([(9, step(0)), (11, step(2))], None)
    assert exc.value.code == "trajectory_gap" and exc.value.context["step"] == 1
    tc.start_replay([(9, step(0)), (10, step(1)), (11, step(2))], None)  # positive control: no gap
    assert sorted(tc.logged) == [0, 1, 2]


@pytest.mark.containerd
@needs_stack
async def test_a_step_the_stream_did_not_take_is_stored_again_before_its_clients_next_step_runs(stack: Stack, monkeypatch: Any) -> None:
    """The host replies before the stream's ack: a step the stream refused is stored again, and the
    same client's next step is not run (``unavailable``, its number given back) until it is in the log."""
    monkeypatch.setattr(_host_traj, "LOG_TIMEOUT_S", 2.0)
    monkeypatch.setattr(_sdk_traj, "SETTLE_S", 1.0)
    info = await stack.js.stream_info(S.STREAM_TRAJ)
    async with stack.sandbox() as sb:
        sid = sb.sandbox_id
        assert (await sb.commands.run(COUNT)).stdout == "1\n"
        await _last_step(stack, sid, 0)
        try:
            await stack.js.update_stream(dataclasses.replace(info.config, max_msg_size=64))  # every step is refused now
            assert (await sb.commands.run(COUNT)).stdout == "2\n"  # step 1 ran and was answered
            with pytest.raises(Unavailable) as exc:
                await sb.commands.run(COUNT)
            assert exc.value.context == {"step": 2, "logged": False} and sb._traj.next == 2
            assert [s.step for s in await sb.trajectory()] == [0]  # step 1 is not there (it waited SETTLE_S for it)
        finally:
            await stack.js.update_stream(info.config)
        await _last_step(stack, sid, 1)  # stored again once the stream takes it
        assert (await sb.commands.run(COUNT)).stdout == "3\n"  # step 2 runs now: it had not run before
        assert [s.step for s in await sb.trajectory()] == [0, 1, 2]
        again = await AsyncSandbox.connect(sid, nats_url=stack.url, replay=True)
        assert [(await again.commands.run(COUNT)).stdout for _ in range(3)] == ["1\n", "2\n", "3\n"]  # no gap: all replayed
        assert again._traj.replayed == 3


@pytest.mark.containerd
@needs_stack
async def test_cli_trajectory_show(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        await sb.commands.run("echo cli")
        await sb.files.write("/tmp/x", "1")
        env = subprocess_env(stack.url)
        dsec = (PY, "-m", "sdk.cli", "trajectory", "show")
        rc, out, err = await run_process(*dsec, sb.sandbox_id, "--json", env=env, cwd=str(REPO))
        assert rc == 0, err
        steps = json.loads(out)
        assert [(s["step"], s["kind"]) for s in steps] == [(0, "ExecRequest"), (1, "FileWrite")]
        assert steps[0]["request"]["cmd"] == "echo cli" and steps[0]["result"]["stdout"] == "cli\n"
        rc, out, err = await run_process(*dsec, sb.sandbox_id, env=env, cwd=str(REPO))
        assert rc == 0 and "echo cli" in out and "(2 steps)" in err
        rc, out, err = await run_process(*dsec, "bad.id", env=env, cwd=str(REPO))
        assert rc == 2 and "not a sandbox id" in err


@pytest.mark.containerd
@needs_stack
@needs_fuse
@pytest.mark.usefixtures("lazy")
async def test_a_fork_inherits_its_parents_log_up_to_the_fork_point(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        await sb.commands.run("echo before")
        await sb.files.write("/tmp/p", "1")
        (child,) = await sb.fork(1, **stack.kw())
        try:
            await sb.commands.run("echo parent-after")  # not the child's history
            assert (await child.commands.run("cat /tmp/p")).stdout == "1"
            steps = await child.trajectory()
            assert [(s.sandbox_id, s.step, s.kind) for s in steps] == [
                (sb.sandbox_id, 0, "ExecRequest"), (sb.sandbox_id, 1, "FileWrite"), (sb.sandbox_id, 2, "SnapshotRequest"),
                (child.sandbox_id, 0, "ExecRequest"),
            ]
            assert steps[-1].request.cmd == "cat /tmp/p"
            # The parent's own log is its own: the fork point and what came after, no child step.
            assert [s.kind for s in await sb.trajectory()] == ["ExecRequest", "FileWrite", "SnapshotRequest", "ExecRequest"]
        finally:
            await child.kill()


@pytest.mark.containerd
@needs_stack
async def test_cli_trajectory_replay_reruns_the_log_in_a_fresh_sandbox_and_says_where_it_differs(stack: Stack) -> None:
    async with stack.sandbox() as sb:
        await sb.commands.run("echo stable")
        await sb.commands.run("head -c 8 /dev/urandom | od -An -tx1")  # differs in any other run
        await sb.files.write("/tmp/f", "kept")
        await sb.commands.run("cat /tmp/f")  # the write ran first in the fresh sandbox too
        with pytest.raises(FileNotFound):
            await sb.files.remove("/tmp/none")
        env = subprocess_env(stack.url)
        rc, out, err = await run_process(
            PY, "-m", "sdk.cli", "trajectory", "replay", sb.sandbox_id, "--pool", stack.pool, "--json", env=env, cwd=str(REPO), timeout=180,
        )
        assert rc == 1, err  # something differs
        diffs = json.loads(out)
        assert [(d["step"], d["kind"], d["status"]) for d in diffs] == [
            (0, "ExecRequest", "same"), (1, "ExecRequest", "differs"), (2, "FileWrite", "same"), (3, "ExecRequest", "same"), (4, "FileRemove", "same"),
        ]
        assert "stdout" in diffs[1]["detail"] and "(5 steps, 1 differ, 0 skipped)" in err
        # The fresh sandbox is gone afterwards: only this test's own sandbox is left on the host.
        await eventually(lambda: [s for s in stack.host.live if s != sb.sandbox_id] == [], timeout=30, what="the replay's sandbox to go")
