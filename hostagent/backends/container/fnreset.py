"""Resetting a container that served one fn call to its template's state, so the next call can reuse
it instead of waiting for a fresh container: milliseconds instead of a container start.

The reset itself (processes, writable paths, IPC objects, cgroup counters) is done by ``nsreset``, a
helper process (setns needs a single-threaded one), in one round trip: nothing of it waits on this
event loop or its threads. What a call could change lies in the places it resets only because the
member's profile (Landlock, required) makes every other path read-only, forbids mount, namespaces and
keyrings, and the member has no network of its own: the fn pool reuses members of such a profile only
(``_fncall``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

HELPER = Path(__file__).with_name("nsreset.py")
# Resets in flight at once (each helper serves one at a time). A reset is about a millisecond of work,
# but on a loaded host each round trip waits for the helper to be scheduled: more helpers, fewer
# resets queued behind one that waits for a CPU. Started as resets overlap, kept.
HELPERS = 8


class ResetFailed(RuntimeError):
    """A member could not be reset (the pool destroys it instead); never sent to a caller."""


class NsResetters:
    """The helper processes (``nsreset``), started on first use and kept."""

    def __init__(self, n: int = HELPERS, helper: Path = HELPER) -> None:
        self.n = n
        self.helper = helper  # the script (warm restores use another one of the same protocol: ``warmroot``)
        self._free: asyncio.Queue[asyncio.subprocess.Process] | None = None
        self._all: list[asyncio.subprocess.Process] = []
        self._starting = 0
        # What a reset's helper part costs (benchmarks): waiting for a free helper, and its own work.
        self.wait_ms: deque[float] = deque(maxlen=1000)
        self.work_ms: deque[float] = deque(maxlen=1000)

    async def _start(self) -> asyncio.subprocess.Process:
        # -I -S: the helper needs the standard library only, and runs as root: no site, no env.
        p = await asyncio.create_subprocess_exec(
            sys.executable, "-I", "-S", str(self.helper), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        self._all.append(p)
        return p

    async def prestart(self) -> None:
        """Every helper started now (off the path of the first requests: a Python start on a loaded host
        takes a second)."""
        if self._free is None:
            self._free = asyncio.Queue()
        free = self._free
        want = self.n - len(self._all) - self._starting
        self._starting += want
        try:
            for p in await asyncio.gather(*(self._start() for _ in range(want))):
                free.put_nowait(p)
        finally:
            self._starting -= want

    async def run(self, req: dict[str, Any]) -> dict[str, Any]:
        if self._free is None:
            self._free = asyncio.Queue()
        if self._free.empty() and len(self._all) + self._starting < self.n:
            self._starting += 1  # another helper while every one is busy, up to n
            try:
                self._free.put_nowait(await self._start())
            finally:
                self._starting -= 1
        t0 = time.perf_counter()
        p = await self._free.get()
        self.wait_ms.append((time.perf_counter() - t0) * 1000)
        try:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(json.dumps(req).encode() + b"\n")
            await p.stdin.drain()
            line = await asyncio.wait_for(p.stdout.readline(), 30.0)
            if not line:
                raise ResetFailed(f"the reset helper exited ({p.returncode})")
        except BaseException:
            # A helper that did not answer (or whose answer we gave up on) is out of step: replace it.
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            self._all.remove(p)
            p = await self._start()
            raise
        finally:
            self._free.put_nowait(p)
        out: dict[str, Any] = json.loads(line)
        if not out.get("ok"):
            raise ResetFailed(f"reset failed: {out.get('error')}")
        self.work_ms.append(float(out.get("ms", 0.0)))
        return out

    async def stop(self) -> None:
        for p in self._all:
            if p.stdin is not None:
                p.stdin.close()
        for p in self._all:
            try:
                await asyncio.wait_for(p.wait(), 5.0)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        self._all.clear()
        self._free = None


__all__ = ["NsResetters", "ResetFailed"]
