"""The in-sandbox agent (C) and its client, run directly on the host as an ordinary process."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import platform
import random
import resource
import shutil
import signal
import socket
import stat as stat_mod
import struct
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import cannot_run, needs

from hostagent import _agent
from hostagent._agent import (
    AgentBuildError,
    AgentClient,
    AgentError,
    AgentUnavailable,
    DirEntry,
    ExecOutcome,
    ensure_agent_binary,
    peer_pid,
)

U32 = struct.Struct(">I")


# ---------------------------------------------------------------------------------- helpers


async def until(pred, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        res = pred()
        if asyncio.iscoroutine(res):
            res = await res
        if res:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


def proc_state(pid: int) -> str | None:
    """Process state letter, or None once the pid no longer exists (i.e. it was reaped)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return data.rsplit(")", 1)[1].split()[0]


def is_dead(pid: int) -> bool:
    # A zombie is dead too: when the agent itself is gone, reaping is the host init's business.
    return proc_state(pid) in (None, "Z", "X")


def start_agent(
    binary: str, sock: str, cwd: Path, prefix: tuple[str, ...] = (), args: tuple[str, ...] = (),
) -> subprocess.Popen:
    # What the agent inherits must not reach commands: a marker variable in its environment,
    # Python's ignored SIGPIPE (restore_signals=False), and a low fd soft limit that the agent
    # raises for itself. The limit is set by prlimit, not a preexec_fn: Python code in a forked child
    # of this (multi-threaded: gRPC) test process can deadlock before exec, as the subprocess docs warn.
    return subprocess.Popen(
        [*prefix, PRLIMIT, f"--nofile={AGENT_NOFILE}:", "--", binary, "--socket", sock, *args], cwd=cwd,
        env={"AGENT_ONLY_VAR": "leak"}, stdin=subprocess.DEVNULL, restore_signals=False,
    )


AGENT_NOFILE = min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
PRLIMIT = shutil.which("prlimit") or "/usr/bin/prlimit"  # util-linux, in every Debian


def stop_agent(proc: subprocess.Popen, pid: int | None = None) -> None:
    if proc.poll() is not None:
        return
    os.kill(pid or proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        if pid:
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=5)


def basic(o: ExecOutcome) -> tuple:
    """What a command did, without its pid and byte counts."""
    return (o.exit_code, o.stdout, o.stderr, o.timed_out)


def frame(kind: bytes, *parts: bytes) -> bytes:
    return U32.pack(1 + sum(map(len, parts))) + kind + b"".join(parts)


def s(value: bytes) -> bytes:
    return U32.pack(len(value)) + value


async def raw_exchange(sock: str, payload: bytes, close_after_send: bool = False, until_close: bool = False) -> list[tuple[int, bytes]]:
    """Send raw bytes, collect reply frames up to the one that ends the request (the agent keeps the
    connection for the next one), or with ``until_close`` until the agent closes the connection."""
    frames = []
    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_unix_connection(sock)
        try:
            writer.write(payload)
            if close_after_send:
                return frames
            while True:
                try:
                    (n,) = U32.unpack(await reader.readexactly(4))
                    body = await reader.readexactly(n)
                except asyncio.IncompleteReadError as e:
                    assert e.partial == b"", "agent closed mid-frame"
                    return frames
                except ConnectionResetError:
                    # The agent closed with part of our request unread (e.g. an oversized frame).
                    return frames
                frames.append((body[0], body[1:]))
                if body[0] not in b"iOHwF" and not until_close:
                    return frames
        finally:
            writer.close()


class Agent:
    def __init__(self, proc: subprocess.Popen, sock: str, workdir: Path) -> None:
        self.proc = proc
        self.sock = sock
        self.workdir = workdir
        self.client = AgentClient(sock, expected_pid=proc.pid)


async def launch(binary: str, tmp: Path, args: tuple[str, ...] = ()) -> Agent:
    tmp.mkdir(parents=True, exist_ok=True)
    sock = str(tmp / "agent.sock")
    proc = start_agent(binary, sock, tmp, args=args)
    agent = Agent(proc, sock, tmp)
    try:
        await agent.client.wait_ready(timeout_s=10)
    except BaseException:
        stop_agent(proc)
        raise
    return agent


# ---------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def agent_binary(tmp_path_factory) -> str:
    return ensure_agent_binary(str(tmp_path_factory.mktemp("data")))


@pytest.fixture(scope="module")
async def agent(agent_binary, tmp_path_factory):
    a = await launch(agent_binary, tmp_path_factory.mktemp("agent"))
    yield a
    stop_agent(a.proc)
    assert a.proc.returncode == 0


@pytest.fixture
async def own_agent(agent_binary, tmp_path):
    """A private agent for tests that kill it or need its memory figures untouched."""
    started: list[Agent] = []

    async def make(*args: str) -> Agent:
        a = await launch(agent_binary, tmp_path / f"a{len(started)}", args)
        started.append(a)
        return a

    yield make
    for a in started:
        stop_agent(a.proc)


