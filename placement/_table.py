"""The host table: heartbeats from KV plus this replica's own in-flight reservations.

Every decision costs O(k): ``choose`` probes a bounded random sample of hosts and every figure it
needs (reserved cpu, memory, disk, count) is kept as a running sum, never recomputed.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Literal

from bus.messages import HostBackend, HostStatus, SandboxSpec
from bus.rules import Allocation, Capacity, admits, capacity_of

STALE_AFTER_S = 10.0
RESERVATION_TTL_S = 10.0
HEARTBEAT_SLACK_S = 1.0  # a reservation older than (heartbeat.at - this) is counted by the heartbeat


@dataclass(slots=True)
class Reservation:
    sandbox_id: str
    cpu: float
    mem_mb: int
    disk_mb: int
    at: float
    ls: bool = False  # latency-sensitive


def backends_of(st: HostStatus) -> dict[str, HostBackend]:
    """The backends a heartbeat advertises, by name; an older host's empty list: its one ``backend``."""
    return {b.name: b for b in st.backends} if st.backends else {st.backend: HostBackend(name=st.backend)}


@dataclass(slots=True)
class HostEntry:
    status: HostStatus
    seen_at: float
    cap: Capacity
    backends: dict[str, HostBackend]
    reservations: dict[str, Reservation] = field(default_factory=dict)
    # running sums of ``reservations``
    r_cpu: float = 0.0
    r_mem: int = 0
    r_disk: int = 0
    r_ls_cpu: float = 0.0
    alloc: Allocation = field(default_factory=Allocation)  # the heartbeat's allocation plus the reservations

    def sync(self) -> None:
        st, a = self.status, self.alloc
        a.cpu = st.cpu_alloc + self.r_cpu
        a.cpu_ls = st.cpu_alloc_ls + self.r_ls_cpu
        a.mem_mb = st.mem_alloc_mb + self.r_mem
        a.disk_mb = st.disk_alloc_mb + self.r_disk
        a.sandboxes = st.sandboxes + len(self.reservations)

    def reserved(self) -> tuple[float, int, int, int]:
        return self.r_cpu, self.r_mem, self.r_disk, len(self.reservations)

    def add(self, r: Reservation) -> None:
        old = self.reservations.pop(r.sandbox_id, None)
        if old is not None:
            self._sub(old)
        self.reservations[r.sandbox_id] = r
        self.r_cpu += r.cpu
        self.r_mem += r.mem_mb
        self.r_disk += r.disk_mb
        if r.ls:
            self.r_ls_cpu += r.cpu
        self.sync()

    def drop(self, sandbox_id: str) -> None:
        r = self.reservations.pop(sandbox_id, None)
        if r is not None:
            self._sub(r)
            self.sync()

    def _sub(self, r: Reservation) -> None:
        self.r_cpu -= r.cpu
        self.r_mem -= r.mem_mb
        self.r_disk -= r.disk_mb
        if r.ls:
            self.r_ls_cpu -= r.cpu
        if not self.reservations:
            self.r_cpu = self.r_ls_cpu = 0.0
            self.r_mem = self.r_disk = 0

    def expire(self, older_than: float) -> None:
        """Drop reservations made before ``older_than`` (dict order is insertion order)."""
        res = self.reservations
        while res:
            sid = next(iter(res))
            if res[sid].at >= older_than:
                break
            self.drop(sid)


@dataclass(frozen=True)
class Policy:
    """Placement policy knobs.

    Overcommit: each host reports its pool's ratios in its heartbeat (hosts enforce them on admission);
    ``pool_cpu_overcommit`` lets placement be stricter for a pool without restarting hosts.
    """

    sample_k: int = 8  # candidates scored per decision: cost does not grow with host count
    strategy: Literal["spread", "pack"] = "spread"
    ls_cpu_headroom: float = 0.5  # latency-sensitive needs this many really idle cores left
    mem_resident_limit: float = 0.95  # resident memory + newcomers must stay under this share of RAM
    locality_weight: float = 0.5
    batch_hosts: int = 32  # a batch spreads over at most about this many hosts (fewer, bigger hand-offs)
    # First-time single creates that arrive together go to one host in runs of at least this many while
    # they fit: one hand-off, one atomic batch of records and one ready event for the run, not one each.
    coalesce: int = 8
    pool_cpu_overcommit: dict[str, float] = field(default_factory=dict)
    min_disk_free_mb: int = 1024  # a host whose data dir has less free gets no creates (snapshots, layers and scratch need room)


