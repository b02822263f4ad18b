"""The seam between the host agent and a sandbox backend: the ``Backend`` protocol every backend
implements as the host agent calls it, and the optional abilities (small protocols of their own) the
host agent discovers once, when it starts (``Capabilities.of``)."""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from bus.errors import NotSupported, SnapshotUnsupported
from bus.messages import BackendName, ExecRequest, ExecResult, FileOp, HostBackend, LayerRef, NetworkSpec, SandboxMetrics, SandboxSpec

if TYPE_CHECKING:
    from ._agent import AgentClient
    from ._profiles import Enforcement

OnOutput = Callable[[int, bytes], Awaitable[None] | None]
OnStart = Callable[[int], None]


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


@dataclass(frozen=True)
class HostCapacity:
    """What this host offers through one backend."""

    cpu_total: float
    mem_total_mb: int
    disk_total_mb: int

    @classmethod
    def of_host(cls, data_dir: str | os.PathLike[str]) -> HostCapacity:
        """The whole machine: its CPUs, its memory, and the filesystem that holds ``data_dir``."""
        with open("/proc/meminfo") as f:
            mem_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
        st = os.statvfs(data_dir)
        return cls(cpu_total=float(os.cpu_count() or 1), mem_total_mb=mem_kb // 1024, disk_total_mb=st.f_blocks * st.f_frsize // (1 << 20))


class Backend(Protocol):
    """Every backend, as the host agent calls it."""

    name: BackendName

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def create(
        self, spec: SandboxSpec, layers: list[LayerRef], *, security: Enforcement | None = None, memory: LayerRef | None = None,
    ) -> Handle:
        """Start the sandbox over ``layers`` (top last). ``security``: the compiled guard profile it is
        confined by (None: the backend's built-in default; a backend that does not enforce profiles,
        see ``EnforcesProfiles``, is never given one). ``memory``: a snapshot's memory dump, packed as a
        layer, its processes are restored from (only given to a ``Checkpointing`` backend)."""
        ...

    async def destroy(self, sandbox_id: str) -> None:
        """Remove everything the sandbox has on this host; idempotent."""

    async def leftovers(self, sandbox_id: str) -> list[str]:
        """What of the sandbox still exists on this host after ``destroy`` (empty: all gone)."""

    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        """Remove every resource of a sandbox for which ``holds(id)`` is false (asked at the moment of
        deciding: the host agent neither holds nor creates it); return the ids in ``running`` (sandbox
        id -> its init's pid) whose sandbox no longer runs, and what was removed."""

    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        """Given what local state says was running, return the sandboxes that still are."""

    async def usage(self) -> Usage: ...

    def capacity(self) -> HostCapacity: ...

    def advertise(self) -> HostBackend:
        """This backend as the heartbeat names it: its limits per sandbox, and what its probe found."""
        ...

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None, *, on_start: OnStart | None = None) -> ExecResult:
        """Run ``req`` through the sandbox's agent channel; ``on_start`` hears a background process's pid."""
        ...

    async def files(self, handle: Handle, op: FileOp) -> Any:
        """A file operation through the sandbox's agent channel; returns its reply struct."""


# --- optional abilities -------------------------------------------------------------------------
@runtime_checkable
class EnforcesProfiles(Protocol):
    """Confines sandboxes by guard's security profiles: ``create`` takes ``security``."""

    enforces_profiles: Literal[True]


@runtime_checkable
class Freezing(Protocol):
    """Stops every task of a sandbox at once (pause, and the one moment a snapshot is cut at)."""

    async def before_freeze(self, handle: Handle) -> None:
        """Let go of what a frozen sandbox could not (its agent's idle connections)."""

    async def freeze(self, handle: Handle) -> None: ...

    async def thaw(self, handle: Handle) -> None: ...

    def frozen(self, handle: Handle) -> bool: ...

    def scratch_dir(self, handle: Handle) -> str:
        """The host dir of the sandbox's writable state (``_rootfs.RootfsLayout``), which snapshots diff."""
        ...


@runtime_checkable
class Checkpointing(Protocol):
    """Dumps a sandbox's processes (memory snapshots); ``create`` restores them from ``memory``."""

    async def checkpoint(self, handle: Handle, image_dir: str, work_dir: str) -> None: ...


