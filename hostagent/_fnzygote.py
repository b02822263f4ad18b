"""A pre-started Python interpreter per fn pool member, so a ``python3 main.py`` call does not pay
the interpreter's start (tens of milliseconds here) on its hot path.

How: right after a member is reset (off the hot path), the host starts in it, through its agent, an
ordinary exec of ``python3 -c ZYGOTE`` with exactly the environment, working directory, output cap
and trusted flag a call would get, and a stdin pipe. The interpreter starts (site, ``.pth`` files:
the template's, nothing of any caller's) and blocks reading that pipe. A call of the same shape
then writes the script's name on the pipe and closes it; the interpreter becomes ``python3 <script>``
(``sys.argv``, ``sys.path[0]``, ``__main__`` with ``__file__``, stdin from the call's stdin or
``/dev/null``) and runs it. Its output, exit status, signal and the agent's process-group kill on
timeout are those of the exec, as for any command.

Why the interpreter says when it is ready (one ``READY`` byte on stdout, taken off the output before
anyone sees it): the call's ``run_timeout`` covers the code's own run, as ``execution_time`` does in
SandboxFusion, not the interpreter's start. The agent reports the pid at the fork; on a loaded host
the start (site, ``.pth`` files: tens of milliseconds of CPU) may take seconds after that, and a
clock started at the hand-over counted them: calls of ``print(1)`` answered ``TimeLimitExceeded``.
A call waits (bounded, off its clock) for the byte, and hands the script over only then.

Why one interpreter per call and not a long-lived zygote that forks: a forked child is root in the
same sandbox as its zygote, so it could signal, trace or otherwise change the process every later
call is forked from; an interpreter that serves one call and is killed by the reset (which kills
every process but the agent) carries nothing from one call to the next, and the tests of the reset
cover it as they cover any process. The price is CPU: each call still starts one interpreter, off
its hot path.

A call not of that shape (another command, a compile step, other environment variables, another
output cap or trusted flag than the interpreter was started with) runs the ordinary way; the
interpreter it left unused is killed by the reset.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import signal
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from bus.errors import DsecError
from bus.fncall import FN_WORKDIR
from bus.messages import ExecRequest, ExecResult, FnCallRequest

from ._agent import AgentError
from ._backend import AgentChannel, Backend, Handle

STDIN_PATH = "/tmp/.dsec-fn-stdin"  # (hostagent._fncall writes a call's stdin there)
# How long a call waits, off its clock, for its started interpreter to be loaded (after that it runs
# the ordinary way): one still loading is waited for, as another started for the call would load no
# faster on a host that slow, and on the call's clock. With KILL_WAIT_S, what a call on an interpreter
# may add to its own timeouts: less than the SDK's reply margin (sdk._fncall.REPLY_MARGIN_S), so the
# caller hears the host's answer, never its own timeout.
START_WAIT_S = 15.0
KILL_WAIT_S = 5.0  # for the exec to end once its process group was killed at the call's timeout
READY = b"\0"  # the interpreter's first output: it is loaded and waits for its script
_SCRIPT = re.compile(r"python3 ([A-Za-z0-9_][A-Za-z0-9_.-]*\.py)")

# Runs as ``python3 -c``: everything it defines is local to _z, and __main__'s namespace is then made
# the one ``python3 <script>`` gives. The first byte read says where stdin comes from (1: the call's
# stdin file), the rest is the script's name in the working directory. A traceback leaves out _z's
# frame, so it reads as the script's own. At the end it does what the interpreter's exit does that a
# script can see (exit status as for SystemExit or an uncaught exception, non-daemon threads joined,
# atexit, the script's objects finalized: an unclosed file is flushed; std streams flushed, 120 when
# that fails) and then leaves at once: the interpreter's own teardown costs milliseconds here.
ZYGOTE = f"""
def _z():
    import os, sys
    os.write(1, {READY!r})
    msg = b""
    while True:
        b = os.read(0, 4096)
        if not b:
            break
        msg += b
    if not msg:
        sys.exit(0)
    fd = os.open({STDIN_PATH!r} if msg[:1] == b"1" else "/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    script = msg[1:].decode()
    path = os.path.join(os.getcwd(), script)
    sys.argv[:] = [script]
    sys.path[0] = os.path.dirname(path)
    g = sys.modules["__main__"].__dict__
    b = g["__builtins__"]
    g.clear()
    loader = sys.modules["_frozen_importlib_external"].SourceFileLoader("__main__", path)
    g.update(__name__="__main__", __doc__=None, __package__=None, __loader__=loader, __spec__=None,
             __annotations__={{}}, __builtins__=b, __file__=path, __cached__=None)
    try:
        with open(path, "rb") as f:
            src = f.read()
    except OSError as e:
        sys.stderr.write(f"{{sys.executable}}: can't open file {{path!r}}: [Errno {{e.errno}}] {{e.strerror}}\\n")
        sys.exit(2)
    try:
        code = compile(src, path, "exec", dont_inherit=True)
        del msg, fd, script, path, b, loader, src, f
        exec(code, g)
        rc = 0
    except SystemExit as e:
        rc = e.code
        if rc is None:
            rc = 0
        elif not isinstance(rc, int):
            sys.stderr.write(f"{{rc}}\\n")
            rc = 1
    except BaseException as e:
        tb = e.__traceback__.tb_next if e.__traceback__ else None
        sys.excepthook(type(e), e.with_traceback(tb), tb)
        rc = 1
    try:
        t = sys.modules.get("threading")
        if t is not None:
            t._shutdown()
        import atexit, gc
        atexit._run_exitfuncs()
        g.clear()
        gc.collect()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            rc = 120
        os._exit(rc & 255)
_z()
"""


@dataclass(frozen=True)
class ZygoteKey:
    """What an interpreter was started with; a call of another key cannot use it."""

    trusted: bool
    output_cap: int
    envs: tuple[tuple[str, str], ...]


def script_of(req: FnCallRequest) -> str | None:
    """The script a call runs when it is ``python3 <script>.py`` and nothing else; else None."""
    if req.compile_cmd:
        return None
    m = _SCRIPT.fullmatch(req.cmd)
    return m.group(1) if m else None


def key_of(req: FnCallRequest) -> ZygoteKey:
    return ZygoteKey(req.trusted, req.output_cap, tuple(sorted(req.envs.items())))


class Shapes:
    """The shapes of a template's recent ``python3 <script>`` calls, so that its members start
    interpreters in the proportions the calls come in (and a call picks a member started for its
    shape, ``FnPool.acquire``). With one shape this is the last call's, as before; with calls that
    alternate (trusted and not, other envs) the members are started for each of them, not all for
    whichever came last."""

    RECENT = 8  # calls remembered: few, so that a change of what is called shows after a few calls

    __slots__ = ("recent",)

    def __init__(self) -> None:
        self.recent: deque[ZygoteKey] = deque(maxlen=self.RECENT)

    def saw(self, key: ZygoteKey) -> None:
        self.recent.append(key)

    def next_for(self, started: list[ZygoteKey]) -> ZygoteKey | None:
        """The shape to start the next interpreter for, given those ``started`` (not yet used): the
        one whose share of the recent calls is furthest above its share of the started ones (ties:
        the most recent shape); None before any call."""
        if not self.recent:
            return None
        want = Counter(self.recent)
        have = Counter(started)
        n_want, n_have = len(self.recent), len(started) + 1
        by_recency = list(dict.fromkeys(reversed(self.recent)))
        # (the shares compared in integers: a float difference would break ties by rounding)
        return max(by_recency, key=lambda k: want[k] * n_have - have[k] * n_want)


@dataclass
class Zygote:
    """One started interpreter, waiting for its call."""

    key: ZygoteKey
    started: asyncio.Future[int]  # its pid in the member's pid namespace (the agent signals its process group)
    ready: asyncio.Future[None]  # it wrote READY: loaded, waiting for its script
    task: asyncio.Future[ExecResult]

    def alive(self) -> bool:
        return not self.task.done()

    def cancel(self) -> None:
        """Hang up its exec (the agent kills the process group); the reset kills it anyway."""
        self.task.cancel()


def missing(z: Zygote) -> bool:
    """``z`` ended before its call because the template has no ``python3`` (the shell's 127)."""
    t = z.task
    return t.done() and not t.cancelled() and t.exception() is None and t.result().exit_code == 127


def _consume(t: asyncio.Future[Any]) -> None:
    if not t.cancelled():
        t.exception()  # an interpreter killed unused by a reset or a destroy ends in an error: expected


def start(backend: Backend, handle: Handle, key: ZygoteKey) -> Zygote | None:
    """An interpreter being started in ``handle`` for calls of ``key`` (the member serves meanwhile:
    a call that comes first waits for the start); None when the backend has no agent channel."""
    if not isinstance(backend, AgentChannel):
        return None
    loop = asyncio.get_running_loop()
    started: asyncio.Future[int] = loop.create_future()
    ready: asyncio.Future[None] = loop.create_future()

    def on_start(pid: int) -> None:
        if not started.done():
            started.set_result(pid)

    def on_output(stream: int, data: bytes) -> None:
        if stream == 1 and not ready.done():
            ready.set_result(None)

    er = ExecRequest(
        cmd=f"exec python3 -c {shlex.quote(ZYGOTE)}", envs=dict(key.envs), cwd=FN_WORKDIR, timeout_s=0.0,
        output_cap=key.output_cap + len(READY) if key.output_cap >= 0 else key.output_cap, trusted=key.trusted, stdin=True,
    )
    task = asyncio.ensure_future(backend.exec(handle, er, on_output, on_start=on_start))
    task.add_done_callback(_consume)
    return Zygote(key, started, ready, task)


def _unmarked(res: ExecResult) -> ExecResult:
    """``res`` without the interpreter's READY byte: the script's output as ``python3 <script>`` gives it."""
    if res.stdout.startswith(READY):
        res.stdout = res.stdout[len(READY):]
        res.stdout_bytes = max(0, res.stdout_bytes - len(READY))
    return res


async def run(backend: Backend, handle: Handle, z: Zygote, script: str, with_stdin: bool, timeout_s: float) -> ExecResult | None:
    """The call's run on ``z``; None when ``z`` could not take it (gone before the call reached it,
    or not ready within START_WAIT_S: the caller runs it the ordinary way). The timeout counts from
    the hand-over to the loaded interpreter, as the code's own run; past it the process group is
    killed, as the agent does for an exec."""
    assert isinstance(backend, AgentChannel)
    client = backend.agent_client(handle)
    either: set[asyncio.Future[Any]] = {z.ready, z.task}
    done, _ = await asyncio.wait(either, timeout=START_WAIT_S, return_when=asyncio.FIRST_COMPLETED)
    if z.ready not in done or not z.started.done():  # (it ended, or did not load in time)
        z.cancel()
        return None
    pid = z.started.result()
    t0 = time.perf_counter()
    try:
        await client.send_stdin(pid, (b"1" if with_stdin else b"0") + script.encode(), close=True)
    except AgentError:
        z.cancel()
        return None
    try:
        res = await asyncio.wait_for(asyncio.shield(z.task), timeout_s)
        timed_out = False
    except asyncio.CancelledError:
        z.cancel()
        raise
    except TimeoutError:
        try:
            await client.signal(pid, signal.SIGKILL)
        except AgentError:
            z.cancel()  # (closing the exec's connection kills the process group too)
        try:
            res = await asyncio.wait_for(z.task, KILL_WAIT_S)
        except (TimeoutError, asyncio.CancelledError, DsecError):
            res = ExecResult(exit_code=128 + signal.SIGKILL, signal=signal.SIGKILL)
        timed_out = True
    res = _unmarked(res)
    res.timed_out = res.timed_out or timed_out
    res.duration_ms = (time.perf_counter() - t0) * 1000
    return res


__all__ = ["ZYGOTE", "Zygote", "ZygoteKey", "key_of", "missing", "run", "script_of", "start"]