def capacity(st: HostStatus, policy: Policy) -> Capacity:
    """The host's capacity, with the pool's cpu overcommit when the policy is stricter than the host."""
    over = policy.pool_cpu_overcommit.get(st.pool, st.cpu_overcommit)
    return capacity_of(st, cpu_overcommit=min(over, st.cpu_overcommit) if st.cpu_overcommit else over)


class HostTable:
    def __init__(self, policy: Policy = Policy()) -> None:
        self.policy = policy
        self.hosts: dict[str, HostEntry] = {}
        self._ids: list[str] = []
        self._pos: dict[str, int] = {}
        self._rng = random.Random()
        self._version = 0  # bumped on every change that can free room
        self._full: dict[tuple[str, str, str, float, int, int], int] = {}  # request shape -> version at which a full scan found no host
        self._by_backend: dict[str, set[str]] = {}  # backend -> hosts advertising it (live or not)

    def __len__(self) -> int:
        return len(self.hosts)

    def update(self, st: HostStatus, now: float | None = None) -> None:
        now = time.time() if now is None else now
        self._version += 1
        e = self.hosts.get(st.host_id)
        backends = backends_of(st)
        if e is None:
            e = self.hosts[st.host_id] = HostEntry(st, now, capacity(st, self.policy), backends)
            e.sync()
            self._pos[st.host_id] = len(self._ids)
            self._ids.append(st.host_id)
            self._index(st.host_id, {}, backends)
            return
        if e.backends.keys() != backends.keys():
            self._index(st.host_id, e.backends, backends)
        e.status = st
        e.seen_at = now
        e.cap = capacity(st, self.policy)
        e.backends = backends
        # The heartbeat now counts what the host admitted before it was sent.
        e.expire(max(st.at - HEARTBEAT_SLACK_S, now - RESERVATION_TTL_S))
        e.sync()

    def _index(self, host_id: str, old: dict[str, HostBackend], new: dict[str, HostBackend]) -> None:
        for name in old.keys() - new.keys():
            hosts = self._by_backend.get(name)
            if hosts is not None:
                hosts.discard(host_id)
                if not hosts:
                    del self._by_backend[name]
        for name in new.keys() - old.keys():
            self._by_backend.setdefault(name, set()).add(host_id)

    def remove(self, host_id: str) -> None:
        e = self.hosts.pop(host_id, None)
        if e is None:
            return
        self._index(host_id, e.backends, {})
        self._version += 1
        i = self._pos.pop(host_id)
        last = self._ids.pop()
        if last != host_id:
            self._ids[i] = last
            self._pos[last] = i

    def ready_hosts(self) -> list[str]:
        now = time.time()
        return [h for h, e in self.hosts.items() if e.status.state == "ready" and now - e.seen_at < STALE_AFTER_S]

    @staticmethod
    def _live(e: HostEntry, now: float) -> bool:
        """Heartbeating and not shut down (a draining host still runs its backends: work for them waits)."""
        return e.status.state != "down" and now - e.seen_at <= STALE_AFTER_S

    def runs(self, backend: str, now: float | None = None) -> bool:
        """Some live host runs ``backend`` (typically O(1): the first host advertising it is live)."""
        ids = self._by_backend.get(backend)
        if not ids:
            return False
        now = time.time() if now is None else now
        hosts = self.hosts
        for h in ids:  # on every request: a plain loop, no generator
            e = hosts.get(h)
            if e is not None and self._live(e, now):
                return True
        return False

    def any_live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return any(self._live(e, now) for e in self.hosts.values())

    def available_backends(self, now: float | None = None) -> list[str]:
        """Every backend some live host runs, sorted."""
        now = time.time() if now is None else now
        return sorted(b for b in self._by_backend if self.runs(b, now))

    def why_not(self, e: HostEntry, spec: SandboxSpec) -> str:
        """Empty when ``spec`` fits on the host as this replica sees it, else the reason.

        Admission is the host's own rule (bus.rules.admits, on the heartbeat plus this replica's
        reservations); placement adds what only it weighs: real resident memory and idle cores."""
        why = admits(e.cap, e.alloc, spec)
        if why:
            return why
        b = e.backends.get(spec.backend)
        if b is None:
            return "backend"
        # The backend's own ceiling for one sandbox (a VM backend may take less than the whole host).
        if b.max_cpu and spec.cpu > b.max_cpu:
            return "backend-cpu"
        if b.max_memory_mb and spec.memory_mb > b.max_memory_mb:
            return "backend-memory"
        if b.max_disk_mb and spec.disk_mb > b.max_disk_mb:
            return "backend-disk"
        st = e.status
        if 0 < st.disk_free_mb < self.policy.min_disk_free_mb:
            return "disk-full"
        # The newcomers' expected resident share keeps the host's real memory under the physical limit.
        mem_over = max(st.mem_overcommit, 1.0)
        if st.mem_resident_mb + (e.r_mem + spec.memory_mb) / mem_over > st.mem_total_mb * self.policy.mem_resident_limit:
            return "memory-resident"
        # Latency-sensitive work needs cores really idle right now.
        if spec.priority == "latency-sensitive" and st.cpu_total - st.cpu_busy - e.r_ls_cpu < min(spec.cpu, self.policy.ls_cpu_headroom):
            return "cpu-busy"
        return ""

    def score(self, e: HostEntry, spec: SandboxSpec, layers: frozenset[str] | set[str]) -> float:
        st = e.status
        cpu_frac = e.alloc.cpu / max(e.cap.cpu, 1e-9)
        mem_frac = (max(st.mem_alloc_mb, st.mem_resident_mb) + e.r_mem) / max(st.mem_total_mb, 1)
        load = cpu_frac if cpu_frac > mem_frac else mem_frac
        s = -load if self.policy.strategy == "spread" else load
        if layers and st.layers:
            s += self.policy.locality_weight * len(layers.intersection(st.layers)) / len(layers)
        if spec.priority == "latency-sensitive":
            s += 0.5 * (st.cpu_total - st.cpu_busy - e.r_ls_cpu) / max(st.cpu_total, 1e-9)
        return s

    def _eligible(self, hid: str, e: HostEntry, spec: SandboxSpec, exclude: set[str] | frozenset[str], now: float) -> bool:
        if hid in exclude:
            return False
        st = e.status
        return st.state == "ready" and now - e.seen_at <= STALE_AFTER_S and spec.backend in e.backends and st.pool == spec.pool

    def choose(
        self, spec: SandboxSpec, exclude: set[str] | frozenset[str] = frozenset(), layers: frozenset[str] | set[str] = frozenset(), now: float | None = None
    ) -> str | None:
        """Probe a bounded random sample of live hosts of the right backend and pool; best of up to k that fit."""
        ids = self._ids
        n = len(ids)
        if not n:
            return None
        now = time.time() if now is None else now
        k = self.policy.sample_k
        hosts = self.hosts
        best_score = 0.0
        best: str | None = None
        tried = 0
        if n <= 4 * k:
            candidates = ids
        else:
            rnd = self._rng.random
            candidates = [ids[int(rnd() * n)] for _ in range(4 * k)]
        for hid in candidates:
            e = hosts.get(hid)
            if e is None or not self._eligible(hid, e, spec, exclude, now) or self.why_not(e, spec):
                continue
            sc = self.score(e, spec, layers)
            if best is None or sc > best_score:
                best_score, best = sc, hid
            tried += 1
            if tried >= k:
                break
        if best is None and n > 4 * k:
            # Sampling found nothing: one full scan (from a random start) before declaring the cluster full,
            # skipped while nothing changed since the last full scan for a request of this shape failed.
            shape = (spec.backend, spec.pool, spec.priority, spec.cpu, spec.memory_mb, spec.disk_mb)
            if not exclude and self._full.get(shape) == self._version:
                return None
            start = int(self._rng.random() * n)
            for i in range(n):
                hid = ids[(start + i) % n]
                e = hosts.get(hid)
                if e is not None and self._eligible(hid, e, spec, exclude, now) and not self.why_not(e, spec):
                    return hid
            if not exclude:
                if len(self._full) > 1024:
                    self._full.clear()
                self._full[shape] = self._version
        return best

    def reserve(self, host_id: str, spec: SandboxSpec, now: float | None = None) -> None:
        e = self.hosts.get(host_id)
        if e is not None:
            at = time.time() if now is None else now
            e.add(Reservation(spec.sandbox_id, spec.cpu, spec.memory_mb, spec.disk_mb, at, spec.priority == "latency-sensitive"))

    def release(self, host_id: str, sandbox_id: str) -> None:
        """Undo a reservation whose hand-off to the host failed."""
        e = self.hosts.get(host_id)
        if e is not None:
            e.drop(sandbox_id)
            self._version += 1
