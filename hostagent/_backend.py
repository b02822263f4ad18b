"""What a host agent needs from a sandbox backend; the simulated backend for scale benchmarks."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bus.errors import FileNotFound, SandboxNotFound
from bus.messages import (
    Done,
    EntryInfo,
    ExecRequest,
    ExecResult,
    Exists,
    FileData,
    FileList,
    FileListing,
    FileOp,
    FileRead,
    FileRemove,
    FileWrite,
    FileWritten,
    FileExists,
    LayerRef,
    SandboxSpec,
)

OnOutput = Callable[[int, bytes], Awaitable[None] | None]


@dataclass
class Handle:
    """What the host agent keeps about a live sandbox; ``extra`` is the backend's own (JSON-able)."""

    sandbox_id: str
    pid: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Usage:
    mem_resident_mb: int = 0
    cpu_busy: float = 0.0
    per_sandbox_mem_mb: dict[str, int] = field(default_factory=dict)


class Backend(Protocol):
    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def create(self, spec: SandboxSpec, layers: list[LayerRef]) -> Handle: ...

    async def destroy(self, sandbox_id: str) -> None:
        """Remove everything the sandbox has on this host; idempotent."""

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None) -> ExecResult: ...

    async def files(self, handle: Handle, op: FileOp) -> Any: ...

    async def leftovers(self, sandbox_id: str) -> list[str]:
        """What of the sandbox still exists on this host after ``destroy`` (empty: all gone)."""

    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        """Remove every resource of a sandbox for which ``holds(id)`` is false (asked at the moment of
        deciding: the host agent neither holds nor creates it); return the ids in ``running`` (sandbox
        id -> its init's pid) whose sandbox no longer runs, and what was removed."""

    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        """Given what local state says was running, return the sandboxes that still are."""

    async def usage(self) -> Usage: ...

    def capacity(self) -> dict[str, float]:
        """cpu_total, mem_total_mb, disk_total_mb of this host for this backend."""


class SimBackend:
    """Creates nothing: runs the real host-agent code paths for control-plane scale runs only.

    It reports resident memory as ``resident_fraction`` of what its sandboxes requested, so placement's
    resident-memory admission has something real-looking to work with.
    """

    name = "sim"

    def __init__(
        self,
        cpu_total: float = 64.0,
        mem_total_mb: int = 256 * 1024,
        disk_total_mb: int = 4 * 1024 * 1024,
        *,
        resident_fraction: float = 0.25,
        busy_per_sandbox: float = 0.01,
    ) -> None:
        self._cap = {"cpu_total": cpu_total, "mem_total_mb": mem_total_mb, "disk_total_mb": disk_total_mb}
        self._files: dict[str, dict[str, bytes]] = {}
        self._mem: dict[str, int] = {}
        self._resident_mb = 0
        self.resident_fraction = resident_fraction
        self.busy_per_sandbox = busy_per_sandbox

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        self._files.clear()
        self._mem.clear()
        self._resident_mb = 0

    async def create(self, spec: SandboxSpec, layers: list[LayerRef]) -> Handle:
        if spec.sandbox_id not in self._mem:
            mb = int(spec.memory_mb * self.resident_fraction)
            self._mem[spec.sandbox_id] = mb
            self._resident_mb += mb
        return Handle(spec.sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        self._files.pop(sandbox_id, None)
        self._resident_mb -= self._mem.pop(sandbox_id, 0)

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None) -> ExecResult:
        return ExecResult(exit_code=0)

    async def files(self, handle: Handle, op: FileOp) -> Any:
        if handle.sandbox_id not in self._mem:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is gone")
        fs = self._files.setdefault(handle.sandbox_id, {})
        match op:
            case FileWrite(path=p, data=d, offset=off, truncate=tr):
                old = b"" if tr and off == 0 else fs.get(p, b"")
                fs[p] = old[:off].ljust(off, b"\0") + d + old[off + len(d):]
                return FileWritten(path=p, size=len(fs[p]))
            case FileRead(path=p, offset=off, length=n):
                if p not in fs:
                    raise FileNotFound(f"{p}: no such file")
                data = fs[p][off:] if n < 0 else fs[p][off:off + n]
                return FileData(data=data, size=len(fs[p]), offset=off)
            case FileList(path=p):
                pre = p.rstrip("/") + "/"
                return FileListing(entries=[
                    EntryInfo(name=k[len(pre):], path=k, type="file", size=len(v), mtime=time.time())
                    for k, v in fs.items() if k.startswith(pre) and "/" not in k[len(pre):]
                ])
            case FileRemove(path=p):
                fs.pop(p, None)
                return Done()
            case FileExists(path=p):
                return Exists(exists=p in fs)
        raise AssertionError(op)

    async def leftovers(self, sandbox_id: str) -> list[str]:
        return []

    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        orphans = [sid for sid in self._mem if not holds(sid)]
        for sid in orphans:
            await self.destroy(sid)
        return {sid for sid in running if sid not in self._mem}, orphans

    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        return {}

    async def usage(self) -> Usage:
        return Usage(mem_resident_mb=self._resident_mb, cpu_busy=min(self._cap["cpu_total"], len(self._mem) * self.busy_per_sandbox))

    def capacity(self) -> dict[str, float]:
        return dict(self._cap)
