"""Command output of any size, background commands, stdin, signals, file watches, mkdir/rename and
metrics -- through the SDK, on real containerd sandboxes (the session ``stack``)."""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import time

import pytest

from sdk import CommandExitError, FilesystemEvent, ProcessNotFound, ReplyTooLarge, Sandbox, UnknownUser
from tests.conftest import eventually
from tests.integration.conftest import Stack, needs_stack

pytestmark = [pytest.mark.containerd, needs_stack]

MiB = 1 << 20
# 48 MiB of random bytes in base64: 64 MiB of ASCII (the callbacks get text), made before the timed run.
PREPARE = "head -c 50331648 /dev/urandom | base64 -w 0 > /tmp/out.b64 && sha256sum /tmp/out.b64"


class _Sink:
    """What a callback received: byte count and digest (the text re-encoded: the output is ASCII)."""

    def __init__(self) -> None:
        self.n = 0
        self.h = hashlib.sha256()

    def __call__(self, text: str) -> None:
        b = text.encode()
        self.n += len(b)
        self.h.update(b)


async def test_64_mib_of_stdout_streams_every_byte_and_returns_a_truncated_result(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=128) as sb:
        digest = (await sb.commands.run(PREPARE, timeout=60)).stdout.split()[0]
        sink = _Sink()
        # timeout=10 is the command's own limit: past 10 s it is killed (CommandTimeoutError).
        res = await sb.commands.run("cat /tmp/out.b64", on_stdout=sink, timeout=10)
        assert res.exit_code == 0
        assert sink.n == 64 * MiB and sink.h.hexdigest() == digest  # every byte, in order
        assert res.stdout_bytes == 64 * MiB and res.stdout_truncated and res.truncated
        assert 0 < len(res.stdout) <= 8 * MiB
        assert res.stdout.encode() == await sb.files.read("/tmp/out.b64", format="bytes", length=len(res.stdout))  # the head
        assert res.stderr == "" and res.stderr_bytes == 0 and not res.stderr_truncated
        # The same on stderr.
        sink_err = _Sink()
        res = await sb.commands.run("cat /tmp/out.b64 >&2", on_stderr=sink_err, timeout=10)
        assert sink_err.n == 64 * MiB and sink_err.h.hexdigest() == digest
        assert res.stderr_bytes == 64 * MiB and res.stderr_truncated and res.stdout == ""


