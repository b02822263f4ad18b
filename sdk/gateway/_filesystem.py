"""envd's ``filesystem.Filesystem`` service and its ``/files`` transfer endpoint, on the bus.

Reads, writes, listings and removals are the sandbox's file ops (``dsec.sbx.<id>.files``); Stat
is a listing of the parent; MakeDir and Move run ``mkdir``/``mv`` in the sandbox; WatchDir polls
listings and reports the differences. Paths resolve against the requesting user's home.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import posixpath
import shlex
import stat as st
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from bus.errors import FileNotFound, InvalidArgument
from bus.messages import (
    ExecRequest,
    ExecResult,
    FileWrite,
    FileWritten,
)

from .._async import AsyncSandbox
from .._models import EntryInfo
from ._connect import ConnectError, ServerStream
from ._users import Account, Users, resolve, user_of

TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
_IFMT = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}
WATCH_POLL_S = 0.5
MAX_DEPTH = 16
MAX_WATCHERS = 64  # per sandbox


class PayloadTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"upload is over the gateway's limit of {limit} bytes")
        self.limit = limit


def entry_json(e: EntryInfo) -> dict[str, Any]:
    d: dict[str, Any] = {
        "name": e.name, "type": TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path, "size": str(e.size),
        "mode": e.mode & 0o7777, "permissions": st.filemode((e.mode & 0o7777) | _IFMT.get(e.type, st.S_IFREG)),
        "owner": "", "group": "",
    }
    if e.mtime:
        d["modifiedTime"] = dt.datetime.fromtimestamp(e.mtime, dt.UTC).isoformat().replace("+00:00", "Z")
    if e.type == "symlink":
        d["isSymlink"] = True
    return d


def _diff(before: dict[str, tuple[float, int]], now: dict[str, tuple[float, int]]) -> list[dict[str, str]]:
    """Filesystem events between two listings (name -> (mtime, size))."""
    out = [{"name": n, "type": "EVENT_TYPE_CREATE"} for n in sorted(now.keys() - before.keys())]
    out += [{"name": n, "type": "EVENT_TYPE_WRITE"} for n in sorted(k for k in now.keys() & before.keys() if now[k] != before[k])]
    out += [{"name": n, "type": "EVENT_TYPE_REMOVE"} for n in sorted(before.keys() - now.keys())]
    return out


@dataclass
class Watcher:
    sandbox_id: str
    path: str
    depth: int
    snapshot: dict[str, tuple[float, int]]


class Filesystem:
    def __init__(self, users: Users, max_upload: int) -> None:
        self.users = users
        self.max_upload = max_upload
        self.watchers: dict[str, Watcher] = {}  # the sync e2b SDK's polled watchers (CreateWatcher)

    async def _snap(self, sb: AsyncSandbox, path: str, depth: int) -> dict[str, tuple[float, int]]:
        return {posixpath.relpath(e.path, path): (e.mtime, e.size) for e in await self._list(sb, path, depth)}

    async def _watch_target(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> tuple[str, int]:
        acct = await self._acct(request, sb)
        path = resolve(body.get("path", ""), acct.home)
        if (await self.stat(sb, path)).type != "dir":
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        return path, MAX_DEPTH if body.get("recursive") else 1

    async def _acct(self, request: web.Request, sb: AsyncSandbox, user: str | None = None) -> Account:
        return await self.users.account(sb, user or user_of(request.headers.get("Authorization")))

    @staticmethod
    async def _sh(sb: AsyncSandbox, line: str) -> ExecResult:
        res: ExecResult = await sb._request("exec", ExecRequest(cmd=line, timeout_s=30), ExecResult, timeout=40)
        return res

    async def _chown(self, sb: AsyncSandbox, acct: Account, path: str) -> None:
        if acct.uid != 0:  # the agent writes as root; the user must own what it asked for
            await self._sh(sb, f"chown {acct.uid}:{acct.gid} -- {shlex.quote(path)}")

    async def stat(self, sb: AsyncSandbox, path: str) -> EntryInfo:
        try:
            return await sb.files.get_info(path)
        except FileNotFound:
            raise ConnectError("not_found", f"path {path} does not exist") from None

    async def _list(self, sb: AsyncSandbox, path: str, depth: int) -> list[EntryInfo]:
        try:
            entries = await sb.files.list(path)
        except FileNotFound:
            raise ConnectError("not_found", f"directory {path} does not exist") from None
        out = list(entries)
        if depth > 1:
            subs = await asyncio.gather(*(self._list(sb, e.path, depth - 1) for e in entries if e.type == "dir"))
            for s in subs:
                out += s
        return out

    # --- the Connect service -------------------------------------------------------------------------------
    async def unary(self, method: str, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:
        fn = getattr(self, f"_rpc_{method}", None) if method.isalpha() else None
        if fn is None:
            raise ConnectError("unimplemented", f"filesystem.Filesystem/{method} is not implemented by dsec's gateway")
        out: dict[str, Any] = await fn(request, sb, body)
        return out

    async def _path(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any], name: str = "path") -> tuple[Account, str]:
        acct = await self._acct(request, sb)
        return acct, resolve(body.get(name, ""), acct.home)

    async def _rpc_Stat(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802 - the RPC's name
        _, path = await self._path(request, sb, body)
        return {"entry": entry_json(await self.stat(sb, path))}

    async def _rpc_ListDir(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, path = await self._path(request, sb, body)
        depth = body.get("depth") or 1
        if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be 1..{MAX_DEPTH}")
        if (await self.stat(sb, path)).type != "dir":
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        return {"entries": [entry_json(e) for e in await self._list(sb, path, depth)]}

    async def _rpc_MakeDir(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        acct, path = await self._path(request, sb, body)
        if not await sb.files.make_dir(path):
            raise ConnectError("already_exists", f"directory {path} already exists")
        await self._chown(sb, acct, path)
        return {"entry": entry_json(await self.stat(sb, path))}

    async def _rpc_Move(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, src = await self._path(request, sb, body, "source")
        _, dst = await self._path(request, sb, body, "destination")
        try:
            return {"entry": entry_json(await sb.files.rename(src, dst))}
        except FileNotFound:
            raise ConnectError("not_found", f"path {src} does not exist") from None

    async def _rpc_Remove(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, path = await self._path(request, sb, body)
        try:
            await sb.files.remove(path)
        except FileNotFound:
            raise ConnectError("not_found", f"path {path} does not exist") from None
        return {}

    async def _rpc_CreateWatcher(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        if sum(1 for w in self.watchers.values() if w.sandbox_id == sb.sandbox_id) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"sandbox {sb.sandbox_id} already has {MAX_WATCHERS} watchers")
        path, depth = await self._watch_target(request, sb, body)
        wid = uuid.uuid4().hex
        self.watchers[wid] = Watcher(sb.sandbox_id, path, depth, await self._snap(sb, path, depth))
        return {"watcherId": wid}

    def _watcher(self, sb: AsyncSandbox, body: dict[str, Any]) -> tuple[str, Watcher]:
        wid = str(body.get("watcherId", ""))
        w = self.watchers.get(wid)
        if w is None or w.sandbox_id != sb.sandbox_id:
            raise ConnectError("not_found", f"watcher {wid!r} not found")
        return wid, w

    async def _rpc_GetWatcherEvents(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, w = self._watcher(sb, body)
        now = await self._snap(sb, w.path, w.depth)
        events, w.snapshot = _diff(w.snapshot, now), now
        return {"events": events}

    async def _rpc_RemoveWatcher(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        wid, _ = self._watcher(sb, body)
        self.watchers.pop(wid, None)
        return {}

    async def watch(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> web.StreamResponse:
        """WatchDir by polling listings: CREATE, WRITE and REMOVE events, as a server stream."""
        path, depth = await self._watch_target(request, sb, body)
        stream = ServerStream(request)
        before = await self._snap(sb, path, depth)
        await stream.send({"start": {}})
        try:
            while True:
                await asyncio.sleep(WATCH_POLL_S)  # poll interval of the listing-based watcher
                try:
                    now = await self._snap(sb, path, depth)
                except ConnectError as err:
                    return await stream.close(err)
                for ev in _diff(before, now):
                    await stream.send({"filesystem": ev})
                before = now
        except ConnectionResetError:
            return stream.resp

    # --- GET/POST /files ------------------------------------------------------------------------------------
    async def download(self, request: web.Request, sb: AsyncSandbox) -> web.StreamResponse:
        acct = await self._acct(request, sb, request.query.get("username"))
        path = resolve(request.query.get("path", ""), acct.home)
        info = await sb.files.get_info(path)
        if info.type == "dir":
            raise InvalidArgument(f"{path} is a directory")
        piece = sb.files._chunk()
        first = await sb.files.read(path, format="bytes", length=piece)
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "application/octet-stream", "Content-Disposition": f'attachment; filename="{posixpath.basename(path)}"',
        })
        await resp.prepare(request)
        await resp.write(first)
        off = len(first)
        while len(first) == piece:
            first = await sb.files.read(path, format="bytes", offset=off, length=piece)
            await resp.write(first)
            off += len(first)
        await resp.write_eof()
        return resp

    async def upload(self, request: web.Request, sb: AsyncSandbox) -> list[dict[str, str]]:
        if request.content_length is not None and request.content_length > self.max_upload:
            raise PayloadTooLarge(self.max_upload)
        acct = await self._acct(request, sb, request.query.get("username"))
        qpath = request.query.get("path")
        written: list[dict[str, str]] = []
        if request.content_type == "multipart/form-data":
            reader = await request.multipart()
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):
                    continue
                name = qpath or part.filename
                if not name:
                    raise InvalidArgument("a multipart upload needs ?path= or a filename per part")
                path = resolve(name, acct.home)
                await self._write(sb, path, _part_chunks(part, sb.files._chunk()))
                await self._chown(sb, acct, path)
                written.append({"name": posixpath.basename(path), "type": "file", "path": path})
        else:
            if not qpath:
                raise InvalidArgument("?path= is required")
            path = resolve(qpath, acct.home)
            await self._write(sb, path, _body_chunks(request, sb.files._chunk()))
            await self._chown(sb, acct, path)
            written.append({"name": posixpath.basename(path), "type": "file", "path": path})
        return written

    async def _write(self, sb: AsyncSandbox, path: str, chunks: AsyncIterator[bytes]) -> None:
        off = 0
        async for piece in chunks:
            if off + len(piece) > self.max_upload:
                raise PayloadTooLarge(self.max_upload)
            await sb._request("files", FileWrite(path=path, data=piece, offset=off, truncate=off == 0), FileWritten)
            off += len(piece)
        if off == 0:
            await sb.files.write(path, b"")


async def _gather(read: Callable[[], Awaitable[bytes]], size: int) -> AsyncIterator[bytes]:
    """Pieces of ``size`` bytes (the last shorter) from a reader returning b"" at the end."""
    buf = bytearray()
    while True:
        got = await read()
        if not got:
            break
        buf += got
        while len(buf) >= size:
            yield bytes(buf[:size])
            del buf[:size]
    if buf:
        yield bytes(buf)


def _part_chunks(part: BodyPartReader, size: int) -> AsyncIterator[bytes]:
    return _gather(lambda: part.read_chunk(size), size)


def _body_chunks(request: web.Request, size: int) -> AsyncIterator[bytes]:
    return _gather(lambda: request.content.read(size), size)


__all__ = ["Filesystem", "PayloadTooLarge", "entry_json"]
