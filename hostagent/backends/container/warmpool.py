"""The warm pool: started containers waiting per image, disk size and compiled profile, handed out on
create with the requested limits applied, so a create skips runc's cold start. A pooled container's
id differs from the sandbox id it comes to serve."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from bus.messages import WARM_CONTAINER_PREFIX, LayerRef

from ..._agent import AgentInfo
from ..._profiles import Enforcement

log = structlog.get_logger("dsec.hostagent.container")


@dataclass(frozen=True)
class WarmKey:
    """Keyed by what the profile compiles to, not its name and version: a pooled container's seccomp
    filter, capabilities, read-only mounts and Landlock rules (its agent's arguments, applied when it is
    claimed) were fixed when it started, so it may only serve a sandbox whose profile compiles to the
    very same."""

    layers: tuple[str, ...]
    disk_mb: int
    profile: str
    fingerprint: str

    @classmethod
    def of(cls, layers: list[LayerRef], disk_mb: int, security: Enforcement) -> WarmKey:
        return cls(tuple(layer.digest for layer in layers), disk_mb, security.profile, security.fingerprint)

    def same_image(self, other: WarmKey) -> bool:
        """Same image, disk and profile name (its compiled content may differ)."""
        return (self.layers, self.disk_mb, self.profile) == (other.layers, other.disk_mb, other.profile)


@dataclass(frozen=True)
class Recipe:
    """How a pool's containers are started."""

    lowers: tuple[str, ...]
    disk_mb: int
    security: Enforcement


@dataclass
class Warm:
    """A started container waiting in the pool (``info``: what its agent applied; a claim's confine
    replaces it)."""

    cid: str
    pid: int
    sdir: str
    info: AgentInfo


KERNEL_FS = ("/proc", "/sys", "/dev")  # moved whole into a restore's root, with the masks and read-only binds under them


def _in_kernel_fs(path: str) -> bool:
    return any(path == k or path.startswith(k + "/") for k in KERNEL_FS)


def rebinds(security: Enforcement) -> list[str]:
    """The profile's read-only binds of the image's own directories (/usr, /etc, ...), in the order
    runc made them: a restore's root gets them made again over its own directories (``warmroot``)."""
    return [p for p in security.readonly_paths if not _in_kernel_fs(p)]


def takes_restore(security: Enforcement) -> bool:
    """Whether a warm container of this profile may be given a restore's root (``warmroot``). Its
    agent confines itself (Landlock too) only when claimed, in the new root, and read-only binds of
    the image's directories are made again there. Not: a read-only ``/`` or bind under ``/.dsec``
    (the helper refuses them), nor a masked path outside /proc, /sys and /dev (runc's /dev/null or tmpfs
    over a path of the old root: not made again). Those start their restores cold. (A profile guard
    acts on is fine: the sandbox's record names its container, so guard finds the sandbox by it.)"""
    return all(_in_kernel_fs(p) for p in security.masked_paths) and \
        all(p != "/" and p.split("/")[1] != ".dsec" for p in rebinds(security))


StartFn = Callable[[str, Recipe], Awaitable[Warm]]
RemoveFn = Callable[[str], Awaitable[None]]
ClaimFn = Callable[[Warm], Awaitable[None]]


