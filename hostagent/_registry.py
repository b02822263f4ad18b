"""The sandboxes this host holds: the live table, the running sums of what they requested, and the
local state file of each (what a restarted host agent recovers from, and where a kill intent is kept)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

from bus.messages import SandboxSpec
from bus.rules import Allocation

from ._backend import Handle

log = structlog.get_logger("dsec.hostagent")

LocalState = Literal["running", "paused", "stopping"]

_state_json = msgspec.json.Encoder()


class LocalSandbox(msgspec.Struct, kw_only=True):
    """What this host keeps on disk about one sandbox, to recover after a crash.

    ``state``: ``running``; ``paused`` (frozen in place, resumed by the ``resume`` op); or ``stopping``,
    a durable kill intent (its ``end_reason`` says why) that the reaper retries until every resource is gone.
    """

    spec: SandboxSpec
    pid: int = 0
    extra: dict[str, Any] = {}
    started_at: float = 0.0
    expires_at: float = 0.0
    state: LocalState = "running"
    end_reason: str = ""


_state_dec = msgspec.json.Decoder(LocalSandbox)

Observer = Callable[[LocalSandbox, int], None]


class Registry:
    """The live table. ``add``/``remove`` keep the allocation sums (admission and heartbeats are
    O(1), not O(live)) and tell the observers (deadlines, leases) in the same step."""

    def __init__(self, state_dir: Path, *, persist: bool = True) -> None:
        self.state_dir = state_dir
        self.persist = persist
        self.live: dict[str, LocalSandbox] = {}
        self.handles: dict[str, Handle] = {}
        self.alloc = Allocation()  # what the live sandboxes requested (cpu_ls: the latency-sensitive share)
        self.observers: list[Observer] = []

    def __contains__(self, sid: str) -> bool:
        return sid in self.live

    def __len__(self) -> int:
        return len(self.live)

    def get(self, sid: str) -> LocalSandbox | None:
        return self.live.get(sid)

    def add(self, ls: LocalSandbox, handle: Handle) -> None:
        sid = ls.spec.sandbox_id
        if sid in self.live:
            self.handles[sid] = handle
            return
        self.live[sid] = ls
        self.handles[sid] = handle
        self._count(ls, 1)

    def remove(self, sid: str) -> LocalSandbox | None:
        ls = self.live.pop(sid, None)
        self.handles.pop(sid, None)
        if ls is not None:
            self._count(ls, -1)
        return ls

    def _count(self, ls: LocalSandbox, sign: int) -> None:
        self.alloc.add(ls.spec, sign)
        if not self.live:  # no float drift left over once the host is empty
            self.alloc = Allocation()
        for fn in self.observers:
            fn(ls, sign)

    # --- local state files ---------------------------------------------------------------
    def path(self, sid: str) -> Path:
        return self.state_dir / f"{sid}.json"

    def ensure_dir(self) -> None:
        if self.persist:
            self.state_dir.mkdir(parents=True, exist_ok=True)

    def save(self, ls: LocalSandbox) -> None:
        if not self.persist:
            return
        p = self.path(ls.spec.sandbox_id)
        tmp = p.with_suffix(".tmp")
        tmp.write_bytes(_state_json.encode(ls))
        os.replace(tmp, p)

    def forget(self, sid: str) -> None:
        if self.persist:
            self.path(sid).unlink(missing_ok=True)

    def load(self) -> dict[str, LocalSandbox]:
        """Every state file; an unreadable one is dropped (logged)."""
        known: dict[str, LocalSandbox] = {}
        if not self.persist:
            return known
        for p in self.state_dir.glob("*.json"):
            try:
                ls = _state_dec.decode(p.read_bytes())
            except (msgspec.DecodeError, OSError):
                log.warning("bad_state_file", path=str(p))
                p.unlink(missing_ok=True)
                continue
            known[ls.spec.sandbox_id] = ls
        return known


__all__ = ["LocalSandbox", "LocalState", "Registry"]
