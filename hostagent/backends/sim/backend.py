"""The ``sim`` backend: creates nothing, for control-plane scale runs of the real host-agent code."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

from bus.errors import FileNotFound, SandboxNotFound
from bus.messages import (
    BackendName,
    Done,
    EntryInfo,
    ExecRequest,
    ExecResult,
    Exists,
    FileData,
    FileExists,
    FileList,
    FileListing,
    FileOp,
    FileRead,
    FileRemove,
    FileWrite,
    FileWritten,
    HostBackend,
    LayerRef,
    SandboxSpec,
)

from ..._backend import Handle, HostCapacity, OnOutput, OnStart, Usage
from ..._profiles import Enforcement


class SimBackend:
    """Runs the real host-agent code paths for control-plane scale runs only; no optional abilities.

    It reports resident memory as ``resident_fraction`` of what its sandboxes requested, so placement's
    resident-memory admission has something real-looking to work with.
    """

    name: BackendName = "sim"

    def __init__(
        self,
        cpu_total: float = 64.0,
        mem_total_mb: int = 256 * 1024,
        disk_total_mb: int = 4 * 1024 * 1024,
        *,
        resident_fraction: float = 0.25,
        busy_per_sandbox: float = 0.01,
        create_s: float = 0.0,
    ) -> None:
        self._cap = HostCapacity(cpu_total=cpu_total, mem_total_mb=mem_total_mb, disk_total_mb=disk_total_mb)
        self.create_s = create_s  # a create takes up to this long (uniform): a batch is then mid-way for a while (tests)
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

    async def create(
        self, spec: SandboxSpec, layers: list[LayerRef], *, security: Enforcement | None = None, memory: LayerRef | None = None,
    ) -> Handle:
        if self.create_s > 0:
            await asyncio.sleep(random.uniform(0.0, self.create_s))  # the simulated work of a create
        if spec.sandbox_id not in self._mem:
            mb = int(spec.memory_mb * self.resident_fraction)
            self._mem[spec.sandbox_id] = mb
            self._resident_mb += mb
        return Handle(spec.sandbox_id)

    async def destroy(self, sandbox_id: str) -> None:
        self._files.pop(sandbox_id, None)
        self._resident_mb -= self._mem.pop(sandbox_id, 0)

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None, *, on_start: OnStart | None = None) -> ExecResult:
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
        return Usage(mem_resident_mb=self._resident_mb, cpu_busy=min(self._cap.cpu_total, len(self._mem) * self.busy_per_sandbox))

    def capacity(self) -> HostCapacity:
        return self._cap

    def advertise(self) -> HostBackend:
        return HostBackend(name=self.name)
