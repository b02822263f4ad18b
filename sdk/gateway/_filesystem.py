"""envd's ``filesystem.Filesystem`` service and its ``/files`` transfer endpoint, on the bus.

Reads, writes, listings, stats and removals are the sandbox's file ops (``dsec.sbx.<id>.files``), the
long kind: entries carry owner, symlink target and metadata (``user.e2b.*`` xattrs); MakeDir and
Move are file ops too. WatchDir and the polled watchers (CreateWatcher) are inotify watches in the
sandbox (``FileWatch``): a recursive one also watches directories made after it started. Paths
resolve against the requesting user's home.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import posixpath
import re
import shlex
import stat as st
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import BodyPartReader, web

from bus.errors import DsecError, FileNotFound, InvalidArgument, QuotaExceeded
from bus.messages import (
    DirMade,
    Done,
    ExecRequest,
    ExecResult,
    FileInfo,
    FileList,
    FileListing,
    FileMakeDir,
    FileRemove,
    FileRename,
    FileStat,
    FileWrite,
    FileWritten,
)
from bus.messages import EntryInfo as WireEntry

from .._async import AsyncSandbox
from .._files import AsyncWatchHandle
from .._models import FilesystemEvent
from ._connect import ConnectError, ServerStream
from ._users import Account, Users, resolve, user_of

TYPES = {"file": "FILE_TYPE_FILE", "dir": "FILE_TYPE_DIRECTORY", "symlink": "FILE_TYPE_SYMLINK"}
EVENTS = {"create": "EVENT_TYPE_CREATE", "write": "EVENT_TYPE_WRITE", "remove": "EVENT_TYPE_REMOVE", "rename": "EVENT_TYPE_RENAME",
          "chmod": "EVENT_TYPE_CHMOD"}
_IFMT = {"file": st.S_IFREG, "dir": st.S_IFDIR, "symlink": st.S_IFLNK}
MAX_DEPTH = 16
MAX_WATCHERS = 64  # per sandbox
WATCH_SETTLE_S = 0.05  # a polled watcher's answer covers the changes made up to this long before the poll
METADATA_HEADER = "x-metadata-"
MAX_METADATA = 64  # keys per upload (the agent's limit)
MAX_METADATA_KEY = 246  # an xattr name is at most 255 bytes, "user.e2b." included


class PayloadTooLarge(Exception):
    def __init__(self, limit: int) -> None:
        super().__init__(f"upload is over the gateway's limit of {limit} bytes")
        self.limit = limit


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat().replace("+00:00", "Z")


def entry_json(e: WireEntry, names: tuple[dict[int, str], dict[int, str]] = ({}, {})) -> dict[str, Any]:
    """envd's EntryInfo of an entry; ``names``: the sandbox's user and group names by id."""
    users, groups = names
    d: dict[str, Any] = {
        "name": e.name, "type": TYPES.get(e.type, "FILE_TYPE_UNSPECIFIED"), "path": e.path, "size": str(e.size),
        "mode": e.mode & 0o7777, "permissions": st.filemode((e.mode & 0o7777) | _IFMT.get(e.type, st.S_IFREG)),
        "owner": users.get(e.uid, str(e.uid)) if e.uid >= 0 else "", "group": groups.get(e.gid, str(e.gid)) if e.gid >= 0 else "",
    }
    if e.mtime:
        d["modifiedTime"] = _iso(e.mtime)
    if e.type == "symlink":
        d["isSymlink"] = True
        d["symlinkTarget"] = e.symlink_target
    if e.metadata:
        d["metadata"] = dict(e.metadata)
    return d


def metadata_of(request: web.Request) -> dict[str, str]:
    """The upload's ``X-Metadata-<key>`` headers (keys lowercased, as envd stores them)."""
    meta = {k[len(METADATA_HEADER):].lower(): v for k, v in request.headers.items() if k.lower().startswith(METADATA_HEADER)}
    if len(meta) > MAX_METADATA or any(not k or len(k) > MAX_METADATA_KEY for k in meta):
        raise InvalidArgument(f"metadata: at most {MAX_METADATA} keys of 1..{MAX_METADATA_KEY} characters")
    return meta


