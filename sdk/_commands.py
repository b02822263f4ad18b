"""``sandbox.commands``: foreground and background commands, their streamed output, stdin, signals."""

from __future__ import annotations

import asyncio
import codecs
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, InvalidArgument, OutputLost, SandboxTimeout
from bus.messages import (
    Done,
    ExecChunk,
    ExecRequest,
    ExecResult,
    ProcConnect,
    ProcDisconnect,
    ProcessList,
    ProcessStarted,
    ProcInput,
    ProcList,
    ProcSignal,
    StreamAck,
)

from ._models import CommandResult, ProcessInfo
from .errors import CommandExitError, CommandTimeoutError

if TYPE_CHECKING:
    from ._async import AsyncSandbox

OutputHandler = Callable[[str], Any]
DEFAULT_OUTPUT_CAP = 8 << 20  # bytes of each stream a result keeps (the rest is counted, and streamed)
DRAIN_S = 30.0  # after the end message, how long chunks still on their way may take


def _check_timeout(timeout: Any) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 <= timeout <= 30 * 86400:
        raise InvalidArgument(f"timeout must be a number of seconds between 0 (no limit) and 30 days, got {timeout!r}")
    return float(timeout)


class _Output:
    """One stream_to inbox: numbered chunks in order (a gap is ``OutputLost``), flow-control acks,
    text to the callbacks (UTF-8 decoded across chunk boundaries), the end message."""

    def __init__(self, sb: "AsyncSandbox", on_stdout: OutputHandler | None, on_stderr: OutputHandler | None, keep: int) -> None:
        self.sb = sb
        self.inbox = sb.nc.new_inbox()
        self.handlers = {1: on_stdout, 2: on_stderr}
        self.decoders = {1: codecs.getincrementaldecoder("utf-8")("replace"), 2: codecs.getincrementaldecoder("utf-8")("replace")}
        self.keep = keep
        self.kept: dict[int, bytearray] = {1: bytearray(), 2: bytearray()}
        self.total = {1: 0, 2: 0}
        self.next_seq = 0
        self.error: DsecError | None = None
        self.end: asyncio.Future[ExecResult] = asyncio.get_running_loop().create_future()
        self._progress = asyncio.Event()
        self._sub: Any = None

    async def start(self) -> "_Output":
        self._sub = await self.sb.nc.subscribe(self.inbox, cb=self._on)
        return self

    async def close(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing: nothing more arrives anyway
                pass

    async def _on(self, msg: Any) -> None:
        try:
            m = codec.EXEC_STREAM.decode(msg.data)
        except BadRequest:
            return
        if isinstance(m, ExecResult):
            if not self.end.done():
                self.end.set_result(m)
            self._progress.set()
            return
        await self._chunk(m)

    async def _chunk(self, ch: ExecChunk) -> None:
        if ch.seq != self.next_seq and self.error is None:
            self.error = OutputLost(
                f"output of the command in sandbox {self.sb.sandbox_id} arrived with a gap: chunk {ch.seq} after {self.next_seq - 1}",
                expected=self.next_seq, got=ch.seq,
            )
        self.next_seq = max(self.next_seq, ch.seq + 1)
        self.total[ch.stream] = self.total.get(ch.stream, 0) + len(ch.data)
        kept = self.kept.get(ch.stream)
        if kept is not None and len(kept) < self.keep:
            kept += ch.data[: self.keep - len(kept)]
        fn = self.handlers.get(ch.stream)
        dec = self.decoders.get(ch.stream)
        if fn is not None and dec is not None:
            text = dec.decode(ch.data)
            if text:
                try:
                    r = fn(text)
                    if inspect.isawaitable(r):
                        await r
                except Exception as exc:  # noqa: BLE001 - surfaced by run()/wait(), streaming goes on
                    if self.error is None:
                        self.error = DsecError(f"on_{'stdout' if ch.stream == 1 else 'stderr'} raised {type(exc).__name__}: {exc}")
        if ch.ack:  # after the callback: a slow handler slows the command, nothing piles up here
            try:
                await self.sb.nc.publish(S.sbx(self.sb.sandbox_id, "ack"), codec.encode(StreamAck(stream_id=self.inbox, seq=ch.seq)))
            except Exception:  # noqa: BLE001 - the host gives up on us; the gap shows below
                pass
        self._progress.set()

    async def drain(self, chunks: int) -> None:
        """Wait until ``chunks`` chunks arrived (they travel apart from the reply); OutputLost if not."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + DRAIN_S
        while self.next_seq < chunks and loop.time() < deadline:
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), deadline - loop.time())
            except asyncio.TimeoutError:
                break
        for stream, dec in self.decoders.items():  # a trailing partial character
            fn = self.handlers.get(stream)
            tail = dec.decode(b"", final=True)
            if tail and fn is not None:
                r = fn(tail)
                if inspect.isawaitable(r):
                    await r
        if self.next_seq < chunks and self.error is None:
            self.error = OutputLost(
                f"{chunks - self.next_seq} of {chunks} output chunks of the command in sandbox {self.sb.sandbox_id} never arrived",
                expected=chunks, got=self.next_seq,
            )


def _result(res: ExecResult, stdout: bytes, stderr: bytes, error: str | None = None) -> CommandResult:
    return CommandResult(
        stdout=stdout.decode("utf-8", "replace"), stderr=stderr.decode("utf-8", "replace"), exit_code=res.exit_code,
        error=error, duration_ms=res.duration_ms, stdout_bytes=res.stdout_bytes, stderr_bytes=res.stderr_bytes,
        stdout_truncated=res.stdout_truncated, stderr_truncated=res.stderr_truncated, pid=res.pid, signal=res.signal,
    )


def _raise_for(out: CommandResult, timed_out: bool, timeout: float) -> CommandResult:
    if timed_out:
        out.error = f"command timed out after {timeout}s and was killed"
        raise CommandTimeoutError(out.error, out)
    if out.exit_code != 0:
        out.error = f"exit code {out.exit_code}"
        raise CommandExitError(out)
    return out


class AsyncCommandHandle:
    """A background command: its pid, output so far, stdin, signals; ``wait()`` for its end."""

    def __init__(self, sb: "AsyncSandbox", pid: int, output: _Output, tag: str = "", timeout: float = 0.0) -> None:
        self._sb = sb
        self.pid = pid
        self.tag = tag
        self._out = output
        self._timeout = timeout
        self.exit_code: int | None = None

    def __repr__(self) -> str:
        return f"AsyncCommandHandle(pid={self.pid}, sandbox={self._sb.sandbox_id!r})"

    @property
    def stdout(self) -> str:
        return bytes(self._out.kept[1]).decode("utf-8", "replace")

    @property
    def stderr(self) -> str:
        return bytes(self._out.kept[2]).decode("utf-8", "replace")

    async def wait(self, timeout: float | None = None) -> CommandResult:
        """Wait for the end (``timeout`` seconds, None: however long it runs); CommandExitError on a
        non-zero exit, OutputLost if output went missing on the way."""
        try:
            res = await asyncio.wait_for(asyncio.shield(self._out.end), timeout)
        except asyncio.TimeoutError:
            raise SandboxTimeout(f"process {self.pid} in sandbox {self._sb.sandbox_id} still runs after {timeout}s") from None
        await self._out.drain(res.chunks)
        await self._out.close()
        self.exit_code = res.exit_code
        if self._out.error is not None:
            raise self._out.error
        res.stdout_bytes = max(res.stdout_bytes, self._out.total[1])
        res.stderr_bytes = max(res.stderr_bytes, self._out.total[2])
        res.stdout_truncated = res.stdout_bytes > len(self._out.kept[1])
        res.stderr_truncated = res.stderr_bytes > len(self._out.kept[2])
        out = _result(res, bytes(self._out.kept[1]), bytes(self._out.kept[2]))
        return _raise_for(out, res.timed_out, self._timeout)

    async def kill(self, signal: int = 9) -> bool:
        """Send ``signal`` (SIGKILL by default) to the command's process group; False if it had ended."""
        try:
            await self._sb.commands.kill(self.pid, signal=signal)
            return True
        except DsecError as exc:
            if exc.code == "process_not_found":
                return False
            raise

    async def send_stdin(self, data: str | bytes) -> None:
        await self._sb.commands.send_stdin(self.pid, data)

    async def close_stdin(self) -> None:
        await self._sb.commands.close_stdin(self.pid)

    async def disconnect(self) -> None:
        """Stop receiving output here; the command keeps running (``commands.connect`` re-attaches)."""
        await self._out.close()
        try:
            await self._sb._request("proc", ProcDisconnect(pid=self.pid, stream_to=self._out.inbox), Done)
        except DsecError:
            pass  # sandbox or process gone: nothing streams anyway


class AsyncCommands:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    async def run(
        self,
        cmd: str,
        *,
        background: bool = False,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        timeout: float = 60,
        on_stdout: OutputHandler | None = None,
        on_stderr: OutputHandler | None = None,
        stdin: bool = False,
        tag: str = "",
        output_cap: int | None = None,
        trusted: bool = False,
    ) -> Any:
        """Run ``cmd`` with ``/bin/sh -c``.

        Foreground: wait for it; raise CommandExitError on a non-zero exit. The result keeps at most
        ``output_cap`` bytes of each stream (default: the host's, 8 MiB; ``*_truncated`` and the
        ``*_bytes`` totals say what there was), while ``on_stdout``/``on_stderr`` see every byte.
        ``background``: return an ``AsyncCommandHandle`` at once. ``timeout`` 0: no limit.
        ``user``: a user of the sandbox's /etc/passwd (its home is the default cwd).
        ``trusted``: for reward and test commands, a run that what the sandbox's own processes wrote
        cannot hijack: a fresh private HOME (created empty, 0700, removed after; the default cwd), a
        fixed PATH of system directories, only ``envs`` on top of a fixed minimal set (none of the
        sandbox's variables, no PYTHONPATH, LD_PRELOAD, BASH_ENV, ... unless given here), no Python
        user site-packages, git global config or shell startup files; the sandbox's files are left as
        they are. NotSupported where the sandbox's profile leaves system directories writable.
        """
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgument(f"cmd must be a non-empty string, got {cmd!r}")
        timeout = _check_timeout(timeout)
        if envs is not None and not (isinstance(envs, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in envs.items())):
            raise InvalidArgument("envs must be a dict of str to str")
        if user is not None and (not isinstance(user, str) or not user or ":" in user or "\0" in user):
            raise InvalidArgument(f"user must be a user name or uid, got {user!r}")
        if output_cap is not None and (isinstance(output_cap, bool) or not isinstance(output_cap, int) or output_cap < 0):
            raise InvalidArgument(f"output_cap must be a byte count >= 0, got {output_cap!r}")
        if not isinstance(trusted, bool):
            raise InvalidArgument(f"trusted must be True or False, got {trusted!r}")
        req = ExecRequest(
            cmd=cmd, envs=dict(envs or {}), cwd=cwd or "", timeout_s=timeout, user=user or "", stdin=bool(stdin), tag=tag,
            output_cap=-1 if output_cap is None else output_cap, background=background, acks=True, trusted=trusted,
        )
        stream: _Output | None = None
        if background:
            bg = await _Output(self._sb, on_stdout, on_stderr, DEFAULT_OUTPUT_CAP if output_cap is None else output_cap).start()
            req.stream_to = bg.inbox
            try:
                started = await self._sb._request("exec", req, ProcessStarted)
            except BaseException:
                await bg.close()
                raise
            return AsyncCommandHandle(self._sb, started.pid, bg, tag=tag, timeout=timeout)
        if on_stdout or on_stderr:
            stream = await _Output(self._sb, on_stdout, on_stderr, 0).start()
            req.stream_to = stream.inbox
        try:
            res: ExecResult = await self._sb._request("exec", req, ExecResult, timeout=(timeout or 86400) + 10)
            if stream is not None:
                await stream.drain(res.chunks)
        finally:
            if stream is not None:
                await stream.close()
        if stream is not None and stream.error is not None:
            raise stream.error
        return _raise_for(_result(res, res.stdout, res.stderr), res.timed_out, timeout)

    async def list(self) -> list[ProcessInfo]:
        """The commands running in the sandbox (background ones and foreground ones still going)."""
        res: ProcessList = await self._sb._request("proc", ProcList(), ProcessList)
        return [ProcessInfo(pid=p.pid, cmd=p.cmd, tag=p.tag, cwd=p.cwd, user=p.user, envs=dict(p.envs), stdin=p.stdin) for p in res.processes]

    async def kill(self, pid: int, *, signal: int = 9) -> bool:
        """Send ``signal`` to the command's process group; ProcessNotFound if there is no such command."""
        _check_pid(pid)
        await self._sb._request("proc", ProcSignal(pid=pid, signal=signal), Done)
        return True

    async def send_stdin(self, pid: int, data: str | bytes) -> None:
        _check_pid(pid)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"data must be str or bytes, got {type(data).__name__}")
        view = memoryview(data).cast("B")
        step = max(64 << 10, min(4 << 20, self._sb.nc.max_payload // 2))  # each request under the payload limit
        for off in range(0, max(len(view), 1), step):
            await self._sb._request("proc", ProcInput(pid=pid, data=bytes(view[off:off + step])), Done)

    async def close_stdin(self, pid: int) -> None:
        _check_pid(pid)
        await self._sb._request("proc", ProcInput(pid=pid, close=True), Done)

    async def connect(
        self, pid: int, *, on_stdout: OutputHandler | None = None, on_stderr: OutputHandler | None = None, timeout: float = 0,
    ) -> AsyncCommandHandle:
        """Re-attach to a running background command: its output from now on, and its end."""
        _check_pid(pid)
        out = await _Output(self._sb, on_stdout, on_stderr, DEFAULT_OUTPUT_CAP).start()
        try:
            started = await self._sb._request("proc", ProcConnect(pid=pid, stream_to=out.inbox, acks=True), ProcessStarted)
        except BaseException:
            await out.close()
            raise
        return AsyncCommandHandle(self._sb, started.pid, out, tag=started.tag, timeout=timeout)


def _check_pid(pid: Any) -> None:
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        raise InvalidArgument(f"pid must be a positive integer, got {pid!r}")


__all__ = ["AsyncCommands", "AsyncCommandHandle"]
