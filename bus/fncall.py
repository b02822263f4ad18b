"""FnCall's shared rules: the limits of a call and the check both the client and the host run (the
host again, as defence in depth), so a bad call is refused with the same ``invalid_argument`` on
either side and never reaches a pool member."""

from __future__ import annotations

import posixpath

from .errors import InvalidArgument
from .messages import FnCallRequest

FN_WORKDIR = "/workspace"  # where a call's files are written and its commands run
FN_TIMEOUT_S = (0.001, 600.0)  # a run's or a compile's timeout
FN_QUEUE_S = (0.0, 300.0)  # how long a call may wait for a free pool member
FN_MEMORY_MB = (16, 16384)  # a call's memory limit, when it sets one
FN_MAX_BYTES = 6 * 1024 * 1024  # code, files and stdin of one call together (under NATS's max_payload)
FN_MAX_FILES = 256
FN_MAX_OUTPUT = 8 * 1024 * 1024


def check_path(path: str) -> str:
    """``path`` as a normalised path inside the working directory; InvalidArgument when it is empty,
    absolute outside it, or climbs out (``..``)."""
    if not path or "\0" in path:
        raise InvalidArgument(f"file path {path!r} is empty or holds a NUL byte")
    rel = path[len(FN_WORKDIR) + 1:] if path.startswith(FN_WORKDIR + "/") else path
    norm = posixpath.normpath(rel)
    if posixpath.isabs(norm) or norm == ".." or norm.startswith("../") or norm == ".":
        raise InvalidArgument(f"file path {path!r} is outside the working directory {FN_WORKDIR}")
    return norm


def _range(name: str, value: float, lo: float, hi: float) -> None:
    if not (lo <= value <= hi):  # (NaN fails too)
        raise InvalidArgument(f"{name} must be between {lo:g} and {hi:g}, got {value!r}")


def check_call(req: FnCallRequest) -> None:
    """Refuse a call outside the limits above (InvalidArgument, saying which)."""
    if not req.cmd.strip():
        raise InvalidArgument("the command is empty")
    _range("timeout", req.timeout_s, *FN_TIMEOUT_S)
    if req.compile_cmd:
        _range("compile timeout", req.compile_timeout_s, *FN_TIMEOUT_S)
    _range("queue wait", req.queue_s, *FN_QUEUE_S)
    if req.memory_mb:
        _range("memory limit (MB)", req.memory_mb, *FN_MEMORY_MB)
    _range("output cap", req.output_cap, 0, FN_MAX_OUTPUT)
    if len(req.files) > FN_MAX_FILES or len(req.fetch_files) > FN_MAX_FILES:
        raise InvalidArgument(f"at most {FN_MAX_FILES} files to write and {FN_MAX_FILES} to fetch")
    size = len(req.cmd) + len(req.compile_cmd) + len(req.stdin) + sum(len(f.data) for f in req.files)
    if size > FN_MAX_BYTES:
        raise InvalidArgument(f"the call carries {size} bytes of code, files and stdin; at most {FN_MAX_BYTES}", size=size)
    for f in req.files:
        check_path(f.path)
    for p in req.fetch_files:
        check_path(p)


__all__ = ["FN_MAX_BYTES", "FN_MEMORY_MB", "FN_QUEUE_S", "FN_TIMEOUT_S", "FN_WORKDIR", "check_call", "check_path"]
