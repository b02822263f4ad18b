"""The in-sandbox agent's background commands, stdin, signals, process list, users, output caps,
and its mkdir/rename/watch file operations -- the agent run directly on the host as an ordinary
process (fixtures from test_agent, through conftest)."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import signal

import pytest

from hostagent._agent import IN_CREATE, IN_DELETE, IN_ISDIR, IN_MOVED_FROM, AgentError
from tests.unit.test_agent import proc_state, until


async def _started(c, cmd: str, **kw):
    """Start ``cmd`` in the background; (pid future, exec task, collected output)."""
    pid: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    out: list[tuple[int, bytes]] = []
    task = asyncio.ensure_future(c.exec(cmd, background=True, on_start=pid.set_result, on_output=lambda s, d: out.append((s, d)), **kw))
    return await asyncio.wait_for(pid, 5), task, out


async def test_pid_is_reported_first(agent):
    pids: list[int] = []
    res = await agent.client.exec("echo $$", on_start=pids.append)
    assert pids == [res.pid] and res.stdout == f"{res.pid}\n".encode()


async def test_output_cap_keeps_the_head_and_counts_everything(agent):
    res = await agent.client.exec("head -c 300000 /dev/zero | tr '\\0' a; head -c 5000 /dev/zero >&2", cap=1000)
    assert res.stdout == b"a" * 1000 and res.stdout_bytes == 300000 and res.stdout_truncated
    assert len(res.stderr) == 1000 and res.stderr_bytes == 5000 and res.stderr_truncated
    small = await agent.client.exec("echo hi", cap=1000)
    assert small.stdout == b"hi\n" and small.stdout_bytes == 3 and not small.stdout_truncated


async def test_stdin_round_trip_and_close(agent):
    c = agent.client
    pid, task, out = await _started(c, "cat; echo eof", stdin=True)
    await c.send_stdin(pid, b"hello ")
    await c.send_stdin(pid, b"world\n")
    await until(lambda: b"".join(d for s, d in out if s == 1) == b"hello world\n", "echoed stdin")
    await c.send_stdin(pid, close=True)
    res = await asyncio.wait_for(task, 5)
    assert res.exit_code == 0 and b"".join(d for s, d in out) == b"hello world\neof\n"
    # The pipe is gone with the process; a command without a pipe refuses input.
    with pytest.raises(AgentError) as e:
        await c.send_stdin(pid, b"late")
    assert e.value.errno == errno.ESRCH
    pid2, task2, _ = await _started(c, "sleep 30")
    with pytest.raises(AgentError) as e:
        await c.send_stdin(pid2, b"x")
    assert e.value.errno == errno.EPIPE
    await c.signal(pid2, signal.SIGKILL)
    await task2


async def test_large_stdin_is_queued_in_order(agent):
    c = agent.client
    data = os.urandom(20 << 20)  # past the agent's 8 MiB queue, to a reader that starts late: EAGAIN, retried
    pid, task, out = await _started(c, "sleep 0.5; sha256sum", stdin=True)
    await c.send_stdin(pid, data, close=True)
    res = await asyncio.wait_for(task, 10)
    assert res.exit_code == 0
    assert b"".join(d for s, d in out if s == 1).split()[0].decode() == hashlib.sha256(data).hexdigest()


async def test_signal_ends_the_process_group_and_is_reported(agent):
    c = agent.client
    pid, task, _ = await _started(c, "sleep 100 & sleep 100; wait")
    await c.signal(pid, signal.SIGTERM)
    res = await asyncio.wait_for(task, 5)
    assert res.signal == signal.SIGTERM and res.exit_code == 128 + signal.SIGTERM
    with pytest.raises(AgentError) as e:
        await c.signal(pid, signal.SIGKILL)
    assert e.value.errno == errno.ESRCH
    # Only processes the agent started: not the agent itself, not an arbitrary pid.
    for stranger in (agent.proc.pid, os.getpid(), 1):
        with pytest.raises(AgentError) as e:
            await c.signal(stranger, signal.SIGKILL)
        assert e.value.errno == errno.ESRCH
    assert agent.proc.poll() is None


async def test_background_survives_disconnect_and_attach_reattaches(agent):
    c = agent.client
    pid, task, out = await _started(c, "i=0; while [ $i -lt 300 ]; do echo line$i; i=$((i+1)); sleep 0.01; done; exit 7")
    await until(lambda: out, "first output")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.1)  # it runs on without anyone attached (output discarded meanwhile)
    assert proc_state(pid) not in (None, "Z")
    listed = {p.pid: p for p in await c.processes()}
    assert pid in listed and listed[pid].background and not listed[pid].attached
    later: list[bytes] = []
    res = await asyncio.wait_for(c.attach(pid, on_output=lambda s, d: later.append(d)), 10)
    assert res.exit_code == 7 and res.pid == pid
    lines = b"".join(later).split()
    assert lines and lines[-1] == b"line299"
    # Ended and reported: forgotten.
    with pytest.raises(AgentError) as e:
        await c.attach(pid)
    assert e.value.errno == errno.ESRCH
    assert pid not in {p.pid for p in await c.processes()}


async def test_attach_after_the_end_gets_the_exit_status(agent):
    c = agent.client
    pid, task, _ = await _started(c, "sleep 0.3; exit 3")
    task.cancel()  # before it ends: nobody is attached when it does
    await until(lambda: proc_state(pid) is None, "command reaped")
    res = await c.attach(pid)
    assert res.exit_code == 3 and res.pid == pid


async def test_attach_busy_and_foreground_dies_with_its_connection(agent):
    c = agent.client
    pid, task, _ = await _started(c, "sleep 30")
    with pytest.raises(AgentError) as e:
        await c.attach(pid)
    assert e.value.errno == errno.EBUSY
    await c.signal(pid, signal.SIGKILL)
    await task
    pids: list[int] = []
    fg = asyncio.ensure_future(c.exec("sleep 30", on_start=pids.append))
    await until(lambda: pids, "foreground pid")
    fg.cancel()
    await until(lambda: proc_state(pids[0]) is None, "foreground command killed with its connection")


async def test_user_switch(agent):
    c = agent.client
    res = await c.exec("id -u; id -g; echo $HOME $USER; pwd", user="nobody")
    uid, gid, env, cwd = res.stdout.decode().splitlines()
    assert (uid, gid) == ("65534", "65534") and env == "/nonexistent nobody"
    assert cwd == str(agent.workdir)  # the home does not exist: the agent's own cwd
    res = await c.exec("id -u; pwd", user="daemon")
    assert res.stdout.decode().split() == ["1", "/usr/sbin"]  # daemon's home exists: it starts there
    assert (await c.exec("id -u", user="4321")).stdout == b"4321\n"
    with pytest.raises(AgentError) as e:
        await c.exec("true", user="no-such-user-xyz")
    assert e.value.errno == errno.ESRCH and "unknown user" in e.value.message


async def test_mkdir_rename(agent, tmp_path):
    c = agent.client
    d = tmp_path / "a" / "b" / "c"
    assert await c.mkdir(str(d), 0o750) is True
    assert d.is_dir() and (d.stat().st_mode & 0o777) == 0o750
    assert await c.mkdir(str(d)) is False
    (tmp_path / "f").write_text("x")
    with pytest.raises(AgentError) as e:
        await c.mkdir(str(tmp_path / "f"))
    assert e.value.errno == errno.EEXIST
    await c.rename(str(tmp_path / "f"), str(tmp_path / "new" / "g"))
    assert (tmp_path / "new" / "g").read_text() == "x" and not (tmp_path / "f").exists()
    with pytest.raises(AgentError) as e:
        await c.rename(str(tmp_path / "missing"), str(tmp_path / "h"))
    assert e.value.errno == errno.ENOENT


async def test_watch_reports_changes(agent, tmp_path):
    c = agent.client
    events: list[tuple[int, str]] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(c.watch(str(tmp_path), lambda m, n: events.append((m, n)), recursive=True, on_start=started.set))
    await asyncio.wait_for(started.wait(), 5)
    (tmp_path / "new.txt").write_text("1")
    (tmp_path / "sub").mkdir()
    await until(lambda: any(n == "sub" and m & IN_ISDIR for m, n in events), "dir create")
    (tmp_path / "sub" / "deep.txt").write_text("2")
    await until(lambda: any(n == "sub/deep.txt" and m & IN_CREATE for m, n in events), "create in a new subdir")
    (tmp_path / "new.txt").rename(tmp_path / "moved.txt")
    (tmp_path / "moved.txt").unlink()
    await until(lambda: any(n == "moved.txt" and m & IN_DELETE for m, n in events), "remove")
    assert any(n == "new.txt" and m & IN_CREATE for m, n in events)
    assert any(n == "new.txt" and m & IN_MOVED_FROM for m, n in events)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(AgentError) as e:
        await c.watch(str(tmp_path / "nope"), lambda m, n: None)
    assert e.value.errno == errno.ENOENT
