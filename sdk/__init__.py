"""The dsec Python SDK: ``Sandbox`` (sync) and ``AsyncSandbox``, E2B-shaped."""

from ._async import AsyncSandbox, build_spec
from ._builder import BuildReport, TemplateBuilder, build_dockerfile, build_from_image
from ._commands import AsyncCommandHandle
from ._files import AsyncWatchHandle
from ._fncall import AsyncFnCall, FnCall
from ._models import CommandResult, EntryInfo, FilesystemEvent, ProcessInfo, SandboxInfo, SandboxMetrics, WriteInfo
from ._snapshots import SnapshotInfo
from ._sync import CommandHandle, Sandbox, WatchHandle
from ._trajectory import TrajectoryStep
from .errors import (
    CommandExitError,
    CommandTimeoutError,
    DsecError,
    InvalidArgument,
    KillPending,
    NoCapacity,
    OutputLost,
    ProcessNotFound,
    ReplyTooLarge,
    SandboxNotFound,
    SandboxTimeout,
    Unavailable,
    UnknownTemplate,
    UnknownUser,
)

__all__ = [
    "Sandbox",
    "AsyncSandbox",
    "FnCall",
    "AsyncFnCall",
    "build_spec",
    "BuildReport",
    "TemplateBuilder",
    "build_dockerfile",
    "build_from_image",
    "CommandResult",
    "EntryInfo",
    "SandboxInfo",
    "SnapshotInfo",
    "TrajectoryStep",
    "WriteInfo",
    "DsecError",
    "CommandExitError",
    "CommandTimeoutError",
    "InvalidArgument",
    "KillPending",
    "NoCapacity",
    "SandboxNotFound",
    "SandboxTimeout",
    "Unavailable",
    "UnknownTemplate",
    "UnknownUser",
    "OutputLost",
    "ProcessNotFound",
    "ReplyTooLarge",
    "AsyncCommandHandle",
    "AsyncWatchHandle",
    "CommandHandle",
    "WatchHandle",
    "FilesystemEvent",
    "ProcessInfo",
    "SandboxMetrics",
    "OpenEnvProvider",
]


def __getattr__(name: str) -> object:
    if name == "OpenEnvProvider":  # imported when asked for: with openenv-core installed its import is heavy (FastAPI, MCP)
        from ._openenv import OpenEnvProvider

        return OpenEnvProvider
    raise AttributeError(f"module 'sdk' has no attribute {name!r}")