@runtime_checkable
class Networked(Protocol):
    """Gives sandboxes a network of their own whose egress allowlist can change while they run."""

    async def set_network(self, handle: Handle, network: NetworkSpec | None) -> dict[str, Any]:
        """Replace the sandbox's allowlist (None or empty: no egress); returns the handle's new extra.
        Raises NotSupported for a sandbox that has no network of its own."""
        ...


@runtime_checkable
class Metering(Protocol):
    """Per-sandbox CPU, memory and disk figures (the ``metrics`` op)."""

    async def metrics(self, handle: Handle) -> SandboxMetrics: ...


@runtime_checkable
class AgentChannel(Protocol):
    """The sandbox's in-sandbox agent, for the ops that drive it directly (background processes, watches)."""

    def agent_client(self, handle: Handle) -> AgentClient: ...


@runtime_checkable
class WarmPooling(Protocol):
    """Keeps started sandboxes ready to hand out."""

    def warm_ready(self) -> int:
        """Sandboxes waiting in the pool now."""
        ...


@runtime_checkable
class CachesLayers(Protocol):
    """Holds image layers locally (placement prefers hosts that hold a template's layers)."""

    def cached_layers(self) -> list[str]: ...


@runtime_checkable
class Display(Protocol):
    """Has a screen (the full-VM backend): screenshots and keyboard and mouse input."""

    async def screenshot(self, handle: Handle) -> bytes:
        """The screen as PNG."""
        ...

    async def input_type(self, handle: Handle, text: str) -> None: ...

    async def input_key(self, handle: Handle, name: str) -> None: ...

    async def input_click(self, handle: Handle, x: int, y: int, button: str = "left") -> None: ...


@dataclass(frozen=True)
class Capabilities:
    """What one backend can do beyond ``Backend``, looked up once (``of``) when the host agent starts.
    The ``need_*`` accessors raise the typed error of a missing ability."""

    name: str
    enforces_profiles: bool = False
    freezer: Freezing | None = None
    checkpointer: Checkpointing | None = None
    meter: Metering | None = None
    agents: AgentChannel | None = None
    warm_pool: WarmPooling | None = None
    layer_cache: CachesLayers | None = None
    display: Display | None = None

    @classmethod
    def of(cls, backend: Backend) -> Capabilities:
        return cls(
            name=backend.name,
            enforces_profiles=isinstance(backend, EnforcesProfiles) and backend.enforces_profiles is True,
            freezer=backend if isinstance(backend, Freezing) else None,
            checkpointer=backend if isinstance(backend, Checkpointing) else None,
            meter=backend if isinstance(backend, Metering) else None,
            agents=backend if isinstance(backend, AgentChannel) else None,
            warm_pool=backend if isinstance(backend, WarmPooling) else None,
            layer_cache=backend if isinstance(backend, CachesLayers) else None,
            display=backend if isinstance(backend, Display) else None,
        )

    def need_display(self) -> Display:
        if self.display is None:
            raise NotSupported(f"screenshots and input need a sandbox with a screen (backend 'vm'); this host runs {self.name!r}")
        return self.display

    def need_freezer(self) -> Freezing:
        if self.freezer is None:
            raise NotSupported(f"snapshots, forks and pauses need a backend that can freeze a sandbox; this host runs {self.name!r}")
        return self.freezer

    def need_checkpointer(self) -> Checkpointing:
        if self.checkpointer is None:
            raise SnapshotUnsupported(f"the {self.name} backend cannot checkpoint a sandbox's memory: snapshots of files only")
        return self.checkpointer

    def need_meter(self) -> Metering:
        if self.meter is None:
            raise NotSupported(f"the {self.name} backend reports no sandbox metrics")
        return self.meter

    def need_agents(self) -> AgentChannel:
        if self.agents is None:
            raise NotSupported(f"the {self.name} backend runs no in-sandbox agent (background processes, watches)")
        return self.agents


__all__ = [
    "AgentChannel", "Backend", "CachesLayers", "Capabilities", "Checkpointing", "Display", "EnforcesProfiles", "Freezing", "Handle",
    "HostCapacity", "Metering", "Networked", "OnOutput", "OnStart", "Usage", "WarmPooling",
]
