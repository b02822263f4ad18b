"""The warm pool: networks made ahead of time (netns + veth + addresses + routes), so a create only
adopts one (a bind mount, an alias, the set elements). It refills in the background, one network
per worker job, so a create waits behind at most one of them."""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import structlog

from .._tasks import cancel_and_wait
from . import netns
from .attachment import Attachment, netns_path, random_ifname
from .config import WARM_TAG, NetworkConfig
from .nftables import ALLOW_SETS
from .plumbing import Plumbing
from .slots import SlotPool
from .worker import Worker

log = structlog.get_logger("dsec.hostagent.network")

__all__ = ["WarmPool"]


class WarmPool:
    """``ready()``: whether networks may be made now (the manager has started, the host can)."""

    def __init__(
        self, cfg: NetworkConfig, kernel: Plumbing, slots: SlotPool, worker: Worker, make_ms: list[float], ready: Callable[[], bool]
    ) -> None:
        self.cfg = cfg
        self._kernel = kernel
        self._slots = slots
        self._worker = worker
        self._make_ms = make_ms
        self._ready = ready
        self.nets: list[Attachment] = []  # oldest first
        self._seq = 0
        self._task: asyncio.Task[None] | None = None

    def take(self) -> Attachment | None:
        return self.nets.pop(0) if self.nets else None

    def kick(self) -> None:
        """Top the pool up in the background (if it is not being topped up already)."""
        if self.cfg.warm_pool <= 0 or (self._task is not None and not self._task.done()):
            return
        self._task = asyncio.get_running_loop().create_task(self._refill())

    async def _refill(self) -> None:
        try:
            while await self._worker.run(self.refill_one):
                pass
        except Exception:  # noqa: BLE001 - creates still work (inline); try again next time
            log.exception("warm_pool_refill_failed")

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    def refill_one(self) -> bool:
        """(worker) Make one network; whether the pool wants more."""
        if not self._ready() or len(self.nets) >= self.cfg.warm_pool:
            return False
        self._kernel.check_root_ns()
        self._seq += 1
        key = f"{WARM_TAG}{self._seq}"
        slot = self._slots.alloc(key, self._kernel)
        gw, ip, _ = self._slots.addrs(slot)
        att = Attachment("", slot, random_ifname(self.cfg), ip, gw, netns_path(self.cfg, key), {s: [] for s in ALLOW_SETS})
        t0 = time.perf_counter()
        try:
            self._kernel.make_netns(att, alias=key)
        except BaseException:
            self.discard(att)
            raise
        self._make_ms.append((time.perf_counter() - t0) * 1000)
        self.nets.append(att)
        return len(self.nets) < self.cfg.warm_pool

    def discard(self, att: Attachment) -> None:
        """(worker) Let a pre-made network go that no sandbox owns: unmounted, the kernel destroys it."""
        netns.umount(att.netns)
        self._slots.release(att.slot, att.ifname)

    def drain(self) -> None:
        """(worker) Drop every pre-made network (stop, purge, recovery)."""
        while self.nets:
            self.discard(self.nets.pop())
