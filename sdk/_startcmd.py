"""E2B's start and ready commands (``Template().set_start_cmd(cmd, ready_cmd)``): run the start
command in the background, then the ready command again and again until it exits 0.

E2B runs the start command once, at the end of the template's build, and snapshots the running
machine: a sandbox created from the template starts with the process already running. dsec has no
running-state snapshot on this path (a template is layers of files; a CRIU memory image belongs
to one sandbox, its network namespace and host), so it does the next best thing: the build runs
the pair once as a check (a ready command that never succeeds fails the build, and no template
is written), and every create through the gateway runs them again and is answered only once the
ready command has succeeded. Files the start command writes at build time are not kept (the next
start would find its own pid files and sockets).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from bus.errors import DsecError, SandboxTimeout

from .errors import CommandExitError

READY_POLL_S = 0.2  # between two runs of the ready command (E2B runs it in a loop as well)
READY_RUN_MAX_S = 30.0  # one run of the ready command that takes longer counts as a failure
OUTPUT_TAIL = 2000


@dataclass
class ReadyResult:
    ready: bool
    seconds: float
    attempts: int
    last_exit: int | None = None  # the ready command's last exit code (None: it timed out)
    start_exit: int | None = None  # the start command's exit code, if it ended meanwhile
    start_output: str = ""  # the tail of the start command's output

    def describe(self, start_cmd: str, ready_cmd: str, timeout_s: float) -> str:
        last = "it timed out" if self.last_exit is None else f"last exit code {self.last_exit}"
        started = "still running" if self.start_exit is None else f"exited with code {self.start_exit}"
        tail = f"; its output ends with:\n{self.start_output}" if self.start_output.strip() else ""
        return (f"the ready command `{ready_cmd}` did not succeed within {timeout_s:g}s ({self.attempts} tries, {last}); "
                f"the start command `{start_cmd}` {started}{tail}")


async def start_and_wait_ready(sb: Any, start_cmd: str, ready_cmd: str, *, timeout_s: float, user: str | None = None,
                               cwd: str | None = None, envs: dict[str, str] | None = None) -> ReadyResult:
    """Start ``start_cmd`` in ``sb`` (an ``AsyncSandbox``) in the background, then run ``ready_cmd``
    until it exits 0 or ``timeout_s`` passes. On success the start command keeps running, detached
    from this caller. An empty ``ready_cmd``: ready once the start command runs."""
    t0 = time.monotonic()
    tail: list[str] = []

    def out(data: str) -> None:
        tail.append(data)
        if sum(len(t) for t in tail) > 2 * OUTPUT_TAIL:
            del tail[: len(tail) // 2]

    handle = await sb.commands.run(start_cmd, background=True, timeout=0, user=user, cwd=cwd, envs=envs, on_stdout=out, on_stderr=out)
    res = ReadyResult(ready=not ready_cmd, seconds=0.0, attempts=0)
    deadline = t0 + timeout_s
    while not res.ready:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        res.attempts += 1
        try:
            await sb.commands.run(ready_cmd, timeout=max(1.0, min(READY_RUN_MAX_S, left)), user=user, cwd=cwd, envs=envs)
            res.ready = True
        except CommandExitError as exc:
            res.last_exit = exc.exit_code
        except SandboxTimeout:
            res.last_exit = None
        if not res.ready and time.monotonic() + READY_POLL_S < deadline:
            await asyncio.sleep(READY_POLL_S)  # poll interval: the ready command is the only signal there is
    res.seconds = time.monotonic() - t0
    if handle._out.end.done():  # the start command ended already (a daemon that forked, or a failure)
        try:
            done = await handle.wait(1)
            res.start_exit = done.exit_code
        except CommandExitError as exc:
            res.start_exit = exc.exit_code
        except DsecError:
            pass
    res.start_output = "".join(tail)[-OUTPUT_TAIL:]
    await handle.disconnect()
    return res


__all__ = ["READY_POLL_S", "ReadyResult", "start_and_wait_ready"]
