"""The dsec Python SDK: ``Sandbox`` (sync) and ``AsyncSandbox``, E2B-shaped."""

from ._async import AsyncSandbox, build_spec
from ._models import CommandResult, EntryInfo, SandboxInfo, WriteInfo
from ._snapshots import SnapshotInfo
from ._sync import Sandbox
from .errors import (
    CommandExitError,
    CommandTimeoutError,
    DsecError,
    InvalidArgument,
    NoCapacity,
    SandboxNotFound,
    SandboxTimeout,
    Unavailable,
    UnknownTemplate,
)

__all__ = [
    "Sandbox",
    "AsyncSandbox",
    "build_spec",
    "CommandResult",
    "EntryInfo",
    "SandboxInfo",
    "SnapshotInfo",
    "WriteInfo",
    "DsecError",
    "CommandExitError",
    "CommandTimeoutError",
    "InvalidArgument",
    "NoCapacity",
    "SandboxNotFound",
    "SandboxTimeout",
    "Unavailable",
    "UnknownTemplate",
]
