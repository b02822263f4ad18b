"""The one thread that touches this agent's network kernel state (it switches its own netns with
unshare/setns; the rest of the agent never leaves the host netns)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Callable, TypeVar

__all__ = ["Worker"]

T = TypeVar("T")


class Worker:
    def __init__(self) -> None:
        self._exec: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def active(self) -> bool:
        return self._exec is not None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._exec is None:
            self._exec = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsec-net")
        return await asyncio.get_running_loop().run_in_executor(self._exec, fn, *args)

    def shutdown(self) -> None:
        if self._exec is not None:
            self._exec.shutdown(wait=True)
            self._exec = None