class WarmPool:
    def __init__(self, size: int, start: StartFn, remove: RemoveFn) -> None:
        self.size = size  # containers kept ready per key (0: off)
        self._start = start
        self._remove = remove
        self._entries: dict[WarmKey, list[Warm]] = {}
        self._recipes: dict[WarmKey, Recipe] = {}
        self._waiting: set[str] = set()  # container ids in some pool now
        self._refilling: dict[WarmKey, asyncio.Task[None]] = {}
        self._retiring: set[asyncio.Task[None]] = set()  # removals of warm containers of a changed profile
        self._stopping = False

    def ready(self) -> int:
        return len(self._waiting)

    def entries(self) -> dict[WarmKey, list[Warm]]:
        """The containers waiting, per key (to read, not to change)."""
        return self._entries

    def holds(self, cid: str) -> bool:
        return cid in self._waiting

    def discard(self, cid: str) -> None:
        """The container is being removed."""
        self._waiting.discard(cid)

    async def claim(self, key: WarmKey, recipe: Recipe, configure: ClaimFn) -> Warm | None:
        """A waiting container of ``key`` made the sandbox's by ``configure`` (limits, labels); None when
        none waits. Starts refilling the pool either way."""
        self._recipes[key] = recipe
        self._retire_stale(key)
        try:
            return await self._claim(key, configure)
        finally:
            self._refill(key)

    async def _claim(self, key: WarmKey, configure: ClaimFn) -> Warm | None:
        entries = self._entries.get(key)
        while entries:
            w = entries.pop()  # still ``waiting`` until it serves the sandbox: reconcile leaves it alone
            try:
                await configure(w)
            except Exception as exc:  # noqa: BLE001 - OSError, ContainerdError: a cold start instead
                log.warning("warm_claim_failed", container=w.cid, error=str(exc))
                await self._remove(w.cid)
                continue
            finally:
                self._waiting.discard(w.cid)
            return w
        return None

    def base_of(self, key: WarmKey) -> WarmKey | None:
        """The pool with a container waiting whose layers ``key``'s start with (its template's: a
        restore stacks its snapshot's layers over them), of the same disk size and compiled profile."""
        for k, entries in self._entries.items():
            if entries and len(k.layers) < len(key.layers) and key.layers[: len(k.layers)] == k.layers \
                    and (k.disk_mb, k.profile, k.fingerprint) == (key.disk_mb, key.profile, key.fingerprint):
                return k
        return None

    async def claim_under(self, key: WarmKey, configure: ClaimFn) -> Warm | None:
        """A waiting container of the template ``key`` is a restore over, given the restore's root by
        ``configure``; None when none waits (the restore starts cold). Its pool refills."""
        base = self.base_of(key)
        if base is None:
            return None
        try:
            return await self._claim(base, configure)
        finally:
            self._refill(base)

    def _retire_stale(self, key: WarmKey) -> None:
        """Drop the pools started for an earlier content of the same profile (same image and disk):
        they can never be claimed again, and would hold their containers until the agent stops."""
        for old in [k for k in self._recipes if k != key and k.same_image(key)]:
            tasks = []
            t = self._refilling.pop(old, None)
            if t is not None and not t.done():
                t.cancel()  # a container it was starting is removed by the loop itself
                tasks.append(t)
            entries = self._entries.pop(old, [])
            stale = list(entries)
            entries.clear()  # a claim looping over this very list must find it empty now
            del self._recipes[old]
            for w in stale:
                self._waiting.discard(w.cid)
            if stale:
                log.info("warm_pool_retired", profile=key.profile, containers=len(stale))
                tasks.append(asyncio.ensure_future(self._remove_all([w.cid for w in stale])))
            for t in tasks:  # stop() waits for them
                self._retiring.add(t)
                t.add_done_callback(self._retiring.discard)

    async def _remove_all(self, cids: list[str]) -> None:
        for cid in cids:
            try:
                await self._remove(cid)
            except Exception as exc:  # noqa: BLE001 - stop() and recover() remove unclaimed ones too
                log.warning("warm_pool_remove_failed", container=cid, error=str(exc))

    def _refill(self, key: WarmKey) -> None:
        if key not in self._recipes:
            return  # retired while this create claimed from it
        t = self._refilling.get(key)
        if t is None or t.done():
            self._refilling[key] = asyncio.ensure_future(self._refill_loop(key))

    async def _refill_loop(self, key: WarmKey) -> None:
        # One at a time: refilling competes with cold creates for the same CPU.
        recipe = self._recipes[key]
        entries = self._entries.setdefault(key, [])
        while not self._stopping and len(entries) < self.size:
            cid = f"{WARM_CONTAINER_PREFIX}{os.urandom(8).hex()}"
            try:
                w = await self._start(cid, recipe)
            except asyncio.CancelledError:
                await asyncio.shield(self._remove(cid))  # stopped half-way: leave no scratch or task
                raise
            except Exception as exc:  # noqa: BLE001 - the pool is an optimisation: cold creates still work
                log.warning("warm_pool_start_failed", error=str(exc))
                await self._remove(cid)
                return
            self._waiting.add(w.cid)
            entries.append(w)

    async def stop(self) -> None:
        """Refills stop; the waiting containers are left to the caller (which removes every unclaimed one)."""
        self._stopping = True
        for t in list(self._refilling.values()):
            t.cancel()
        for t in list(self._refilling.values()):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        self._entries.clear()
        self._waiting.clear()
        for t in list(self._retiring):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the listing below removes what is left
                pass


__all__ = ["KERNEL_FS", "Recipe", "Warm", "WarmKey", "WarmPool", "rebinds", "takes_restore"]
