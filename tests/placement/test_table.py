"""Unit tests of the host table: fit with overcommit, memory admission, priority, locality, O(k) decisions."""

from __future__ import annotations

import time

from bus.messages import HostBackend, HostStatus, SandboxSpec
from placement import HostTable, Policy
from placement import _table


def host(hid: str, **kw) -> HostStatus:
    base = dict(host_id=hid, backend="sim", at=time.time(), cpu_total=4.0, mem_total_mb=16384, disk_total_mb=100_000, cpu_overcommit=50.0)
    base.update(kw)
    return HostStatus(**base)


def spec(sid: str = "s1", **kw) -> SandboxSpec:
    base = dict(sandbox_id=sid, backend="sim", cpu=1.0, memory_mb=128, disk_mb=100)
    base.update(kw)
    return SandboxSpec(**base)


def test_cpu_overcommit_50x_then_full() -> None:
    t = HostTable()
    t.update(host("h1", cpu_total=2.0, cpu_alloc=99.0, mem_total_mb=1_000_000))  # 2 cores x 50 = 100
    assert t.choose(spec("a")) == "h1"
    t.reserve("h1", spec("a"))
    assert t.choose(spec("b")) is None  # 99 + 1 reserved + 1 > 100
    assert t.why_not(t.hosts["h1"], spec("b")) == "cpu"


def test_pool_overcommit_override_is_stricter() -> None:
    t = HostTable(Policy(pool_cpu_overcommit={"default": 2.0}))
    t.update(host("h1", cpu_total=2.0, cpu_alloc=3.5))
    assert t.choose(spec(cpu=1.0)) is None  # 3.5 + 1 > 2 x 2
    assert t.choose(spec(cpu=0.5)) == "h1"


def test_memory_admitted_against_requested_and_resident() -> None:
    t = HostTable()
    # requested memory within the (1x) limit, but what sandboxes really hold is near the top
    t.update(host("h1", mem_total_mb=10_000, mem_alloc_mb=5_000, mem_resident_mb=9_400))
    assert t.why_not(t.hosts["h1"], spec(memory_mb=200)) == "memory-resident"
    # overcommitted memory (4x): requested may exceed RAM while resident stays low
    t.update(host("h2", mem_total_mb=10_000, mem_alloc_mb=30_000, mem_resident_mb=2_000, mem_overcommit=4.0))
    assert t.why_not(t.hosts["h2"], spec(memory_mb=2_000)) == ""
    assert t.why_not(t.hosts["h2"], spec(memory_mb=20_000)) == "memory"


def test_disk_and_max_sandboxes() -> None:
    t = HostTable()
    t.update(host("h1", disk_total_mb=1000, disk_alloc_mb=950))
    assert t.why_not(t.hosts["h1"], spec(disk_mb=100)) == "disk"
    t.update(host("h2", max_sandboxes=3, sandboxes=2))
    assert t.why_not(t.hosts["h2"], spec("x")) == ""
    t.reserve("h2", spec("x"))
    assert t.why_not(t.hosts["h2"], spec("y")) == "max_sandboxes"


def test_latency_sensitive_needs_real_cpu_headroom() -> None:
    t = HostTable()
    t.update(host("busy", cpu_total=4.0, cpu_busy=3.9))  # plenty of overcommitted room, no idle core
    t.update(host("idle", cpu_total=4.0, cpu_busy=0.5, cpu_alloc=150.0))
    ls = spec(priority="latency-sensitive", cpu=1.0)
    assert t.why_not(t.hosts["busy"], ls) == "cpu-busy"
    assert t.choose(ls) == "idle"
    be = spec("be", cpu=1.0)
    assert t.why_not(t.hosts["busy"], be) == ""  # best-effort still fits the busy host
    # latency-sensitive cpu is never overcommitted: 4 real cores hold 4 x 1 cpu
    t.update(host("ls-full", cpu_total=4.0, cpu_alloc_ls=4.0))
    assert t.why_not(t.hosts["ls-full"], ls) == "cpu-ls"


def test_image_locality_and_spread_vs_pack() -> None:
    t = HostTable()
    t.update(host("cold", cpu_alloc=0.0))
    t.update(host("warm", cpu_alloc=20.0, layers=["sha256:base"]))
    assert t.choose(spec(), layers=frozenset({"sha256:base"})) == "warm"  # locality beats a little load
    t2 = HostTable(Policy(strategy="pack"))
    t2.update(host("empty", cpu_alloc=0.0))
    t2.update(host("half", cpu_alloc=100.0))
    assert t2.choose(spec()) == "half"
    t3 = HostTable(Policy(strategy="spread"))
    t3.update(host("empty", cpu_alloc=0.0))
    t3.update(host("half", cpu_alloc=100.0))
    assert t3.choose(spec()) == "empty"


def test_backend_pool_state_and_staleness_filter() -> None:
    t = HostTable()
    t.update(host("other-pool", pool="gpu"))
    t.update(host("container", backend="container"))
    t.update(host("draining", state="draining"))
    t.update(host("stale"))
    t.hosts["stale"].seen_at -= _table.STALE_AFTER_S + 1
    assert t.choose(spec()) is None
    t.update(host("ok"))
    assert t.choose(spec()) == "ok"
    assert t.choose(spec(), exclude={"ok"}) is None


