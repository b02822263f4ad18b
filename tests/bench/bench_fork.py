"""Benchmark of fork on one host (a script, not a test).

    python tests/bench/bench_fork.py [--counts 8,64] [--rounds 2] [--mib 1] [--profile e2b|default] [--network]

A fresh stack in this process (``bench_sandboxes.Stack``: embedded NATS JetStream, a placement
replica, a host agent with the container backend, a warm pool as large as the largest count) plus
this host's real lazy loader. Through the real SDK, for each count it prints the time until every
child is ready, from a running source and from a (frozen) paused one, side by side:

* ``warm``: the children take warm containers of the template, each given the fork's root in its own
  mount namespace (``warmroot``); the pool is refilled before each fork (it is not timed);
* ``cold``: the same fork with warm restores off: a cold container start per child (the path fork
  took before).

Both stack a copy of the source's frozen upper; the pack to the chunk store runs after. One fork of
the first count is then taken apart: the snapshot call (freeze, diff, copy, record, event) and the
children's creates, and the warm helper's own work per child. The load average is printed with the
figures. The source holds ``--mib`` MiB of random data and a small state file; every child is
checked to see it. Everything it starts is stopped by pid and its data dir removed at the end.
Every built-in profile takes the warm path: with ``default`` (Landlock, read-only system dirs: the
gateway's E2B default) a warm child's agent confines itself when claimed, after the root swap, and
the read-only binds are made again over the new root. ``--network``: the children get an allowlist
(``192.0.2.1/32``, nothing is sent): a warm child's container's own netns gets its veth and rules.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sdk import AsyncSandbox  # noqa: E402
from sdk._snapshots import create_snapshot  # noqa: E402
from tests.bench._common import stop_lazy_stack  # noqa: E402
from tests.bench.bench_sandboxes import Stack  # noqa: E402
from tests.imaged.conftest import LazyDaemon  # noqa: E402


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


def load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def waiting(st: Stack, profile: str) -> int:
    assert st.backend is not None
    return sum(len(ws) for k, ws in st.backend.pool.entries().items() if k.profile == profile)


async def until_warm(st: Stack, profile: str, n: int, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while waiting(st, profile) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the warm pool did not reach {n} within {timeout:g}s")
        await asyncio.sleep(0.1)  # poll: the pool refills one container at a time


def served_warm(st: Stack, sbs: list[AsyncSandbox]) -> int:
    assert st.host is not None
    return sum(str(st.host.handles[f.sandbox_id].extra.get("cid", "")).startswith("wp-") for f in sbs)


async def check_and_kill(sbs: list[AsyncSandbox], want: str) -> int:
    ok = sum([(await f.files.read("/root/d/state")) == want for f in sbs])
    await asyncio.gather(*(f.kill() for f in sbs))
    return ok


NETWORK = {"allow_out": ["192.0.2.1/32"]}  # TEST-NET-1: a network of their own, nothing sent


async def one_count(st: Stack, src: AsyncSandbox, n: int, rounds: int, profile: str, network: bool) -> None:
    assert st.backend is not None
    kw: dict[str, Any] = {"nats_url": st.url, "timeout": 3600, "create_timeout": 600, **({"network": NETWORK} if network else {})}
    rows: dict[str, list[float]] = {}
    seen: dict[str, list[str]] = {}
    for mode in ("warm", "cold"):
        st.backend.warm_restores = mode == "warm"
        for r in range(rounds):
            for paused in (False, True):
                name = f"fork {mode} ({'paused' if paused else 'running'} source)"
                state = f"{mode}-{r}-{paused}"
                await src.commands.run(f"echo {state} > /root/d/state && printf x >> /root/d/f")  # the big file changed: copied again
                if paused:
                    await src.pause()
                if mode == "warm":
                    await until_warm(st, profile, n)
                t0 = time.perf_counter()
                out = await src.fork(n, **kw)
                rows.setdefault(name, []).append(ms(t0))
                if paused:
                    await src.resume()
                warm = served_warm(st, out)
                seen.setdefault(name, []).append(f"{await check_and_kill(out, state + chr(10))}/{n} ok, {warm} warm")
    for name, xs in rows.items():
        print(f"  {n:3d} {name:30s} all ready: " + "  ".join(f"{x:8.1f}" for x in xs) + f"  ms (median {statistics.median(xs):8.1f})"
              f"   [{'; '.join(seen[name])}]")
    print(f"      load average now: {load()}")


async def taken_apart(st: Stack, src: AsyncSandbox, n: int, profile: str, network: bool) -> None:
    """One fork of ``n``, in its two halves as ``AsyncSandbox.fork`` makes them."""
    assert st.backend is not None
    kw: dict[str, Any] = {"nats_url": st.url, "timeout": 3600, "profile": src.spec.profile if src.spec else profile,
                          **({"network": NETWORK} if network else {})}
    for mode in ("warm", "cold"):
        st.backend.warm_restores = mode == "warm"
        if mode == "warm":
            await until_warm(st, profile, n)
        st.backend.warmroot.work_ms.clear()
        ids = [f"sb-{uuid.uuid4().hex[:20]}" for _ in range(n)]
        t0 = time.perf_counter()
        info = await create_snapshot(src, None, False, {}, fork_ids=ids)
        t_snap = ms(t0)
        t1 = time.perf_counter()
        out = await AsyncSandbox.create_batch(n, info.template, create_timeout=600, snapshot=info.snapshot_id, sandbox_ids=ids, **kw)
        t_create = ms(t1)
        work = sorted(st.backend.warmroot.work_ms)
        helper = f", warmroot helper work per child median {statistics.median(work):.1f} ms (max {work[-1]:.1f})" if work else ""
        wait = sorted(st.backend.warmroot.wait_ms)[-n:] if work else []
        helper += f", waiting for a helper median {statistics.median(wait):.1f} ms" if wait else ""
        print(f"  {n:3d} fork {mode}: snapshot call (freeze, diff, copy, record, event) {t_snap:7.1f} ms; "
              f"children created and ready {t_create:7.1f} ms ({served_warm(st, out)} warm){helper}")
        await check_and_kill(out, (await src.files.read("/root/d/state")))


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="8,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1, help="random data in the source (what the fork copies and packs)")
    ap.add_argument("--profile", default="e2b", help="the source's profile (its children's too)")
    ap.add_argument("--network", action="store_true", help="the children get an allowlist (a network of their own)")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",") if c]
    st = Stack(argparse.Namespace(shim_group=16, warm_pool=max(counts), concurrency=64, memory_mb=32, disk_mb=1024, cpu=1.0,
                                  cpu_overcommit=100.0, reconcile_s=10.0))
    await st.start()
    lazy = LazyDaemon(data_dir=st.dir, mount=st.dir / "lazy", nats_url=st.url, host_id="bench")
    lazy.start()
    try:
        src = await AsyncSandbox.create(nats_url=st.url, memory_mb=32, disk_mb=max(1024, 4 * args.mib + 256), timeout=3600, profile=args.profile)
        try:
            await src.commands.run(f"mkdir -p /root/d && head -c {args.mib << 20} /dev/urandom > /root/d/f && echo step-k > /root/d/state", timeout=600)
            net = ", children with a network" if args.network else ""
            print(f"fork N from one sandbox (profile {args.profile}{net}), time until every child is ready; load average at start: {load()}")
            await taken_apart(st, src, counts[0], args.profile, args.network)
            for n in counts:
                await one_count(st, src, n, args.rounds, args.profile, args.network)
        finally:
            await src.kill()
    finally:
        await stop_lazy_stack(st, lazy)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
