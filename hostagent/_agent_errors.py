"""The one translation of the in-sandbox agent's errnos into the typed errors clients see, for every
backend that runs the agent (``_agent``) and for the host-side ops that drive it (``_execio``)."""

from __future__ import annotations

import contextlib
import errno as _errno
from collections.abc import Iterator

from bus.errors import DsecError, FileError, FileNotFound, InvalidArgument, NotSupported, ProcessNotFound, SandboxNotFound, UnknownUser

from ._agent import AgentError, AgentUnavailable


def translate(
    exc: AgentError | AgentUnavailable, sid: str, *, path: str = "", pid: int = 0, user: str = "", cwd: str = "", exec_: bool = False,
    trusted: bool = False,
) -> DsecError:
    """``exc`` as a typed error. What the request named decides between readings of one errno:
    ``pid`` (a process op), ``user``/``cwd`` (an exec), ``path`` (a file op or watch)."""
    if isinstance(exc, AgentUnavailable):
        return SandboxNotFound(f"sandbox {sid} does not answer: {exc.message}")
    e = exc.errno
    if e == _errno.ESRCH and pid:
        return ProcessNotFound(f"no process {pid} in sandbox {sid} (it ended, or was never started by dsec)", pid=pid)
    if e == _errno.ESRCH and user:
        return UnknownUser(f"user {user!r} is not in the sandbox's /etc/passwd", user=user)
    if e == _errno.ENOENT and cwd:
        return InvalidArgument(f"cwd {cwd!r} does not exist in the sandbox")
    if trusted and e in (_errno.ENOTSUP, _errno.EPROTO):
        why = exc.message if e == _errno.ENOTSUP else "its agent predates trusted runs (recreate the sandbox)"
        return NotSupported(f"no trusted run in sandbox {sid}: {why}")
    if exec_:
        return FileError(f"exec failed: {exc.message}")
    if e == _errno.EPIPE:
        return InvalidArgument(f"process {pid} has no open stdin (start it with stdin=True; closed stays closed)", pid=pid)
    if e == _errno.EAGAIN:
        return InvalidArgument(f"process {pid} is not reading its stdin: {exc.message}", pid=pid)
    if e == _errno.ENOENT:
        return FileNotFound(f"{path}: no such file or directory")
    if e == _errno.ENOTDIR:
        return InvalidArgument(f"{path}: not a directory")
    if e == _errno.EEXIST:
        return FileError(f"{path}: exists and is not a directory")
    if e == _errno.ENOSPC:
        return FileError(f"{path}: no space left (the sandbox's disk_mb is full)")
    return FileError(f"{path or 'sandbox'}: {exc.message}")


@contextlib.contextmanager
def agent_errors(sid: str, pid: int = 0, path: str = "", *, user: str = "", cwd: str = "", exec_: bool = False) -> Iterator[None]:
    """Raise what the agent reports inside as its typed error (``translate``)."""
    try:
        yield
    except (AgentUnavailable, AgentError) as exc:
        raise translate(exc, sid, path=path, pid=pid, user=user, cwd=cwd, exec_=exec_) from None


__all__ = ["agent_errors", "translate"]
