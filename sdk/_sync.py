"""The synchronous client: ``Sandbox``, the same surface as ``AsyncSandbox`` without ``await``.

Calls run on one private event loop in a daemon thread, shared by every sync object in the process.
"""

from __future__ import annotations

import asyncio
import builtins
import threading
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

from ._async import AsyncSandbox
from ._commands import AsyncCommandHandle
from ._files import AsyncWatchHandle
from ._models import CommandResult, EntryInfo, FilesystemEvent, ProcessInfo, SandboxInfo, SandboxMetrics, WriteInfo
from ._snapshots import SnapshotInfo
from ._trajectory import TrajectoryStep

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


class CommandHandle:
    """A background command (see ``AsyncCommandHandle``); callbacks run on the SDK's own thread."""

    def __init__(self, h: AsyncCommandHandle) -> None:
        self._h = h

    def __repr__(self) -> str:
        return f"CommandHandle(pid={self.pid})"

    @property
    def pid(self) -> int:
        return self._h.pid

    @property
    def exit_code(self) -> int | None:
        return self._h.exit_code

    @property
    def stdout(self) -> str:
        return self._h.stdout

    @property
    def stderr(self) -> str:
        return self._h.stderr

    def wait(self, timeout: float | None = None) -> CommandResult:
        return _run(self._h.wait(timeout))

    def kill(self, signal: int = 9) -> bool:
        return _run(self._h.kill(signal))

    def send_stdin(self, data: str | bytes) -> None:
        _run(self._h.send_stdin(data))

    def close_stdin(self) -> None:
        _run(self._h.close_stdin())

    def disconnect(self) -> None:
        _run(self._h.disconnect())


class Commands:
    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a

    def run(self, cmd: str, *, background: bool = False, **kwargs: Any) -> Any:
        """Run ``cmd`` with /bin/sh (see ``AsyncCommands.run``); CommandHandle when ``background``."""
        res = _run(self._a.commands.run(cmd, background=background, **kwargs))
        return CommandHandle(res) if background else res

    def list(self) -> list[ProcessInfo]:
        return _run(self._a.commands.list())

    def kill(self, pid: int, *, signal: int = 9) -> bool:
        return _run(self._a.commands.kill(pid, signal=signal))

    def send_stdin(self, pid: int, data: str | bytes) -> None:
        _run(self._a.commands.send_stdin(pid, data))

    def close_stdin(self, pid: int) -> None:
        _run(self._a.commands.close_stdin(pid))

    def connect(self, pid: int, **kwargs: Any) -> CommandHandle:
        return CommandHandle(_run(self._a.commands.connect(pid, **kwargs)))


class WatchHandle:
    def __init__(self, h: AsyncWatchHandle) -> None:
        self._h = h

    def get_new_events(self) -> list[FilesystemEvent]:
        return _run(_call(self._h.get_new_events))

    def stop(self) -> None:
        _run(self._h.stop())


async def _call(fn: Any) -> Any:
    return fn()  # on the SDK's loop, where the handle's state changes


class Filesystem:
    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a

    def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> WriteInfo:
        return _run(self._a.files.write(path, data, mode=mode))

    def read(self, path: str, *, format: Literal["text", "bytes"] = "text", offset: int = 0, length: int | None = None) -> str | bytes:
        return _run(self._a.files.read(path, format=format, offset=offset, length=length))

    def list(self, path: str) -> list[EntryInfo]:
        return _run(self._a.files.list(path))

    def remove(self, path: str) -> None:
        _run(self._a.files.remove(path))

    def exists(self, path: str) -> bool:
        return _run(self._a.files.exists(path))

    def get_info(self, path: str) -> EntryInfo:
        return _run(self._a.files.get_info(path))

    def make_dir(self, path: str, *, mode: int = 0o755) -> bool:
        return _run(self._a.files.make_dir(path, mode=mode))

    def rename(self, old_path: str, new_path: str) -> EntryInfo:
        return _run(self._a.files.rename(old_path, new_path))

    def watch_dir(self, path: str, on_event: Any = None, *, recursive: bool = False) -> WatchHandle:
        return WatchHandle(_run(self._a.files.watch_dir(path, on_event, recursive=recursive)))


class Input:
    """Keyboard and mouse of a sandbox's screen (see ``AsyncInput``)."""

    def __init__(self, a: AsyncSandbox) -> None:
        self._i = a.input

    def type(self, text: str) -> None:
        _run(self._i.type(text))

    def key(self, name: str) -> None:
        _run(self._i.key(name))

    def click(self, x: int, y: int, button: Literal["left", "right", "middle"] = "left") -> None:
        _run(self._i.click(x, y, button))


class Sandbox:
    """A live sandbox. ``with Sandbox.create(...) as sb:`` kills it at the end of the block."""

    def __init__(self, a: AsyncSandbox) -> None:
        self._a = a
        self.commands = Commands(a)
        self.files = Filesystem(a)
        self.input = Input(a)

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

    def trajectory(self) -> builtins.list[TrajectoryStep]:
        return _run(self._a.trajectory())

    def create_snapshot(self, name: str | None = None, *, memory: bool = False, metadata: dict[str, str] | None = None) -> SnapshotInfo:
        return _run(self._a.create_snapshot(name, memory=memory, metadata=metadata))

    def fork(self, count: int, **create_kwargs: Any) -> builtins.list["Sandbox"]:
        return [Sandbox(a) for a in _run(self._a.fork(count, **create_kwargs))]

    def pause(self, persist: bool = False, *, memory: bool = False) -> SnapshotInfo | None:
        return _run(self._a.pause(persist, memory=memory))

    def resume(self) -> "Sandbox":
        _run(self._a.resume())
        return self

    @classmethod
    def list_snapshots(cls, **kwargs: Any) -> builtins.list[SnapshotInfo]:
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

    def set_network(self, network: Any) -> None:  # {"allow_out": [...]} or None (this class has a method named list)
        _run(self._a.set_network(network))

    def get_info(self) -> SandboxInfo:
        return _run(self._a.get_info())

    def get_metrics(self) -> SandboxMetrics:
        return _run(self._a.get_metrics())

    def screenshot(self) -> bytes:
        return _run(self._a.screenshot())

    def is_running(self) -> bool:
        return _run(self._a.is_running())

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