def test_reservations_are_dropped_once_a_heartbeat_counts_them() -> None:
    t = HostTable()
    now = time.time()
    t.update(host("h1", at=now), now=now)
    t.reserve("h1", spec("a", cpu=2.0), now=now)
    t.reserve("h1", spec("b", cpu=3.0), now=now + 0.5)
    e = t.hosts["h1"]
    assert e.reserved() == (5.0, 256, 200, 2)
    t.update(host("h1", at=now + 1.2, cpu_alloc=2.0), now=now + 1.2)  # sent 1.2 s later: counts "a"
    assert e.reserved() == (3.0, 128, 100, 1)
    t.release("h1", "b")
    assert e.reserved() == (0.0, 0, 0, 0)


def test_decision_cost_does_not_grow_with_host_count(monkeypatch) -> None:
    calls = {"n": 0}
    orig = HostTable.why_not

    def counting(self, e, s):
        calls["n"] += 1
        return orig(self, e, s)

    monkeypatch.setattr(HostTable, "why_not", counting)
    per_size = {}
    for n in (100, 1_600, 10_000):
        t = HostTable(Policy(sample_k=8))
        for i in range(n):
            t.update(host(f"h{i}"))
        calls["n"] = 0
        for j in range(200):
            assert t.choose(spec(f"s{j}")) is not None
        per_size[n] = calls["n"] / 200
    assert max(per_size.values()) <= 4 * 8  # at most 4k probes however many hosts
    assert per_size[10_000] <= per_size[100] * 1.5


def test_full_scan_finds_the_last_host_with_room_and_remembers_a_full_cluster() -> None:
    t = HostTable(Policy(sample_k=2))
    for i in range(200):
        t.update(host(f"h{i}", max_sandboxes=1, sandboxes=1))
    assert t.choose(spec()) is None
    v = t._version
    assert t.choose(spec()) is None and t._version == v  # cached: no rescan until something changes
    t.update(host("h137", max_sandboxes=1, sandboxes=0))
    assert t.choose(spec()) == "h137"


def test_remove_keeps_sampling_consistent() -> None:
    t = HostTable()
    for i in range(50):
        t.update(host(f"h{i}"))
    for i in range(0, 50, 2):
        t.remove(f"h{i}")
    assert sorted(t._ids) == sorted(f"h{i}" for i in range(1, 50, 2))
    assert all(t._ids[t._pos[h]] == h for h in t._ids)
    for j in range(100):
        assert int(t.choose(spec(f"s{j}"))[1:]) % 2 == 1


def test_routes_on_the_backends_a_host_advertises_and_their_limits() -> None:
    t = HostTable()
    t.update(host("old"))  # an older host: no list, only its one backend
    t.update(host("vm", backend="container", backends=[
        HostBackend(name="container"), HostBackend(name="microvm", max_cpu=2, max_memory_mb=1024, max_disk_mb=2048),
    ]))
    assert t.choose(spec(backend="sim")) == "old"
    assert t.choose(spec(backend="microvm")) == "vm"
    assert t.choose(spec(backend="container")) == "vm"
    assert t.choose(spec(backend="vm")) is None
    assert t.why_not(t.hosts["old"], spec(backend="microvm")) == "backend"
    assert t.why_not(t.hosts["vm"], spec(backend="microvm", memory_mb=2048)) == "backend-memory"
    assert t.why_not(t.hosts["vm"], spec(backend="microvm", cpu=4.0)) == "backend-cpu"
    assert t.why_not(t.hosts["vm"], spec(backend="microvm", disk_mb=4096)) == "backend-disk"
    assert t.why_not(t.hosts["vm"], spec(backend="container", memory_mb=2048)) == ""  # the limits are microvm's own
    assert t.runs("microvm") and t.runs("sim") and not t.runs("vm")
    assert t.available_backends() == ["container", "microvm", "sim"]


def test_a_backend_counts_only_while_a_host_running_it_is_live() -> None:
    t = HostTable()
    now = time.time()
    t.update(host("vm", backends=[HostBackend(name="microvm")]), now=now - 2 * _table.STALE_AFTER_S)  # silent since
    t.update(host("s1"), now=now)
    assert not t.runs("microvm", now) and t.available_backends(now) == ["sim"]
    t.update(host("vm", backends=[HostBackend(name="microvm")]), now=now)
    assert t.runs("microvm", now)
    t.update(host("vm", backends=[HostBackend(name="microvm")], state="down"), now=now)
    assert not t.runs("microvm", now)
    t.update(host("vm", backends=[HostBackend(name="vm")]), now=now)  # it changed what it runs
    assert not t.runs("microvm", now) and t.runs("vm", now)
    t.remove("vm")
    assert t.available_backends(now) == ["sim"] and t.any_live(now)
    t.remove("s1")
    assert not t.any_live(now) and t.available_backends(now) == []