async def test_big_output_without_callbacks_is_capped_not_a_timeout(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        # 16 MiB used to wait out the timeout and lose the reply (over max_payload).
        res = await sb.commands.run("head -c 16777216 /dev/zero | tr '\\0' x; echo tail >&2", timeout=10)
        assert res.stdout_bytes == 16 * MiB and res.stdout_truncated
        assert 0 < len(res.stdout) <= 8 * MiB and set(res.stdout) == {"x"}
        assert res.stderr == "tail\n" and not res.stderr_truncated  # the small stream keeps all of it
        # A cap per request.
        res = await sb.commands.run("head -c 5000 /dev/zero | tr '\\0' y", output_cap=1000)
        assert res.stdout == "y" * 1000 and res.stdout_bytes == 5000 and res.stdout_truncated
        small = await sb.commands.run("echo hi")
        assert small.stdout == "hi\n" and small.stdout_bytes == 3 and not small.truncated


async def test_64_mib_file_round_trip(stack: Stack) -> None:
    data = os.urandom(64 * MiB)
    async with stack.sandbox(memory_mb=128, disk_mb=512) as sb:
        w = await sb.files.write("/tmp/big.bin", data)
        assert w.size == len(data)
        got = await sb.files.read("/tmp/big.bin", format="bytes")
        assert len(got) == len(data) and hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        # The sandbox sees the same bytes.
        assert (await sb.commands.run("sha256sum /tmp/big.bin")).stdout.split()[0] == hashlib.sha256(data).hexdigest()
        # A range.
        assert await sb.files.read("/tmp/big.bin", format="bytes", offset=10 * MiB + 3, length=5 * MiB) == data[10 * MiB + 3:15 * MiB + 3]


async def test_a_reply_too_large_is_a_typed_error(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        # 33,000 entries with 250-byte names: a listing over the 8 MiB payload limit.
        prefix = "n" * 245
        await sb.commands.run(f"mkdir -p /tmp/huge && cd /tmp/huge && seq 10001 43000 | sed 's/^/{prefix}/' | xargs touch", timeout=60)
        with pytest.raises(ReplyTooLarge) as e:
            await sb.files.list("/tmp/huge")
        assert e.value.code == "reply_too_large" and "max_payload" in e.value.description
        assert (await sb.commands.run("ls /tmp/huge | wc -l")).stdout.strip() == "33000"  # the sandbox is fine


async def test_background_command_streams_and_its_stdin_round_trips(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        got: list[str] = []
        h = await sb.commands.run("cat; echo done-$((6*7))", background=True, stdin=True, on_stdout=got.append, timeout=0)
        assert h.pid > 0
        listed = {p.pid: p for p in await sb.commands.list()}
        assert h.pid in listed and listed[h.pid].cmd.startswith("cat;") and listed[h.pid].stdin
        await sb.commands.send_stdin(h.pid, "hello ")
        await h.send_stdin(b"world\n")
        await eventually(lambda: "".join(got) == "hello world\n", timeout=10, what="stdin echoed back")
        await h.close_stdin()
        res = await h.wait(timeout=10)
        assert res.exit_code == 0 and res.stdout == "hello world\ndone-42\n" and res.pid == h.pid
        assert "".join(got) == "hello world\ndone-42\n"
        assert h.pid not in {p.pid for p in await sb.commands.list()}
        # More stdin than one request (or the agent's 8 MiB queue) holds, to a slow reader.
        data = os.urandom(20 * MiB)
        h = await sb.commands.run("sleep 1; sha256sum", background=True, stdin=True, timeout=60)
        await h.send_stdin(data)
        await h.close_stdin()
        assert (await h.wait(timeout=30)).stdout.split()[0] == hashlib.sha256(data).hexdigest()


async def test_kill_sends_the_signal_and_unknown_pids_are_typed_errors(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        h = await sb.commands.run("sleep 300", background=True, timeout=0)
        await sb.commands.kill(h.pid, signal=signal.SIGTERM)
        with pytest.raises(CommandExitError) as e:
            await h.wait(timeout=10)
        assert e.value.result.signal == signal.SIGTERM and e.value.exit_code == 128 + signal.SIGTERM
        with pytest.raises(ProcessNotFound) as nf:
            await sb.commands.kill(h.pid)
        assert nf.value.code == "process_not_found"
        for bad in (999_999, 1):  # never started, and the agent itself (PID 1): not a command of ours
            with pytest.raises(ProcessNotFound):
                await sb.commands.kill(bad)
        with pytest.raises(ProcessNotFound):
            await sb.commands.send_stdin(999_999, "x")
        # The handle's kill: SIGKILL by default, False once it is gone.
        h2 = await sb.commands.run("sleep 300", background=True, timeout=0)
        assert await h2.kill() is True
        with pytest.raises(CommandExitError) as e:
            await h2.wait(timeout=10)
        assert e.value.result.signal == signal.SIGKILL
        assert await h2.kill() is False
        assert (await sb.commands.run("echo alive")).stdout == "alive\n"


async def test_connect_reattaches_to_a_running_command(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        first: list[str] = []
        h = await sb.commands.run(
            "i=0; while [ $i -lt 40 ]; do echo tick$i; i=$((i+1)); sleep 0.05; done; exit 3", background=True, on_stdout=first.append, timeout=0,
        )
        await eventually(lambda: "tick1\n" in "".join(first), timeout=10, what="first ticks")
        await h.disconnect()
        later: list[str] = []
        h2 = await sb.commands.connect(h.pid, on_stdout=later.append)
        assert h2.pid == h.pid
        with pytest.raises(CommandExitError) as e:
            await h2.wait(timeout=15)
        assert e.value.exit_code == 3
        text = "".join(later)
        assert text.endswith("tick39\n") and "tick0\n" not in text  # from the re-attach on, to the end
        # Connecting to an ended one tells its end; to an unknown one is a typed error.
        with pytest.raises(CommandExitError):
            await (await sb.commands.connect(h.pid)).wait(timeout=5)
        with pytest.raises(ProcessNotFound):
            await sb.commands.connect(999_999)


async def test_connect_after_the_host_agent_forgot_the_process(stack: Stack) -> None:
    """A host agent restart loses its process table and closes its agent connections; the agent
    keeps the background command running, and a connect attaches to it again (and to its end)."""
    async with stack.sandbox(memory_mb=64) as sb:
        h = await sb.commands.run("read line; echo got-$line; exit 5", background=True, stdin=True, timeout=0)
        await h.disconnect()
        tasks = [p.task for p in stack.host.execio._procs.pop(sb.sandbox_id).values()]  # a restart keeps nothing
        for t in tasks:
            assert t is not None
            t.cancel()  # closes the host's connection to the agent, as a dying host agent does
        await asyncio.gather(*tasks, return_exceptions=True)
        listed = {p.pid: p for p in await sb.commands.list()}
        assert h.pid in listed and listed[h.pid].stdin  # the agent still runs it
        out: list[str] = []
        h2 = await sb.commands.connect(h.pid, on_stdout=out.append)
        await sb.commands.send_stdin(h.pid, "x\n")
        with pytest.raises(CommandExitError) as e:
            await h2.wait(timeout=10)
        assert e.value.exit_code == 5 and "".join(out) == "got-x\n"


async def test_run_as_a_named_user(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        res = await sb.commands.run("id -u; id -g; echo $HOME $USER", user="nobody")
        assert res.stdout.split() == ["65534", "65534", "/nonexistent", "nobody"]
        assert (await sb.commands.run("pwd", user="root")).stdout == "/root\n"  # the user's home is the cwd
        assert (await sb.commands.run("pwd", user="root", cwd="/tmp")).stdout == "/tmp\n"
        with pytest.raises(UnknownUser) as e:
            await sb.commands.run("true", user="no-such-user")
        assert e.value.code == "unknown_user"


async def test_make_dir_rename_watch_dir(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=64) as sb:
        assert await sb.files.make_dir("/tmp/w/sub") is True
        assert await sb.files.make_dir("/tmp/w/sub") is False
        assert (await sb.files.get_info("/tmp/w/sub")).type == "dir"
        seen: list[FilesystemEvent] = []
        w = await sb.files.watch_dir("/tmp/w", on_event=seen.append)
        await sb.files.write("/tmp/w/new.txt", "1")
        await eventually(lambda: any(e.name == "new.txt" and e.type == "create" for e in seen), timeout=10, what="create event")
        moved = await sb.files.rename("/tmp/w/new.txt", "/tmp/w/sub/moved.txt")
        assert moved.path == "/tmp/w/sub/moved.txt" and moved.type == "file"
        await eventually(lambda: any(e.name == "new.txt" and e.type == "rename" for e in seen), timeout=10, what="rename event")
        assert await sb.files.read("/tmp/w/sub/moved.txt") == "1" and not await sb.files.exists("/tmp/w/new.txt")
        names = {(e.name, e.type) for e in w.get_new_events()}
        assert ("new.txt", "create") in names and ("new.txt", "rename") in names
        await w.stop()
        await sb.files.remove("/tmp/w")
        assert not await sb.files.exists("/tmp/w")


async def test_metrics_from_the_sandbox_cgroups(stack: Stack) -> None:
    async with stack.sandbox(memory_mb=96, cpu=0.5) as sb:
        await sb.commands.run("head -c 20000000 /dev/zero | md5sum")  # some CPU to account
        m = await sb.get_metrics()
        assert m.mem_used > 0 and m.mem_total == 96 * MiB
        assert m.cpu_count == 0.5 and m.cpu_usage_s > 0 and m.cpu_used_pct >= 0
        assert m.disk_total > 0


async def test_sync_sandbox_parity(stack: Stack) -> None:
    """The synchronous ``Sandbox`` (its own loop in a thread); run off this loop so the stack keeps serving."""
    sid = stack.new_id("sync")

    def body() -> None:
        with Sandbox.create(**stack.kw(memory_mb=64, sandbox_id=sid)) as sb:
            out: list[str] = []
            h = sb.commands.run("cat", background=True, stdin=True, on_stdout=out.append, timeout=0)
            assert h.pid in {p.pid for p in sb.commands.list()}
            sb.commands.send_stdin(h.pid, "ping\n")
            h.close_stdin()
            assert h.wait(timeout=10).stdout == "ping\n" and out == ["ping\n"]
            assert sb.files.make_dir("/tmp/s") is True
            assert sb.files.rename("/tmp/s", "/tmp/t").type == "dir"
            w = sb.files.watch_dir("/tmp/t")
            sb.files.write("/tmp/t/f", "x")
            events: list[FilesystemEvent] = []
            deadline = time.monotonic() + 10
            while not any(e.name == "f" and e.type == "create" for e in events) and time.monotonic() < deadline:
                time.sleep(0.05)  # poll interval
                events += w.get_new_events()
            assert any(e.name == "f" and e.type == "create" for e in events)
            w.stop()
            assert sb.get_metrics().mem_used > 0
            with pytest.raises(ProcessNotFound):
                sb.commands.kill(999_999)

    await asyncio.to_thread(body)
    await stack.assert_gone(sid)
