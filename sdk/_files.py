"""``sandbox.files``: read and write files of any size (in chunks), list, stat, make, move, remove,
and watch directories."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, overload

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError, InvalidArgument, OutputLost
from bus.messages import (
    DirMade,
    Done,
    Exists,
    FileData,
    FileExists,
    FileInfo,
    FileList,
    FileListing,
    FileMakeDir,
    FileRead,
    FileRemove,
    FileRename,
    FileStat,
    FileUnwatch,
    FileWatch,
    FileWritten,
    FileWrite,
    StreamAck,
    WatchStarted,
)
from bus.messages import EntryInfo as WireEntry

from ._models import EntryInfo, FilesystemEvent, WriteInfo

if TYPE_CHECKING:
    from ._async import AsyncSandbox

MAX_CHUNK = 4 << 20  # per request of a file read or write; smaller when the server's max_payload is


def _entry(e: WireEntry) -> EntryInfo:
    return EntryInfo(name=e.name, path=e.path, type=e.type, size=e.size, mode=e.mode, mtime=e.mtime)


class AsyncWatchHandle:
    """A directory watch: events go to ``on_event`` (if given) and queue for ``get_new_events()``."""

    def __init__(self, sb: "AsyncSandbox", path: str, on_event: Callable[[FilesystemEvent], Any] | None) -> None:
        self._sb = sb
        self.path = path
        self.watch_id = ""
        self._on_event = on_event
        self._inbox = sb.nc.new_inbox()
        self._events: list[FilesystemEvent] = []
        self._next_seq = 0
        self._sub: Any = None
        self.error: DsecError | None = None
        self.ended = asyncio.Event()

    async def _start(self, recursive: bool) -> "AsyncWatchHandle":
        self._sub = await self._sb.nc.subscribe(self._inbox, cb=self._on)
        try:
            res: WatchStarted = await self._sb._request("files", FileWatch(path=self.path, stream_to=self._inbox, recursive=recursive), WatchStarted)
        except BaseException:
            await self._close_sub()
            raise
        self.watch_id = res.watch_id
        return self

    async def _on(self, msg: Any) -> None:
        try:
            ev = codec.FS_EVENT.decode(msg.data)
        except BadRequest:
            return
        if ev.seq != self._next_seq and self.error is None:
            self.error = OutputLost(f"watch of {self.path} lost events: event {ev.seq} after {self._next_seq - 1}")
        self._next_seq = max(self._next_seq, ev.seq + 1)
        if ev.kind == "end":
            self.ended.set()
            return
        if ev.kind != "keepalive":
            fe = FilesystemEvent(name=ev.name, type=ev.kind, path=ev.path, is_dir=ev.is_dir)
            self._events.append(fe)
            if self._on_event is not None:
                r = self._on_event(fe)
                if inspect.isawaitable(r):
                    await r
        if ev.ack:
            try:
                await self._sb.nc.publish(S.sbx(self._sb.sandbox_id, "ack", self._sb.tenant), codec.encode(StreamAck(stream_id=self._inbox, seq=ev.seq)))
            except Exception:  # noqa: BLE001 - the host ends a watch nobody answers; the gap shows
                pass

    def get_new_events(self) -> list[FilesystemEvent]:
        """Events since the last call; OutputLost if some were lost on the way."""
        if self.error is not None:
            raise self.error
        out, self._events = self._events, []
        return out

    async def stop(self) -> None:
        try:
            await self._sb._request("files", FileUnwatch(watch_id=self.watch_id), Done)
        except DsecError:
            pass  # ended already (sandbox gone, or the host gave up on us)
        await self._close_sub()

    async def _close_sub(self) -> None:
        if self._sub is not None:
            sub, self._sub = self._sub, None
            try:
                await sub.unsubscribe()
            except Exception:  # noqa: BLE001 - connection closing
                pass


class AsyncFilesystem:
    def __init__(self, sb: "AsyncSandbox") -> None:
        self._sb = sb

    @staticmethod
    def _path(path: Any, what: str = "path") -> str:
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"{what} must be an absolute path string, got {path!r}")
        return path

    def _chunk(self) -> int:
        return max(64 << 10, min(MAX_CHUNK, self._sb.nc.max_payload // 2))

    async def write(self, path: str, data: str | bytes, *, mode: int = 0o644) -> WriteInfo:
        """Write the whole file (any size: sent in chunks under the payload limit)."""
        path = self._path(path)
        if isinstance(data, str):
            data = data.encode()
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"data must be str or bytes, got {type(data).__name__}")
        view = memoryview(data).cast("B")
        chunk = self._chunk()
        off = 0
        size = 0
        while True:
            piece = bytes(view[off:off + chunk])
            req = FileWrite(path=path, data=piece, offset=off, truncate=off == 0, mode=mode, size=len(view) if off == 0 else -1)
            w = await self._sb._request("files", req, FileWritten)
            size = w.size
            off += len(piece)
            if off >= len(view):
                break
        return WriteInfo(path=path, size=size)

    @overload
    async def read(self, path: str, *, format: Literal["text"] = "text", offset: int = 0, length: int | None = None) -> str: ...
    @overload
    async def read(self, path: str, *, format: Literal["bytes"], offset: int = 0, length: int | None = None) -> bytes: ...
    @overload
    async def read(self, path: str, *, format: Literal["text", "bytes"], offset: int = 0, length: int | None = None) -> str | bytes: ...

    async def read(self, path: str, *, format: Literal["text", "bytes"] = "text", offset: int = 0, length: int | None = None) -> str | bytes:
        """The file (or ``length`` bytes from ``offset``), read in chunks under the payload limit."""
        path = self._path(path)
        if format not in ("text", "bytes"):
            raise InvalidArgument(f"format must be 'text' or 'bytes', got {format!r}")
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
            raise InvalidArgument(f"offset must be an integer >= 0, got {offset!r}")
        if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
            raise InvalidArgument(f"length must be an integer >= 0, got {length!r}")
        chunk = self._chunk()
        parts: list[bytes] = []
        off = offset
        left = length
        while left is None or left > 0:
            want = chunk if left is None else min(chunk, left)
            d = await self._sb._request("files", FileRead(path=path, offset=off, length=want), FileData)
            parts.append(d.data)
            off += len(d.data)
            if left is not None:
                left -= len(d.data)
            if off >= d.size or not d.data:
                break
        raw = b"".join(parts)
        return raw.decode("utf-8", "replace") if format == "text" else raw

    async def list(self, path: str) -> list[EntryInfo]:
        res = await self._sb._request("files", FileList(path=self._path(path)), FileListing)
        return [_entry(e) for e in res.entries]

    async def remove(self, path: str) -> None:
        await self._sb._request("files", FileRemove(path=self._path(path)), Done)

    async def exists(self, path: str) -> bool:
        res: Exists = await self._sb._request("files", FileExists(path=self._path(path)), Exists)
        return res.exists

    async def get_info(self, path: str) -> EntryInfo:
        return _entry((await self._sb._request("files", FileStat(path=self._path(path)), FileInfo)).entry)

    async def make_dir(self, path: str, *, mode: int = 0o755) -> bool:
        """Create the directory and its parents; False when it already existed."""
        res: DirMade = await self._sb._request("files", FileMakeDir(path=self._path(path), mode=mode), DirMade)
        return res.created

    async def rename(self, old_path: str, new_path: str) -> EntryInfo:
        """Move a file or directory; returns what is now at ``new_path``."""
        req = FileRename(path=self._path(old_path, "old_path"), new_path=self._path(new_path, "new_path"))
        return _entry((await self._sb._request("files", req, FileInfo)).entry)

    async def watch_dir(
        self, path: str, on_event: Callable[[FilesystemEvent], Any] | None = None, *, recursive: bool = False,
    ) -> AsyncWatchHandle:
        """Watch a directory (inotify in the sandbox): create, write, remove, rename, chmod events."""
        return await AsyncWatchHandle(self._sb, self._path(path), on_event)._start(bool(recursive))


__all__ = ["AsyncFilesystem", "AsyncWatchHandle"]
