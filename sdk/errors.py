"""The SDK's exceptions: every one is a ``DsecError`` with a stable ``code``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bus.errors import (
    BadRequest,
    CreateFailed,
    DsecError,
    FileError,
    FileNotFound,
    HostRejected,
    InternalError,
    InvalidArgument,
    KillPending,
    NoCapacity,
    NotSupported,
    OutputLost,
    PermissionDenied,
    ProcessNotFound,
    ReplyTooLarge,
    SandboxNotFound,
    SandboxTimeout,
    Unavailable,
    UnknownTemplate,
    UnknownUser,
)

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


__all__ = [
    "DsecError",
    "BadRequest",
    "CommandExitError",
    "CommandTimeoutError",
    "CreateFailed",
    "FileError",
    "FileNotFound",
    "HostRejected",
    "InternalError",
    "InvalidArgument",
    "KillPending",
    "NoCapacity",
    "NotSupported",
    "PermissionDenied",
    "SandboxNotFound",
    "SandboxTimeout",
    "Unavailable",
    "UnknownTemplate",
    "UnknownUser",
    "OutputLost",
    "ProcessNotFound",
    "ReplyTooLarge",
]