@dataclass
class Watcher:
    """A polled watcher (CreateWatcher): its inotify watch queues events until GetWatcherEvents."""

    sandbox_id: str
    handle: AsyncWatchHandle
    include_entry: bool


class Filesystem:
    def __init__(self, users: Users, max_upload: int) -> None:
        self.users = users
        self.max_upload = max_upload
        self.watchers: dict[str, Watcher] = {}  # the sync e2b SDK's polled watchers (CreateWatcher)

    async def _watch_target(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> tuple[str, bool]:
        acct = await self._acct(request, sb)
        path = resolve(body.get("path", ""), acct.home)
        if (await self.stat(sb, path, follow=True)).type != "dir":
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        return path, bool(body.get("recursive"))

    async def _acct(self, request: web.Request, sb: AsyncSandbox, user: str | None = None) -> Account:
        return await self.users.account(sb, user or user_of(request.headers.get("Authorization")))

    @staticmethod
    async def _sh(sb: AsyncSandbox, line: str) -> ExecResult:
        res: ExecResult = await sb._request("exec", ExecRequest(cmd=line, timeout_s=30), ExecResult, timeout=40)
        return res

    async def _chown(self, sb: AsyncSandbox, acct: Account, path: str) -> None:
        if acct.uid != 0:  # the agent writes as root; the user must own what it asked for
            await self._sh(sb, f"chown {acct.uid}:{acct.gid} -- {shlex.quote(path)}")

    async def stat(self, sb: AsyncSandbox, path: str, *, follow: bool = False) -> WireEntry:
        try:
            info: FileInfo = await sb._request("files", FileStat(path=path, follow_symlinks=follow, long=True), FileInfo)
        except FileNotFound:
            raise ConnectError("not_found", f"path {path} does not exist") from None
        return info.entry

    async def _list(self, sb: AsyncSandbox, path: str, depth: int) -> list[WireEntry]:
        """The entries to ``depth`` levels, as envd walks them: by name, each directory followed by
        what it holds."""
        try:
            res: FileListing = await sb._request("files", FileList(path=path, long=True), FileListing)
        except FileNotFound:
            raise ConnectError("not_found", f"directory {path} does not exist") from None
        entries = sorted(res.entries, key=lambda e: e.name.encode("utf-8", "surrogateescape"))
        if depth <= 1:
            return entries
        subs = iter(await asyncio.gather(*(self._list(sb, e.path, depth - 1) for e in entries if e.type == "dir")))
        out: list[WireEntry] = []
        for e in entries:
            out.append(e)
            if e.type == "dir":
                out += next(subs)
        return out

    async def _json(self, sb: AsyncSandbox, entries: list[WireEntry]) -> list[dict[str, Any]]:
        names = await self.users.names(sb)
        return [entry_json(e, names) for e in entries]

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
        return {"entry": (await self._json(sb, [await self.stat(sb, path)]))[0]}

    async def _rpc_ListDir(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, path = await self._path(request, sb, body)
        depth = body.get("depth") or 1
        if not isinstance(depth, int) or not 1 <= depth <= MAX_DEPTH:
            raise ConnectError("invalid_argument", f"depth must be 1..{MAX_DEPTH}")
        if (await self.stat(sb, path, follow=True)).type != "dir":
            raise ConnectError("invalid_argument", f"path {path} is not a directory")
        return {"entries": await self._json(sb, await self._list(sb, path, depth))}

    async def _rpc_MakeDir(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        acct, path = await self._path(request, sb, body)
        made: DirMade = await sb._request("files", FileMakeDir(path=path), DirMade)
        if not made.created:
            raise ConnectError("already_exists", f"directory {path} already exists")
        await self._chown(sb, acct, path)
        return {"entry": (await self._json(sb, [await self.stat(sb, path)]))[0]}

    async def _rpc_Move(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, src = await self._path(request, sb, body, "source")
        _, dst = await self._path(request, sb, body, "destination")
        try:
            info: FileInfo = await sb._request("files", FileRename(path=src, new_path=dst), FileInfo)
        except FileNotFound:
            raise ConnectError("not_found", f"path {src} does not exist") from None
        return {"entry": (await self._json(sb, [info.entry]))[0]}

    async def _rpc_Remove(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, path = await self._path(request, sb, body)
        try:
            await sb._request("files", FileRemove(path=path), Done)
        except FileNotFound:
            pass  # envd removes with os.RemoveAll: a path that is not there is removed already
        return {}

    async def _watch(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any], on_event: Callable[[FilesystemEvent], Any] | None) -> AsyncWatchHandle:
        path, recursive = await self._watch_target(request, sb, body)
        try:
            return await sb.files.watch_dir(path, on_event, recursive=recursive)
        except FileNotFound:
            raise ConnectError("not_found", f"directory {path} does not exist") from None

    async def _event_json(self, sb: AsyncSandbox, ev: FilesystemEvent, include_entry: bool) -> dict[str, Any] | None:
        kind = EVENTS.get(ev.type)
        if kind is None:
            return None  # overflow: the kernel dropped events; envd has no event type for it
        d: dict[str, Any] = {"name": ev.name, "type": kind}
        if include_entry and ev.type != "remove" and ev.path:
            try:
                d["entry"] = (await self._json(sb, [await self.stat(sb, ev.path)]))[0]
            except (ConnectError, DsecError):
                pass  # gone again since: envd includes the entry "when available"
        return d

    async def _rpc_CreateWatcher(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        if sum(1 for w in self.watchers.values() if w.sandbox_id == sb.sandbox_id) >= MAX_WATCHERS:
            raise ConnectError("resource_exhausted", f"sandbox {sb.sandbox_id} already has {MAX_WATCHERS} watchers")
        wid = uuid.uuid4().hex
        self.watchers[wid] = Watcher(sb.sandbox_id, await self._watch(request, sb, body, None), bool(body.get("includeEntry")))
        return {"watcherId": wid}

    def _watcher(self, sb: AsyncSandbox, body: dict[str, Any]) -> tuple[str, Watcher]:
        wid = str(body.get("watcherId", ""))
        w = self.watchers.get(wid)
        if w is None or w.sandbox_id != sb.sandbox_id:
            raise ConnectError("not_found", f"watcher {wid!r} not found")
        return wid, w

    async def _rpc_GetWatcherEvents(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        _, w = self._watcher(sb, body)
        # The events of a change travel beside its reply: give the ones of changes just made time to arrive.
        await asyncio.sleep(WATCH_SETTLE_S)
        try:
            got = w.handle.get_new_events()
        except DsecError as exc:
            raise ConnectError("data_loss", exc.description) from None
        events = [await self._event_json(sb, ev, w.include_entry) for ev in got]
        return {"events": [e for e in events if e is not None]}

    async def _rpc_RemoveWatcher(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> dict[str, Any]:  # noqa: N802
        wid, w = self._watcher(sb, body)
        self.watchers.pop(wid, None)
        await w.handle.stop()
        return {}

    async def forget(self, sid: str) -> None:
        for wid in [k for k, w in self.watchers.items() if w.sandbox_id == sid]:
            await self.watchers.pop(wid).handle._close_sub()

    async def watch(self, request: web.Request, sb: AsyncSandbox, body: dict[str, Any]) -> web.StreamResponse:
        """WatchDir: the sandbox's inotify events as a server stream, until the client leaves."""
        queue: asyncio.Queue[FilesystemEvent] = asyncio.Queue()
        handle = await self._watch(request, sb, body, queue.put_nowait)
        include_entry = bool(body.get("includeEntry"))
        stream = ServerStream(request)
        try:
            await stream.send({"start": {}})
            while True:
                get = asyncio.ensure_future(queue.get())
                ended = asyncio.ensure_future(handle.ended.wait())
                done, _ = await asyncio.wait({get, ended}, return_when=asyncio.FIRST_COMPLETED)
                ended.cancel()
                if get not in done:
                    get.cancel()
                    return await stream.close(ConnectError("unavailable", f"the watch of {handle.path} ended (the sandbox stopped)"))
                ev = await self._event_json(sb, get.result(), include_entry)
                if ev is not None:
                    await stream.send({"filesystem": ev})
        except ConnectionResetError:
            return stream.resp
        finally:
            await handle.stop()

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

    async def upload(self, request: web.Request, sb: AsyncSandbox) -> list[dict[str, Any]]:
        """POST /files: one file (octet-stream, ``?path=``) or any number (multipart, one part each,
        named by ``?path=`` or its filename), each owned by the user and given the request's
        ``X-Metadata-*`` (replacing what the file had), as envd does."""
        if request.content_length is not None and request.content_length > self.max_upload:
            raise PayloadTooLarge(self.max_upload)
        acct = await self._acct(request, sb, request.query.get("username"))
        qpath = request.query.get("path")
        meta = metadata_of(request)
        written: list[dict[str, Any]] = []

        async def one(name: str, chunks: AsyncIterator[bytes], size: int = -1) -> None:
            path = resolve(name, acct.home)
            if not await self._write(sb, path, chunks, acct, meta, size):
                await self._chown(sb, acct, path)  # an agent from before owners and metadata
            written.append({"name": posixpath.basename(path), "type": "file", "path": path, **({"metadata": meta} if meta else {})})

        if request.content_type == "multipart/form-data":
            reader = await request.multipart()
            while True:
                part = await reader.next()
                if part is None:
                    break
                if not isinstance(part, BodyPartReader):
                    continue
                name = qpath or _part_filename(part)
                if not name:
                    raise InvalidArgument("a multipart upload needs ?path= or a filename per part")
                await one(name, _part_chunks(part, sb.files._chunk()))
        else:
            if not qpath:
                raise InvalidArgument("?path= is required")
            # the body's length is the file's: the tenant's upload bound reserves it at the first chunk (hostagent._uploads)
            await one(qpath, _body_chunks(request, sb.files._chunk()), request.content_length if request.content_length is not None else -1)
        return written

    async def _write(self, sb: AsyncSandbox, path: str, chunks: AsyncIterator[bytes], acct: Account, meta: dict[str, str], size: int = -1) -> bool:
        """Write the file; the first request carries its owner, metadata and ``size`` (when known). True
        when the host applied them."""
        off = 0
        attrs = True
        first = True
        owner = (acct.uid, acct.gid) if acct.uid != 0 else (-1, -1)  # the agent writes as root
        async for piece in _first_or_empty(chunks):
            if off + len(piece) > self.max_upload:
                raise PayloadTooLarge(self.max_upload)
            req = FileWrite(path=path, data=piece, offset=off, truncate=first)
            if first:
                req.uid, req.gid, req.metadata, req.size = owner[0], owner[1], meta, size
            try:
                w: FileWritten = await sb._request("files", req, FileWritten)
            except QuotaExceeded:
                if off:  # refused mid-way (a multipart part: its size was not known): no half file is left
                    with contextlib.suppress(DsecError):
                        await sb.files.remove(path)
                raise
            if first:
                attrs = w.attrs
            first = False
            off += len(piece)
        return attrs


_FILENAME = re.compile(r'filename="((?:[^"\\]|\\.)*)"')


def _part_filename(part: BodyPartReader) -> str | None:
    """A part's filename as sent: the e2b SDK names each part of a batch write by its path, absolute
    or relative (aiohttp's ``part.filename`` drops a leading slash)."""
    m = _FILENAME.search(part.headers.get("Content-Disposition", ""))
    return re.sub(r"\\(.)", r"\1", m.group(1)) if m else part.filename


async def _first_or_empty(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The chunks, or one empty one when there are none (an empty file is written too)."""
    empty = True
    async for c in chunks:
        empty = False
        yield c
    if empty:
        yield b""


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
