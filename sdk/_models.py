"""Plain result types the SDK returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommandResult:
    stdout: str
    stderr: str
    exit_code: int
    error: str | None = None
    duration_ms: float = 0.0


@dataclass
class EntryInfo:
    name: str
    path: str
    type: str  # file, dir, symlink, other
    size: int = 0
    mode: int = 0
    mtime: float = 0.0


@dataclass
class WriteInfo:
    path: str
    size: int


@dataclass
class SandboxInfo:
    sandbox_id: str
    template: str
    state: str
    host_id: str
    started_at: float = 0.0
    expires_at: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    cpu: float = 0.0
    memory_mb: int = 0
