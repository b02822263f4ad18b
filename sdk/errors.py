"""The SDK's exceptions: every one is a ``DsecError`` with a stable ``code``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bus.errors import (
    BadRequest,
    BlobStoreUnavailable,
    BuildFailed,
    CreateFailed,
    DsecError,
    FileError,
    FileNotFound,
    HostRejected,
    HostUnreachable,
    ImageError,
    ImageNotFound,
    InternalError,
    InvalidArgument,
    KillPending,
    NoCapacity,
    NoSpace,
    NotSupported,
    OutputLost,
    PermissionDenied,
    PortClosed,
    ProcessNotFound,
    QuotaExceeded,
    RegistryUnavailable,
    ReplyTooLarge,
    SandboxNotFound,
    SandboxNotRunning,
    SandboxTimeout,
    SnapshotInUse,
    SnapshotUnsupported,
    TemplateTaken,
    Unavailable,
    UnknownSnapshot,
    UnknownTemplate,
    UnknownUser,
    UnsupportedBackend,
)
from bus.errors import PolicyError, PolicyTimeout, TrajectoryConflict, TrajectoryGap, TrajectoryTrimmed, UnknownJob

if TYPE_CHECKING:
    from ._models import CommandResult


class CommandExitError(DsecError):
    """A command finished with a non-zero exit code; ``.result`` holds its output."""

    code = "command_exit"

    def __init__(self, result: "CommandResult") -> None:
        super().__init__(f"command exited with code {result.exit_code}: {result.stderr[-500:]!r}", exit_code=result.exit_code)
        self.result = result
        self.exit_code = result.exit_code
        self.stdout = result.stdout
        self.stderr = result.stderr


class CommandTimeoutError(SandboxTimeout):
    """A command ran past its timeout and was killed; the sandbox lives on."""

    def __init__(self, description: str, result: "CommandResult") -> None:
        super().__init__(description)
        self.result = result


# Every error the SDK can raise: each of the bus's (a reply's code becomes its class, bus.errors.from_reply)
# and the two of its own.
__all__ = [
    "DsecError",
    "BadRequest",
    "BlobStoreUnavailable",
    "BuildFailed",
    "CreateFailed",
    "FileError",
    "FileNotFound",
    "HostRejected",
    "HostUnreachable",
    "ImageError",
    "ImageNotFound",
    "InternalError",
    "InvalidArgument",
    "KillPending",
    "NoCapacity",
    "NoSpace",
    "NotSupported",
    "OutputLost",
    "PermissionDenied",
    "PortClosed",
    "ProcessNotFound",
    "QuotaExceeded",
    "RegistryUnavailable",
    "ReplyTooLarge",
    "SandboxNotFound",
    "SandboxNotRunning",
    "SandboxTimeout",
    "SnapshotInUse",
    "SnapshotUnsupported",
    "TemplateTaken",
    "Unavailable",
    "UnknownSnapshot",
    "UnknownTemplate",
    "UnknownUser",
    "UnsupportedBackend",
    "TrajectoryConflict",
    "TrajectoryTrimmed",
    "TrajectoryGap",
    "UnknownJob",
    "PolicyError",
    "PolicyTimeout",
    "CommandExitError",
    "CommandTimeoutError",
]
