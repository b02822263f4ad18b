"""Exec and file operations through a sandbox's in-sandbox agent, shared by every backend that runs
one (container, microvm): the SDK's requests mapped onto ``AgentClient`` calls and the agent's errno
errors onto the typed errors (``_agent_errors``)."""

from __future__ import annotations

from typing import Any

from bus.errors import InvalidArgument, SandboxNotFound
from bus.messages import (
    DirMade,
    Done,
    EntryInfo,
    ExecRequest,
    ExecResult,
    Exists,
    FileData,
    FileExists,
    FileInfo,
    FileList,
    FileListing,
    FileMakeDir,
    FileOp,
    FileRead,
    FileRemove,
    FileRename,
    FileStat,
    FileUnwatch,
    FileWrite,
    FileWritten,
)

from ._agent import AgentClient, AgentError, DirEntry
from ._agent_errors import translate
from ._backend import OnOutput, OnStart
from ._execio import result_of

DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
READ_CHUNK = 4 * 1024 * 1024


def _entry(e: DirEntry) -> EntryInfo:
    return EntryInfo(
        name=e.name, path=e.path, type=e.type, size=e.size, mode=e.mode, mtime=e.mtime, uid=e.uid, gid=e.gid,
        symlink_target=e.symlink_target, metadata=e.metadata,
    )


def agent_of(clients: dict[str, AgentClient], sandbox_id: str) -> AgentClient:
    """The sandbox's connected agent in a backend's map of them; SandboxNotFound when it has none."""
    c = clients.get(sandbox_id)
    if c is None:
        raise SandboxNotFound(f"sandbox {sandbox_id} is not running on this host")
    return c


async def agent_exec(
    client: AgentClient, sandbox_id: str, req: ExecRequest, on_output: OnOutput | None, on_start: OnStart | None,
) -> ExecResult:
    env = dict(req.envs) if req.trusted else {**DEFAULT_ENV, **req.envs}  # trusted: the agent's fixed set instead
    try:  # (no context manager on the exec path: nothing added to a round trip that succeeds)
        out = await client.exec(
            req.cmd, env=env, cwd=req.cwd or None, timeout_s=req.timeout_s or None, on_output=on_output,
            cap=req.output_cap if req.output_cap >= 0 else None, background=req.background, stdin=req.stdin,
            user=req.user, on_start=on_start, trusted=req.trusted,
        )
    except AgentError as exc:  # AgentUnavailable too
        raise translate(exc, sandbox_id, user=req.user, cwd=req.cwd, exec_=True, trusted=req.trusted) from None
    return result_of(out)


async def agent_files(c: AgentClient, sandbox_id: str, op: FileOp) -> Any:
    try:
        match op:
            case FileWrite(path=p, data=d, offset=off, truncate=tr, mode=mode, uid=uid, gid=gid, metadata=meta):
                owner = (uid, gid) if uid >= 0 and gid >= 0 else None
                await c.write_file(p, d, offset=off, truncate=tr, mode=mode, owner=owner, metadata=meta)
                return FileWritten(path=p, size=off + len(d), attrs=(owner is not None or meta is not None) and c.long_entries)
            case FileRead(path=p, offset=off, length=n):
                # One reply carries at most READ_CHUNK: a longer read comes back short (FileData.size
                # tells the rest), so no request makes the host hold more than that in memory.
                data, size = await c.read_file(p, offset=off, length=min(n, READ_CHUNK) if n >= 0 else READ_CHUNK)
                return FileData(data=data, size=size, offset=off)
            case FileList(path=p, long=long):
                return FileListing(entries=[_entry(e) for e in await c.list_dir(p, long=long)])
            case FileRemove(path=p):
                await c.remove(p)
                return Done()
            case FileExists(path=p):
                return Exists(exists=await c.exists(p))
            case FileMakeDir(path=p, mode=mode):
                return DirMade(path=p, created=await c.mkdir(p, mode))
            case FileRename(path=p, new_path=dst):
                await c.rename(p, dst)
                return FileInfo(entry=_entry(await c.stat(dst, follow_symlinks=False, long=True)))
            case FileStat(path=p, follow_symlinks=follow, long=long):
                return FileInfo(entry=_entry(await c.stat(p, follow_symlinks=follow, long=long)))
    except AgentError as exc:  # AgentUnavailable too
        raise translate(exc, sandbox_id, path="" if isinstance(op, FileUnwatch) else op.path) from None
    raise InvalidArgument(f"unsupported file operation {type(op).__name__}")


__all__ = ["DEFAULT_ENV", "READ_CHUNK", "agent_exec", "agent_files", "agent_of"]
