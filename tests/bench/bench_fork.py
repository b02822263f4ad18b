"""Benchmark of fork on one host (a script, not a test).

    python tests/bench/bench_fork.py [--counts 8,64] [--rounds 2] [--mib 1] [--warm-pool 0]

A fresh stack in this process (``bench_sandboxes.Stack``: embedded NATS JetStream, a placement
replica, a host agent with the container backend) plus this host's real lazy loader. Through the
real SDK, for each count it prints the time until every child is ready for

* ``fork`` from a running source and from a (frozen) paused one: the children stack a copy of the
  source's frozen upper; the pack to the chunk store runs after (its time is printed too);
* the path fork took before (a snapshot packed and uploaded first, then a batched create from it);
* a batched create of as many plain sandboxes from the template: the cold-start floor that fork's
  children start at.

The source holds ``--mib`` MiB of random data (1: the pack is quick anyway; 100: the pack is what the
fork used to wait for) and a small state file; every child is checked to see it.
Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bus import codec  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.runtime import connect  # noqa: E402
from bus.streams import ensure_kv  # noqa: E402
from sdk import AsyncSandbox  # noqa: E402
from tests.bench._common import stop_lazy_stack  # noqa: E402
from tests.bench.bench_sandboxes import Stack  # noqa: E402
from tests.imaged.conftest import LazyDaemon  # noqa: E402


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def until_packed(js: object, snapshot_id: str, t0: float, timeout: float = 600.0) -> float:
    """Milliseconds from ``t0`` until the snapshot's record names packed layers only."""
    kv = await ensure_kv(js, S.KV_SNAPSHOTS)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = codec.SNAPSHOT.decode((await kv.get(snapshot_id)).value)
        if all(lay.kind == "erofs" for lay in rec.layers):
            return ms(t0)
        await asyncio.sleep(0.01)  # poll the record: the host rewrites it once the pack is in
    return float("nan")


async def newest_snapshot(url: str, source: str) -> str:
    snaps = await AsyncSandbox.list_snapshots(nats_url=url, sandbox_id=source)
    return max(snaps, key=lambda s: s.created_at).snapshot_id


async def check_and_kill(sbs: list[AsyncSandbox]) -> int:
    ok = sum([(await f.files.read("/root/d/state")) == "step-k\n" for f in sbs])
    await asyncio.gather(*(f.kill() for f in sbs))
    return ok


async def one_count(st: Stack, js: object, src: AsyncSandbox, n: int, rounds: int) -> None:
    kw = {"nats_url": st.url, "memory_mb": 32, "timeout": 3600, "create_timeout": 600}
    rows: dict[str, list[float]] = {"fork (running source)": [], "fork (paused source)": [], "snapshot+create (fork before)": [],
                                    "plain create_batch (floor)": []}
    packs: list[float] = []
    seen: list[str] = []
    for r in range(rounds):
        await src.commands.run(f"echo {r} >> /root/d/log && printf x >> /root/d/f")  # the big file changed: copied (and packed) again
        t0 = time.perf_counter()
        out = await src.fork(n, **kw)
        rows["fork (running source)"].append(ms(t0))
        packs.append(await until_packed(js, await newest_snapshot(st.url, src.sandbox_id), t0))
        seen.append(f"{await check_and_kill(out)}/{n}")

        await src.commands.run(f"echo p{r} >> /root/d/log && printf x >> /root/d/f")
        await src.pause()
        t0 = time.perf_counter()
        out = await src.fork(n, **kw)
        rows["fork (paused source)"].append(ms(t0))
        await src.resume()
        seen.append(f"{await check_and_kill(out)}/{n}")

        await src.commands.run(f"echo s{r} >> /root/d/log && printf x >> /root/d/f")
        t0 = time.perf_counter()
        s = await src.create_snapshot()
        again = await AsyncSandbox.create_batch(n, snapshot=s.snapshot_id, **kw)
        rows["snapshot+create (fork before)"].append(ms(t0))
        seen.append(f"{await check_and_kill(again)}/{n}")

        t0 = time.perf_counter()
        plain = await AsyncSandbox.create_batch(n, **kw)
        rows["plain create_batch (floor)"].append(ms(t0))
        await asyncio.gather(*(p.kill() for p in plain))
    for name, xs in rows.items():
        print(f"  {n:3d} {name:32s} all ready: " + "  ".join(f"{x:8.1f}" for x in xs) + f"  ms (median {statistics.median(xs):8.1f})")
    print(f"  {n:3d} {'fork: its layer packed after':32s}            " + "  ".join(f"{x:8.1f}" for x in packs) + " ms from the fork call")
    print(f"      children that saw the source's state: {', '.join(seen)}")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="8,64")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mib", type=int, default=1, help="random data in the source (what the fork copies and packs)")
    ap.add_argument("--warm-pool", type=int, default=0, help="warm containers per template (fork children never take one)")
    args = ap.parse_args()
    st = Stack(argparse.Namespace(shim_group=16, warm_pool=args.warm_pool, concurrency=64, memory_mb=32, disk_mb=1024, cpu=1.0,
                                  cpu_overcommit=100.0, reconcile_s=10.0))
    await st.start()
    lazy = LazyDaemon(data_dir=st.dir, mount=st.dir / "lazy", nats_url=st.url, host_id="bench")
    lazy.start()
    nc = await connect(st.url)
    try:
        src = await AsyncSandbox.create(nats_url=st.url, memory_mb=32, disk_mb=max(1024, 4 * args.mib + 256), timeout=3600)
        try:
            await src.commands.run(f"mkdir -p /root/d && head -c {args.mib << 20} /dev/urandom > /root/d/f && echo step-k > /root/d/state", timeout=600)
            print("fork N from one sandbox, time until every child is ready (each round: running, paused, the path before, plain creates):")
            for n in [int(c) for c in args.counts.split(",") if c]:
                await one_count(st, nc.jetstream(), src, n, args.rounds)
        finally:
            await src.kill()
    finally:
        await nc.close()
        await stop_lazy_stack(st, lazy)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