# ---------------------------------------------------------------------------------- build


def test_build_is_cached_by_source_hash(agent_binary, tmp_path_factory):
    digest = hashlib.sha256(_agent.AGENT_SOURCE.read_bytes()).hexdigest()[:12]
    path = Path(agent_binary)
    assert path.name == "dsec-agent" and path.parent.name == f"dsec-agent-{digest}"
    assert os.listdir(path.parent) == ["dsec-agent"]  # the dir is bind-mounted into sandboxes
    assert os.listdir(path.parent.parent) == [path.parent.name]  # no temp leftovers
    assert os.access(path, os.X_OK)
    mtime = path.stat().st_mtime_ns
    assert ensure_agent_binary(str(path.parent.parent.parent)) == agent_binary
    assert path.stat().st_mtime_ns == mtime
    # Static: no ELF interpreter (program header type PT_INTERP) to find inside a bare rootfs.
    with open(path, "rb") as f:
        elf = f.read(4096)
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    types = {struct.unpack_from("<I", elf, phoff + i * phentsize)[0] for i in range(phnum)}
    assert 3 not in types


def test_build_without_gcc_is_a_clear_error(tmp_path, monkeypatch):
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(AgentBuildError, match="gcc not found"):
        ensure_agent_binary(str(tmp_path / "data"))


def test_build_failure_leaves_nothing_behind(tmp_path, monkeypatch):
    bad = tmp_path / "bad.c"
    bad.write_text("int main(void) { return undefined_symbol; }\n")
    monkeypatch.setattr(_agent, "AGENT_SOURCE", bad)
    with pytest.raises(AgentBuildError, match="undefined_symbol"):
        ensure_agent_binary(str(tmp_path / "data"))
    assert os.listdir(tmp_path / "data" / "bin") == []


# ---------------------------------------------------------------------------------- connection


async def test_ping_and_peer_pid(agent):
    await agent.client.ping()
    assert await agent.client.peer_pid() == agent.proc.pid
    reader, writer = await asyncio.open_unix_connection(agent.sock)
    try:
        assert peer_pid(writer.get_extra_info("socket")) == agent.proc.pid
    finally:
        writer.close()
    assert stat_mod.S_IMODE(os.stat(agent.sock).st_mode) == 0o600


async def test_warm_agent_serves_nothing_until_confined_then_is_confined_as_at_a_cold_start(own_agent, tmp_path):
    """``--confine-on-claim`` (a warm container's agent): before the host's confine it answers only
    ping (EACCES for an exec or a file op); confine applies the Landlock rules to the agent and so to
    every command it starts, and a second confine changes nothing."""
    rw = tmp_path / "rw"
    a = await own_agent("--confine-on-claim", "--landlock-ro", "/", "--landlock-rw", str(rw), "--landlock-required")
    assert not (await a.client.ping()).landlock
    for refused in (a.client.exec(f"touch {tmp_path}/early"), a.client.write_file(str(tmp_path / "early"), b"x"), a.client.exists("/")):
        with pytest.raises(AgentError) as ei:
            await refused
        assert ei.value.errno == errno.EACCES and "not confined yet" in ei.value.message
    assert not (tmp_path / "early").exists()
    info = await a.client.confine()
    assert info.landlock and info.landlock_abi >= 1 and (await a.client.ping()).landlock
    assert await a.client.confine() == info
    # The control: where the rules allow it, a command and the agent's own file ops work ...
    ok = await a.client.exec(f"echo cmd > {rw}/f && cat {rw}/f")
    assert (ok.exit_code, ok.stdout) == (0, b"cmd\n")
    await a.client.write_file(str(rw / "g"), b"agent")
    assert (rw / "g").read_bytes() == b"agent"
    # ... and outside them Landlock refuses both (the same path is writable to this unconfined test).
    out = await a.client.exec(f"touch {tmp_path}/outside")
    assert out.exit_code != 0 and b"Permission denied" in out.stderr, out
    with pytest.raises(AgentError) as ei:
        await a.client.write_file(str(tmp_path / "outside"), b"x")
    assert ei.value.errno == errno.EACCES
    (tmp_path / "outside").write_bytes(b"host")


async def test_expected_pid_mismatch_is_refused(agent):
    impostor = AgentClient(agent.sock, expected_pid=agent.proc.pid + 100000)
    with pytest.raises(AgentError) as ei:
        await impostor.ping()
    assert ei.value.errno == errno.EPERM and not isinstance(ei.value, AgentUnavailable)
    with pytest.raises(AgentError):
        await impostor.exec("true")


async def test_unreachable_socket(tmp_path):
    with pytest.raises(AgentUnavailable) as ei:
        await AgentClient(str(tmp_path / "missing.sock")).ping()
    assert ei.value.errno == errno.ENOENT
    stale = tmp_path / "stale.sock"
    s_ = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s_.bind(str(stale))
    s_.close()  # a socket file nobody listens on, as after an agent crash
    with pytest.raises(AgentUnavailable) as ei:
        await AgentClient(str(stale)).exists("/")
    assert ei.value.errno == errno.ECONNREFUSED
    with pytest.raises(AgentUnavailable):
        await AgentClient(str(stale)).wait_ready(timeout_s=0.05)


