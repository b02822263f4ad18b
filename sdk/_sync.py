"""The synchronous client: ``Sandbox``, the same surface as ``AsyncSandbox`` without ``await``.

Calls run on one private event loop in a daemon thread, shared by every sync object in the process.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from ._async import AsyncSandbox
from ._models import CommandResult, EntryInfo, SandboxInfo, WriteInfo
from ._snapshots import SnapshotInfo

T = TypeVar("T")

_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def _run(coro: Coroutine[Any, Any, T]) -> T:
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed():
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="dsec-sdk-loop", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop).result()


class Commands:
    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a

    def run(self, cmd: str, *, envs: dict[str, str] | None = None, cwd: str | None = None, timeout: float = 60, on_stdout: Any = None, on_stderr: Any = None) -> CommandResult:
        """Run ``cmd`` with /bin/sh; raise CommandExitError on a non-zero exit."""
        return _run(self._a.commands.run(cmd, envs=envs, cwd=cwd, timeout=timeout, on_stdout=on_stdout, on_stderr=on_stderr))


class Filesystem:
    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> WriteInfo:
        return _run(self._a.files.write(path, data, mode=mode))

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text") -> str | bytes:
        return _run(self._a.files.read(path, format=format))

    def list(self, path: str) -> list[EntryInfo]:
        return _run(self._a.files.list(path))

    def remove(self, path: str) -> None:
        _run(self._a.files.remove(path))

    def exists(self, path: str) -> bool:
        return _run(self._a.files.exists(path))


class Sandbox:
    """A live sandbox. ``with Sandbox.create(...) as sb:`` kills it at the end of the block."""

    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a
        self.commands = Commands(a)
        self.files = Filesystem(a)

    @property
    def sandbox_id(self) -> str:
        return self._a.sandbox_id

    @property
    def host_id(self) -> str:
        return self._a.host_id

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r}, host={self.host_id!r})"

    @classmethod
    def create(cls, template: str = "base", **kwargs: Any) -> "Sandbox":
        """Create a sandbox: ``template, backend, cpu, memory_mb, disk_mb, timeout, envs, metadata, network, ...``."""
        return cls(_run(AsyncSandbox.create(template, **kwargs)))

    @classmethod
    def create_batch(cls, count: int, template: str = "base", **kwargs: Any) -> list["Sandbox"]:
        return [cls(a) for a in _run(AsyncSandbox.create_batch(count, template, **kwargs))]

    @classmethod
    def connect(cls, sandbox_id: str, **kwargs: Any) -> "Sandbox":
        return cls(_run(AsyncSandbox.connect(sandbox_id, **kwargs)))

    @classmethod
    def list(cls, **kwargs: Any) -> list[SandboxInfo]:
        return _run(AsyncSandbox.list(**kwargs))

    def create_snapshot(self, name: str | None = None, *, memory: bool = False, metadata: dict[str, str] | None = None) -> SnapshotInfo:
        return _run(self._a.create_snapshot(name, memory=memory, metadata=metadata))

    def fork(self, count: int, **create_kwargs: Any) -> list["Sandbox"]:
        return [Sandbox(a) for a in _run(self._a.fork(count, **create_kwargs))]

    def pause(self, persist: bool = False, *, memory: bool = False) -> SnapshotInfo | None:
        return _run(self._a.pause(persist, memory=memory))

    def resume(self) -> "Sandbox":
        _run(self._a.resume())
        return self

    @classmethod
    def list_snapshots(cls, **kwargs: Any) -> list[SnapshotInfo]:
        return _run(AsyncSandbox.list_snapshots(**kwargs))

    @classmethod
    def get_snapshot(cls, snapshot_id: str, **kwargs: Any) -> SnapshotInfo:
        return _run(AsyncSandbox.get_snapshot(snapshot_id, **kwargs))

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, **kwargs: Any) -> str:
        return _run(AsyncSandbox.delete_snapshot(snapshot_id, **kwargs))

    def kill(self) -> None:
        _run(self._a.kill())

    def set_timeout(self, timeout: float) -> None:
        _run(self._a.set_timeout(timeout))

    def get_info(self) -> SandboxInfo:
        return _run(self._a.get_info())

    def is_running(self) -> bool:
        return _run(self._a.is_running())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
