"""Plain result types the SDK returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CommandResult:
    stdout: str  # at most the output cap (8 MiB by default) of it: see stdout_truncated
    stderr: str
    exit_code: int
    error: str | None = None
    duration_ms: float = 0.0
    stdout_bytes: int = 0  # everything the command wrote, kept here or not
    stderr_bytes: int = 0
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    pid: int = 0
    signal: int = 0  # the signal that ended it (0: it exited)

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated


@dataclass
class ProcessInfo:
    """A command running in a sandbox (``commands.list()``)."""

    pid: int
    cmd: str
    tag: str = ""
    cwd: str = ""
    user: str = ""
    envs: dict[str, str] = field(default_factory=dict)
    stdin: bool = False  # its stdin pipe is open


@dataclass
class FilesystemEvent:
    """A change seen by ``files.watch_dir``: type is create, write, remove, rename, chmod or overflow."""

    name: str  # relative to the watched directory
    type: str
    path: str = ""
    is_dir: bool = False


@dataclass
class SandboxMetrics:
    timestamp: float
    cpu_count: float
    cpu_used_pct: float
    mem_used: int  # bytes
    mem_total: int
    disk_used: int = 0
    disk_total: int = 0
    cpu_usage_s: float = 0.0


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
    cpu_class: str = ""  # best-effort | latency-sensitive (the CPU class its cgroup is in)
    mem_resident_bytes: int = 0  # what it holds now, as the host's reclaim service last reported (0: no report)
    mem_reclaimed_bytes: int = 0  # taken from it while it was idle (page cache, anonymous memory to swap)
    mem_merged_bytes: int = 0  # its pages merged with identical ones (KSM)