async def test_long_socket_path(agent_binary, tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    sock = str(deep / "agent.sock")
    assert len(sock) > 108
    proc = start_agent(agent_binary, sock, tmp_path)
    try:
        client = AgentClient(sock, expected_pid=proc.pid)
        await client.wait_ready()
        assert (await client.exec("echo ok")).stdout == b"ok\n"
    finally:
        stop_agent(proc)
    assert proc.returncode == 0 and not os.path.exists(sock)


# ---------------------------------------------------------------------------------- exec


async def test_exec_exit_codes_and_streams(agent):
    c = agent.client
    assert basic(await c.exec("true")) == (0, b"", b"", False)
    res = await c.exec("echo out; echo err >&2; printf '\\000\\001\\377'; exit 3")
    assert basic(res) == (3, b"out\n\x00\x01\xff", b"err\n", False)
    assert (await c.exec("kill -9 $$")).exit_code == 137
    assert (await c.exec("kill -TERM $$")).exit_code == 143
    assert (await c.exec("no-such-command-xyz")).exit_code == 127


async def test_exec_environment(agent):
    c = agent.client
    # /usr/bin/env shows exactly what the command received (a shell may add PWD and the like).
    received = (await c.exec("/usr/bin/env")).stdout.splitlines()
    assert b"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin" in received
    assert b"HOME=/root" in received
    assert not any(line.startswith(b"AGENT_ONLY_VAR=") for line in received)
    received = (await c.exec("/usr/bin/env", env={"A": "1", "B": "x y=z"})).stdout.splitlines()
    assert {b"A=1", b"B=x y=z"} <= set(received)
    assert not any(line.startswith((b"PATH=", b"HOME=")) for line in received)  # the map is the whole env
    with pytest.raises(ValueError):
        await c.exec("true", env={"A=B": "1"})


async def test_exec_cwd(agent, tmp_path):
    c = agent.client
    assert (await c.exec("pwd", cwd=str(tmp_path))).stdout == f"{tmp_path}\n".encode()
    assert (await c.exec("pwd")).stdout == f"{agent.workdir}\n".encode()  # agent's own cwd
    with pytest.raises(AgentError) as ei:
        await c.exec("pwd", cwd=str(tmp_path / "missing"))
    assert ei.value.errno == errno.ENOENT and "missing" in ei.value.message
    (tmp_path / "f").write_text("x")
    with pytest.raises(AgentError) as ei:
        await c.exec("pwd", cwd=str(tmp_path / "f"))
    assert ei.value.errno == errno.ENOTDIR


async def test_exec_child_isolation(agent):
    c = agent.client
    # Own session and process group; stdin is /dev/null; no agent fds leak into the command.
    res = await c.exec("read -r pid comm state ppid pgrp sid rest < /proc/self/stat; echo $pid $pgrp $sid")
    pid, pgrp, sid = res.stdout.split()
    assert pid == pgrp == sid
    assert (await c.exec("readlink /proc/self/fd/0")).stdout == b"/dev/null\n"
    assert (await c.exec("cat")).stdout == b""
    fds = (await c.exec("ls /proc/self/fd")).stdout.split()
    assert (await c.exec("ulimit -n")).stdout == f"{AGENT_NOFILE}\n".encode()
    assert set(fds) <= {b"0", b"1", b"2", b"3"}  # 3 is ls's own directory handle
    # The agent was started with SIGPIPE ignored (see start_agent): commands still get defaults.
    status = (await c.exec("grep -E '^Sig(Blk|Ign)' /proc/self/status")).stdout.split()
    assert status == [b"SigBlk:", b"0" * 16, b"SigIgn:", b"0" * 16]


async def test_exec_streams_output_live(agent, tmp_path):
    flag = tmp_path / "go"
    seen: list[tuple[int, bytes]] = []

    def on_output(stream: int, data: bytes) -> None:
        seen.append((stream, data))
        if b"ready" in data:
            flag.touch()  # the command only finishes once it sees this, so output must be live

    res = await agent.client.exec(
        f"echo ready; while [ ! -e {flag} ]; do sleep 0.005; done; echo done >&2",
        on_output=on_output, timeout_s=10,
    )
    assert not res.timed_out and res.exit_code == 0
    assert seen[0] == (1, b"ready\n") and (2, b"done\n") in seen
    assert res.stdout == b"ready\n" and res.stderr == b"done\n"

    chunks: list[bytes] = []

    async def async_cb(stream: int, data: bytes) -> None:
        await asyncio.sleep(0)
        chunks.append(data)

    res = await agent.client.exec("seq 1 20000", on_output=async_cb)
    assert b"".join(chunks) == res.stdout == b"".join(b"%d\n" % i for i in range(1, 20001))


async def test_exec_timeout_kills_process_group(agent):
    bg_pid: list[int] = []

    def grab(stream: int, data: bytes) -> None:
        bg_pid.extend(int(x) for x in data.split())

    t0 = time.monotonic()
    res = await agent.client.exec("sleep 30 & echo $!; sleep 30; echo never", timeout_s=0.3, on_output=grab)
    assert time.monotonic() - t0 < 5
    assert res.timed_out and res.exit_code == 137 and res.stdout.strip() == str(bg_pid[0]).encode()
    # The background sleep was in the same process group, and the agent (its subreaper) reaps it.
    await until(lambda: proc_state(bg_pid[0]) is None, "background child killed and reaped")
    assert (await agent.client.exec("echo still up")).stdout == b"still up\n"
    res = await agent.client.exec("echo quick", timeout_s=5)
    assert basic(res) == (0, b"quick\n", b"", False)


async def test_exec_returns_when_shell_exits_despite_background_children(agent):
    # The background sleep holds stdout open; waiting for EOF would hang until the timeout.
    res = await agent.client.exec("sleep 30 & echo $$ $!", timeout_s=10)
    pgid, bg = map(int, res.stdout.split())
    try:
        assert not res.timed_out and res.exit_code == 0
        assert not is_dead(bg)
    finally:
        os.killpg(pgid, signal.SIGKILL)
    await until(lambda: proc_state(bg) is None, "background child reaped by the agent")


async def test_cancelled_exec_kills_process_group(agent):
    pids: list[int] = []
    started = asyncio.Event()

    def grab(stream: int, data: bytes) -> None:
        pids.extend(int(x) for x in data.split())
        started.set()

    task = asyncio.create_task(agent.client.exec("sleep 30 & echo $$ $!; wait", on_output=grab))
    async with asyncio.timeout(5):
        await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for pid in pids:
        await until(lambda pid=pid: proc_state(pid) is None, f"pid {pid} killed after disconnect")
    await agent.client.ping()


async def test_many_concurrent_execs(agent):
    c = agent.client
    slow = asyncio.create_task(c.exec("sleep 0.5; echo slow"))
    results = await asyncio.gather(*(c.exec(f"echo {i}; echo e{i} >&2; exit {i % 7}") for i in range(100)))
    for i, res in enumerate(results):
        assert basic(res) == (i % 7, f"{i}\n".encode(), f"e{i}\n".encode(), False)
    assert not slow.done()  # a running command doesn't hold anything up
    assert (await slow).stdout == b"slow\n"


def _agent_sockets(pid: int) -> int:
    """Connected sockets the agent holds (its listening socket not counted)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return n - 1


async def test_connections_are_reused(own_agent):
    a = await own_agent()
    c = a.client
    assert c.keeps_connections  # protocol 3, learnt from wait_ready's ping
    await c.exec("true")
    (first,) = c._idle
    for i in range(20):
        assert basic(await c.exec(f"echo {i}")) == (0, f"{i}\n".encode(), b"", False)
        assert await c.exists("/")
    assert c._idle == [first] and _agent_sockets(a.proc.pid) == 1  # one connection carried all 40 requests
    # An error answer: the next call takes a fresh connection (the agent may close after an error).
    with pytest.raises(AgentError):
        await c.read_file("/nonexistent")
    assert first.transport.is_closing() and len(c._idle) == 0
    await c.ping()
    (second,) = c._idle
    # Something unexpected arrived on an idle connection: it is not reused.
    second.data_received(b"junk")
    assert basic(await c.exec("echo ok")) == (0, b"ok\n", b"", False)
    assert second.transport.is_closing() and c._idle and c._idle[0] is not second
    # Concurrent calls each take a connection; at most _IDLE_MAX stay open afterwards.
    await asyncio.gather(*(c.exec("sleep 0.1") for _ in range(10)))
    assert len(c._idle) == _agent._IDLE_MAX
    await until(lambda: _agent_sockets(a.proc.pid) == _agent._IDLE_MAX, "the agent closed the connections we let go")
    # Before a freeze: hung up, and the agent has closed its ends by the time this returns.
    await c.hang_up_idle()
    assert not c._idle and _agent_sockets(a.proc.pid) == 0
    await c.exec("true")
    c.close_idle()
    await until(lambda: _agent_sockets(a.proc.pid) == 0, "the agent closed the connection after close_idle")


class _Transport:
    def __init__(self) -> None:
        self.paused = False

    def pause_reading(self) -> None:
        self.paused = True

    def resume_reading(self) -> None:
        self.paused = False

    def is_closing(self) -> bool:
        return False


async def test_reply_buffer_pauses_between_frames_never_inside_one():
    conn = _agent._Conn()
    t = _Transport()
    conn.connection_made(t)
    big = b"T" + b"x" * (3 * _agent._BUF_HIGH)  # one listing three times the pause mark
    data = U32.pack(len(big)) + big
    for off in range(0, len(data), 1 << 20):
        assert not t.paused  # a frame must arrive whole: pausing inside it would wait forever
        conn.data_received(data[off:off + (1 << 20)])
    assert await conn.frame() == (ord("T"), big[1:])
    assert not t.paused and not conn.buf
    chunk = frame(b"O", b"\x01" + b"y" * (1 << 20))
    while not t.paused:  # whole frames nobody takes: reading stops
        conn.data_received(chunk)
    assert len(conn.buf) <= _agent._BUF_HIGH + len(chunk)
    while conn.buf:
        assert await conn.frame() == (ord("O"), chunk[5:])
    assert not t.paused  # taken: reading goes on


async def test_raw_requests_follow_each_other_on_one_connection(agent):
    async def reply(reader: asyncio.StreamReader, last: bytes) -> bytes:
        kinds = b""
        while not kinds.endswith(last):
            (n,) = U32.unpack(await reader.readexactly(4))
            kinds += (await reader.readexactly(n))[:1]
        return kinds

    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_unix_connection(agent.sock)
        try:
            for _ in range(3):
                writer.write(frame(b"X", U32.pack(0), s(b"echo hi"), s(b""), U32.pack(0), b"\x00", s(b"")))
                assert await reply(reader, b"E") == b"iOE"
                writer.write(frame(b"P"))
                assert await reply(reader, b"K") == b"K"
        finally:
            writer.close()


async def test_large_output_both_streams(agent):
    res = await agent.client.exec("head -c 6000000 /dev/zero & head -c 3000000 /dev/urandom >&2; wait")
    assert res.exit_code == 0
    assert res.stdout == b"\0" * 6000000 and len(res.stderr) == 3000000


async def test_timeouts_of_many_commands_at_once(agent):
    # The agent keeps every command's timers itself (no timer fd per command): each fires on its own.
    c = agent.client
    res = await asyncio.gather(*(c.exec(f"sleep 30; echo never {i}", timeout_s=0.1 + 0.05 * i) for i in range(8)),
                               *(c.exec(f"sleep 0.2; echo done {i}", timeout_s=30) for i in range(8)))
    assert all(r.timed_out and r.exit_code == 137 and r.stdout == b"" for r in res[:8])
    assert [basic(r) for r in res[8:]] == [(0, f"done {i}\n".encode(), b"", False) for i in range(8)]


SYSCALL_WRITE = {"x86_64": 1, "aarch64": 64}.get(platform.machine())


@needs(None if SYSCALL_WRITE is not None else "write(2) syscall number unknown on this arch")
async def test_slow_client_throttles_command(own_agent):
    """A client that stops reading must stall the command, not grow the agent's memory."""
    a = await own_agent()
    reader, writer = await asyncio.open_unix_connection(a.sock)
    try:
        writer.write(frame(b"X", U32.pack(0), s(b"echo $$ >&2; exec head -c 200000000 /dev/zero"), s(b""), U32.pack(0), b"\x00", s(b"")))
        pid = None
        async with asyncio.timeout(5):
            while pid is None:
                (n,) = U32.unpack(await reader.readexactly(4))
                body = await reader.readexactly(n)
                if body[:2] == b"O\x02":
                    pid = int(body[2:])

        def blocked_in_write() -> bool:
            try:
                return Path(f"/proc/{pid}/syscall").read_text().split()[0] == str(SYSCALL_WRITE)
            except (FileNotFoundError, IndexError):
                return False

        await until(blocked_in_write, "producer blocked on a full pipe")
        rss_kb = int(next(line for line in Path(f"/proc/{a.proc.pid}/status").read_text().splitlines()
                          if line.startswith("VmHWM:")).split()[1])
        assert rss_kb < 16 * 1024, f"agent peaked at {rss_kb} kB"
    finally:
        writer.close()
    await until(lambda: proc_state(pid) is None, "producer killed after disconnect")


async def test_heartbeats_keep_a_quiet_exec_alive(own_agent, monkeypatch):
    a = await own_agent("--heartbeat-ms", "20")
    monkeypatch.setattr(_agent, "_EXEC_IDLE_S", 0.15)
    res = await a.client.exec("sleep 0.5; echo done")
    assert basic(res) == (0, b"done\n", b"", False)
    frames = await raw_exchange(a.sock, frame(b"X", U32.pack(0), s(b"sleep 0.2"), s(b""), U32.pack(0), b"\x00", s(b"")))
    kinds = [k for k, _ in frames]
    assert kinds.count(ord("H")) >= 3 and kinds[-1] == ord("E")


async def test_buffered_output_comes_with_the_exit_or_a_heartbeat(own_agent, monkeypatch):
    a = await own_agent("--heartbeat-ms", "50")
    x = frame(b"X", U32.pack(0), s(b"echo a; sleep 0.3; echo b"), s(b""), U32.pack(0), b"\x04", s(b""))
    kinds = bytes(k for k, _ in await raw_exchange(a.sock, x))
    # "a" went out with a heartbeat, before "b" was written; "b" comes with the exit or, when the
    # exit lags a heartbeat behind it on a loaded machine, with that heartbeat.
    assert kinds.startswith(b"iOH") and kinds.endswith(b"E") and kinds.count(b"O") == 2
    assert kinds.rstrip(b"HE").endswith(b"O")
    a = await own_agent()  # the default heartbeat (5 s): a short command's frames all come at its exit
    frames = await raw_exchange(a.sock, frame(b"X", U32.pack(0), s(b"echo a; sleep 0.2; echo b >&2"), s(b""), U32.pack(0), b"\x04", s(b"")))
    assert [(k, b) for k, b in frames[1:]] == [(ord("O"), b"\x01a\n"), (ord("O"), b"\x02b\n"), (ord("E"), b"\0\0\0\0\0\0")]
    # Output that keeps coming in small pieces, read by nobody: the heartbeats carry it, the host's
    # idle timeout never trips.
    a = await own_agent("--heartbeat-ms", "50")
    monkeypatch.setattr(_agent, "_EXEC_IDLE_S", 0.2)
    res = await a.client.exec("for i in 1 2 3 4 5 6 7 8; do echo $i; sleep 0.1; done")
    assert basic(res) == (0, b"".join(b"%d\n" % i for i in range(1, 9)), b"", False)


async def test_client_gives_up_on_a_silent_agent(tmp_path, monkeypatch):
    async def mute(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # swallow the request, never answer, return once the client leaves
        writer.close()

    sock = str(tmp_path / "mute.sock")
    server = await asyncio.start_unix_server(mute, sock)
    try:
        client = AgentClient(sock, op_timeout_s=0.1)
        with pytest.raises(AgentUnavailable) as ei:
            await client.read_file("/etc/hostname")
        assert ei.value.errno == errno.ETIMEDOUT
        monkeypatch.setattr(_agent, "_EXEC_IDLE_S", 0.1)
        with pytest.raises(AgentUnavailable) as ei:
            await client.exec("true")
        assert ei.value.errno == errno.ETIMEDOUT
        # The hard deadline (exec timeout + grace) holds even when the idle guard would not trip.
        monkeypatch.setattr(_agent, "_EXEC_IDLE_S", 60)
        monkeypatch.setattr(_agent, "_EXEC_GRACE_S", 0.1)
        with pytest.raises(AgentUnavailable):
            await client.exec("true", timeout_s=0.05)
    finally:
        server.close()
        await server.wait_closed()


async def test_agent_death_mid_exec_is_unavailable(own_agent):
    a = await own_agent()
    pgids: list[int] = []
    started = asyncio.Event()

    def grab(stream: int, data: bytes) -> None:
        pgids.append(int(data))
        started.set()

    task = asyncio.create_task(a.client.exec("echo $$; sleep 30", on_output=grab))
    async with asyncio.timeout(5):
        await started.wait()
    a.proc.kill()
    a.proc.wait(timeout=5)
    try:
        with pytest.raises(AgentUnavailable):
            await task
        with pytest.raises(AgentUnavailable):
            await a.client.ping()
    finally:
        os.killpg(pgids[0], signal.SIGKILL)  # a SIGKILLed agent can't clean up after itself


async def test_sigterm_exits_cleanly_and_kills_running_commands(own_agent):
    a = await own_agent()
    pids: list[int] = []
    started = asyncio.Event()

    def grab(stream: int, data: bytes) -> None:
        pids.extend(int(x) for x in data.split())
        started.set()

    task = asyncio.create_task(a.client.exec("sleep 30 & echo $$ $!; wait", on_output=grab))
    async with asyncio.timeout(5):
        await started.wait()
    a.proc.terminate()
    assert a.proc.wait(timeout=5) == 0
    with pytest.raises(AgentUnavailable):
        await task
    assert not os.path.exists(a.sock)
    for pid in pids:
        await until(lambda pid=pid: is_dead(pid), f"pid {pid} killed on agent shutdown")


# ---------------------------------------------------------------------------------- files


async def test_write_read_roundtrip(agent, tmp_path):
    c = agent.client
    p = str(tmp_path / "a" / "b" / "c.txt")
    assert await c.write_file(p, b"hello world") == 11  # parents are created
    assert await c.read_file(p) == (b"hello world", 11)
    assert await c.read_file(p, offset=6) == (b"world", 11)
    assert await c.read_file(p, offset=6, length=3) == (b"wor", 11)
    assert await c.read_file(p, offset=100) == (b"", 11)
    assert await c.read_file(p, length=0) == (b"", 11)
    # In-place write without truncation, then a sparse write past the end.
    assert await c.write_file(p, b"HELLO", truncate=False) == 11
    assert await c.write_file(p, b"!", offset=13, truncate=False) == 14
    assert Path(p).read_bytes() == b"HELLO world\0\0!"
    assert await c.write_file(p, b"new") == 3
    assert Path(p).read_bytes() == b"new"
    assert await c.write_file(p, b"") == 0


async def test_write_mode_applies_on_create(agent, tmp_path):
    c = agent.client
    p = tmp_path / "script.sh"
    await c.write_file(str(p), b"#!/bin/sh\n", mode=0o755)
    assert stat_mod.S_IMODE(p.stat().st_mode) == 0o755  # exact, not reduced by the umask
    os.chmod(p, 0o700)
    await c.write_file(str(p), b"#!/bin/sh\necho hi\n")
    assert stat_mod.S_IMODE(p.stat().st_mode) == 0o700
    await c.write_file(str(tmp_path / "secret"), b"x", mode=0o600)
    assert stat_mod.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600


async def test_large_file_roundtrip(agent, tmp_path):
    c = agent.client
    data = random.randbytes(9 * 1024 * 1024 + 123)  # spans three 4 MiB frames each way
    p = str(tmp_path / "big.bin")
    assert await c.write_file(p, data) == len(data)
    assert Path(p).read_bytes() == data
    assert await c.read_file(p) == (data, len(data))
    got, size = await c.read_file(p, offset=1000, length=5 * 1024 * 1024)
    assert got == data[1000:1000 + 5 * 1024 * 1024] and size == len(data)
    exact = data[: 4 * 1024 * 1024]
    await c.write_file(p, exact)
    assert await c.read_file(p) == (exact, len(exact))


async def test_read_procfs_file(agent):
    data, size = await agent.client.read_file("/proc/self/status")
    assert size == 0 and b"Name:\tdsec-agent" in data


async def test_file_errors(agent, tmp_path):
    c = agent.client
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    os.mkfifo(tmp_path / "fifo")
    cases = [
        (c.read_file(str(tmp_path / "missing")), errno.ENOENT),
        (c.read_file(str(tmp_path / "dir")), errno.EISDIR),
        (c.read_file(str(tmp_path / "fifo")), errno.EINVAL),
        (c.write_file(str(tmp_path / "fifo"), b"x"), errno.ENXIO),  # a FIFO without reader
        (c.write_file(str(tmp_path / "dir"), b"x"), errno.EISDIR),
        (c.write_file(str(tmp_path / "file" / "sub"), b"x"), errno.ENOTDIR),
        (c.write_file("", b"x"), errno.EINVAL),
        (c.list_dir(str(tmp_path / "file")), errno.ENOTDIR),
        (c.list_dir(str(tmp_path / "missing")), errno.ENOENT),
        (c.remove(str(tmp_path / "missing")), errno.ENOENT),
        (c.stat(str(tmp_path / "missing")), errno.ENOENT),
        (c.read_file(str(tmp_path / "nul\0byte")), errno.EINVAL),
    ]
    for coro, code in cases:
        with pytest.raises(AgentError) as ei:
            await coro
        assert ei.value.errno == code, ei.value
        assert not isinstance(ei.value, AgentUnavailable)


async def test_list_dir_and_stat(agent, tmp_path):
    c = agent.client
    (tmp_path / "f.txt").write_bytes(b"12345")
    os.chmod(tmp_path / "f.txt", 0o640)
    (tmp_path / "sub").mkdir()
    os.symlink("f.txt", tmp_path / "link")
    os.symlink("nowhere", tmp_path / "dangling")
    os.mkfifo(tmp_path / "pipe")
    entries = await c.list_dir(str(tmp_path))
    by_name = {e.name: e for e in entries}
    assert [e.name for e in entries] == sorted(by_name)
    assert {n: e.type for n, e in by_name.items()} == {
        "f.txt": "file", "sub": "dir", "link": "symlink", "dangling": "symlink", "pipe": "other",
    }
    f = by_name["f.txt"]
    st = os.stat(tmp_path / "f.txt")
    assert f == DirEntry("f.txt", f"{tmp_path}/f.txt", "file", 5, 0o640, st.st_mtime_ns / 1e9)
    assert await c.list_dir(str(tmp_path / "sub")) == []

    assert await c.stat(str(tmp_path / "f.txt")) == f
    linked = await c.stat(str(tmp_path / "link"))
    assert (linked.name, linked.type, linked.size) == ("link", "file", 5)
    assert (await c.stat(str(tmp_path / "link"), follow_symlinks=False)).type == "symlink"
    assert (await c.stat(str(tmp_path) + "/")).type == "dir"
    assert (await c.stat("/")).name == "/"


async def test_exists_and_remove(agent, tmp_path):
    c = agent.client
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "f").write_text("x")
    (tree / "top").write_text("y")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("k")
    os.symlink(outside, tree / "a" / "link-to-outside")
    os.symlink("nowhere", tmp_path / "dangling")

    assert await c.exists(str(tree / "a" / "b" / "f"))
    assert await c.exists(str(tmp_path / "dangling"))
    assert not await c.exists(str(tmp_path / "nope"))
    assert not await c.exists(str(tree / "top" / "under-a-file"))

    await c.remove(str(tree / "top"))
    assert not (tree / "top").exists()
    await c.remove(str(tmp_path / "dangling"))
    assert not os.path.lexists(tmp_path / "dangling")
    await c.remove(str(tree))
    assert not tree.exists()
    assert (outside / "keep").read_text() == "k"  # symlinks inside are removed, not followed


# ---------------------------------------------------------------------------------- robustness


MALFORMED = [
    (b"\0\0\0\0", errno.EPROTO),
    (U32.pack((8 << 20) + 1) + b"P", errno.EMSGSIZE),
    (frame(b"Z"), errno.EPROTO),
    (frame(b"P", b"trailing"), errno.EPROTO),
    (frame(b"G", b"\0\0\0"), errno.EPROTO),
    (frame(b"L", U32.pack(0xFFFFFFFF) + b"abc"), errno.EPROTO),
    (frame(b"X", U32.pack(0), s(b"true"), s(b""), U32.pack(0xFFFFFFFF)), errno.EPROTO),
    (frame(b"X", U32.pack(0), s(b"true"), s(b""), U32.pack(0), b"\x00", s(b""), b"junk"), errno.EPROTO),
    (frame(b"X", U32.pack(0), s(b"tr\0ue"), s(b""), U32.pack(0), b"\x00", s(b"")), errno.EINVAL),
    (frame(b"S", b"\1", s(b"/tm\0p")), errno.EINVAL),
]


@pytest.mark.parametrize("payload,code", MALFORMED)
async def test_malformed_frames_get_an_error_and_close(agent, payload, code):
    frames = await raw_exchange(agent.sock, payload, until_close=True)
    assert len(frames) == 1 and frames[0][0] == ord("R"), frames
    assert U32.unpack_from(frames[0][1])[0] == code
    await agent.client.ping()


async def test_truncated_and_abandoned_connections(agent):
    await raw_exchange(agent.sock, b"", close_after_send=True)
    await raw_exchange(agent.sock, b"\0\0", close_after_send=True)
    await raw_exchange(agent.sock, U32.pack(100) + b"L" + b"x" * 10, close_after_send=True)
    # An exec whose client vanishes right after asking.
    await raw_exchange(agent.sock, frame(b"X", U32.pack(0), s(b"sleep 30"), s(b""), U32.pack(0), b"\x00", s(b"")), close_after_send=True)
    await agent.client.ping()


async def test_fuzzed_requests_never_kill_the_agent(agent):
    rng = random.Random(1234)
    # Only side-effect-free request types: random exec/write/remove could do real damage.
    for _ in range(300):
        kind = rng.choice(b"PGLQSAz\xff")
        body = rng.randbytes(rng.choice([0, 1, 3, 4, 8, 17, 64]))
        if rng.random() < 0.5 and len(body) >= 4:
            body = U32.pack(rng.choice([0, 1, len(body), 0xFFFFFFFF])) + body[4:]
        frames = await raw_exchange(agent.sock, frame(bytes([kind]), body))
        assert frames, "agent must answer every complete frame"
    assert agent.proc.poll() is None
    await agent.client.ping()


# ---------------------------------------------------------------------------------- PID 1


def _unshare_works() -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True)
    return probe.returncode == 0


async def test_as_pid1_reaps_orphans_and_stops_on_sigterm(agent_binary, tmp_path):
    if not _unshare_works():
        cannot_run("cannot create a pid namespace here (unshare --pid)")
    sock = str(tmp_path / "agent.sock")
    proc = start_agent(agent_binary, sock, tmp_path, prefix=("unshare", "--pid", "--fork", "--mount-proc"))
    agent_pid = None
    try:
        client = AgentClient(sock)
        await client.wait_ready()
        agent_pid = await client.peer_pid()
        nspid = next(line for line in Path(f"/proc/{agent_pid}/status").read_text().splitlines()
                     if line.startswith("NSpid:")).split()
        assert nspid[-1] == "1"
        client = AgentClient(sock, expected_pid=agent_pid)

        # Orphans get reparented to PID 1; each must be reaped, not left as a zombie.
        res = await client.exec("for i in 1 2 3 4 5; do (sleep 0.05 &); done; echo started")
        assert res.stdout == b"started\n"
        survey = "for f in /proc/[0-9]*/stat; do read -r p c st rest < $f && echo $c $st; done 2>/dev/null"

        async def settled() -> bool:
            lines = (await client.exec(survey)).stdout.decode().splitlines()
            return not any(line.startswith("(sleep)") or line.endswith(" Z") for line in lines)

        await until(settled, "orphans exited and reaped")
        assert (await client.exec("echo $$")).exit_code == 0

        os.kill(agent_pid, signal.SIGTERM)
        assert proc.wait(timeout=5) == 0
    finally:
        stop_agent(proc, agent_pid)


# ---------------------------------------------------------------------------------- benchmark


async def test_benchmark_exec_round_trip(agent, capsys):
    c = agent.client
    for _ in range(20):
        await c.exec("true")
    samples = []
    for _ in range(200):
        t0 = time.perf_counter()
        await c.exec("true")
        samples.append(time.perf_counter() - t0)
    samples.sort()
    with capsys.disabled():
        print(f"\n[dsec-agent] exec('true') round trip over 200 runs: "
              f"p50 {samples[100] * 1e3:.3f} ms, p90 {samples[180] * 1e3:.3f} ms, max {samples[-1] * 1e3:.3f} ms")
