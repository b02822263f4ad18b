"""Benchmark of snapshots, fork and pause/resume on one host (a script, not a test).

    python tests/bench/bench_snapshots.py [--big] [--python-root DIR]

A fresh stack in this process (the one ``bench_sandboxes.py`` starts: embedded NATS JetStream, a
placement replica, a host agent with the container backend) plus this host's real lazy loader (it
packs the snapshots' layers into the NATS object store). Through the real SDK it measures

* snapshot time and the bytes it stored, for 1 MiB and 100 MiB changed (``--big``: 1 GiB too);
* fork 8 and fork 64 from one sandbox: the time until every fork is ready;
* a memory snapshot (CRIU) of a Python process holding 200 MiB, and its restore (needs a Debian
  rootfs with python3: ``--python-root``, default the cache ``imaged._debootstrap.python_rootfs``
  builds under ``/var/tmp/dsec-snap-py``; skipped when it is not there);
* pause and resume latency (frozen, and persisted).

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

import msgspec  # noqa: E402

from bus import codec  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.messages import LayerRef, TemplateManifest  # noqa: E402
from bus.profiles import default_profile  # noqa: E402
from bus.runtime import connect  # noqa: E402
from bus.streams import ensure_kv  # noqa: E402
from sdk import AsyncSandbox  # noqa: E402
from tests.bench._common import stop_lazy_stack  # noqa: E402
from tests.bench.bench_sandboxes import Stack, pct  # noqa: E402
from tests.imaged.conftest import LazyDaemon  # noqa: E402

MiB = 1 << 20
NOLANDLOCK = "bench-nolandlock"


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def snapshot_sizes(st: Stack, sizes: list[int]) -> None:
    print("snapshot of N MiB changed (urandom, so nothing dedups):")
    for n in sizes:
        sb = await AsyncSandbox.create(nats_url=st.url, disk_mb=max(1024, 2 * n + 256), memory_mb=256, timeout=3600)
        try:
            await sb.commands.run(f"mkdir -p /root/d && head -c {n * MiB} /dev/urandom > /root/d/f", timeout=600)
            t0 = time.perf_counter()
            s = await sb.create_snapshot()
            took = ms(t0)
            await sb.commands.run("echo x > /root/d/small")
            t1 = time.perf_counter()
            s2 = await sb.create_snapshot()
            print(f"  {n:5d} MiB: {took:8.1f} ms, stored {s.bytes_added / MiB:8.2f} MiB;"
                  f" next snapshot with one small file changed: {ms(t1):6.1f} ms, stored {s2.bytes_added} B")
        finally:
            await sb.kill()


async def forks(st: Stack, counts: list[int]) -> None:
    src = await AsyncSandbox.create(nats_url=st.url, memory_mb=32, timeout=3600)
    try:
        await src.commands.run("mkdir -p /root/d && head -c 1048576 /dev/urandom > /root/d/f && echo step-k > /root/d/state")
        for n in counts:
            t0 = time.perf_counter()
            out = await src.fork(n, nats_url=st.url, memory_mb=32, timeout=3600, create_timeout=600)
            took = ms(t0)
            ok = sum([(await f.files.read("/root/d/state")) == "step-k\n" for f in out])
            await asyncio.gather(*(f.kill() for f in out))
            # The same again in its two parts: the snapshot, then the batched create from it.
            t0 = time.perf_counter()
            s = await src.create_snapshot()
            t_snap = ms(t0)
            t0 = time.perf_counter()
            again = await AsyncSandbox.create_batch(n, snapshot=s.snapshot_id, nats_url=st.url, memory_mb=32, timeout=3600, create_timeout=600)
            t_create = ms(t0)
            await asyncio.gather(*(f.kill() for f in again))
            print(f"fork {n:3d}: all ready in {took:8.1f} ms ({took / n:6.1f} ms per fork), {ok}/{n} see the state;"
                  f" split: snapshot {t_snap:6.1f} ms + {n} creates from it {t_create:8.1f} ms")
    finally:
        await src.kill()


async def pause_resume(st: Stack, rounds: int = 10) -> None:
    sb = await AsyncSandbox.create(nats_url=st.url, memory_mb=64, timeout=3600)
    try:
        await sb.commands.run("mkdir -p /root/d && echo 1 > /root/d/f")
        p, r = [], []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await sb.pause()
            p.append(ms(t0))
            t0 = time.perf_counter()
            await sb.resume()
            r.append(ms(t0))
        print(f"pause (frozen): p50 {pct(p, 50):6.1f} ms  p99 {pct(p, 99):6.1f} ms;  resume: p50 {pct(r, 50):6.1f} ms  p99 {pct(r, 99):6.1f} ms  (x{rounds})")
        p, r = [], []
        for i in range(3):
            await sb.commands.run(f"echo {i} >> /root/d/f")
            t0 = time.perf_counter()
            await sb.pause(persist=True)
            p.append(ms(t0))
            t0 = time.perf_counter()
            await sb.resume()
            r.append(ms(t0))
        print(f"pause (persist, files): mean {statistics.mean(p):6.1f} ms;  resume on any host: mean {statistics.mean(r):6.1f} ms  (x3)")
    finally:
        await sb.kill()


async def memory(st: Stack, python_root: Path) -> None:
    if not (python_root / "usr" / "bin" / "python3").exists():
        print(f"memory snapshot: skipped (no python rootfs at {python_root})")
        return
    nc = await connect(st.url)
    js = nc.jetstream()
    kv = await ensure_kv(js, S.KV_IMAGES)
    await kv.put("bench-python", codec.encode(TemplateManifest(name="bench-python", layers=[
        LayerRef(role="base", digest="sha256:" + "2" * 64, kind="dir", path=str(python_root))])))
    p = default_profile()
    prof = msgspec.structs.replace(p, name=NOLANDLOCK, fs=msgspec.structs.replace(p.fs, landlock=False, required=False))
    await (await ensure_kv(js, S.KV_PROFILES)).put(NOLANDLOCK, codec.encode(prof))
    assert st.host is not None and st.host.profiles is not None
    while NOLANDLOCK not in st.host.profiles.profiles:
        await asyncio.sleep(0.05)  # the host agent's profile watch
    await nc.close()
    sb = await AsyncSandbox.create("bench-python", nats_url=st.url, memory_mb=1024, profile=NOLANDLOCK, timeout=3600)
    try:
        prog = ("import time, os\nblob = os.urandom(200 << 20)\nn = 0\nopen('/tmp/ready', 'w').write('1')\n"
                "while True:\n    n += 1\n    open('/tmp/n', 'w').write(str(n))\n    time.sleep(0.05)\n")
        await sb.files.write("/tmp/hold.py", prog)
        await sb.commands.run("setsid python3 /tmp/hold.py >/dev/null 2>&1 &")
        while not await sb.files.exists("/tmp/ready"):
            await asyncio.sleep(0.1)  # the 200 MiB are in place once the file exists
        t0 = time.perf_counter()
        s = await sb.create_snapshot(memory=True)
        snap_ms = ms(t0)
        t0 = time.perf_counter()
        r = await AsyncSandbox.create(snapshot=s.snapshot_id, nats_url=st.url, memory_mb=1024, profile=NOLANDLOCK, timeout=3600)
        rest_ms = ms(t0)
        n0 = int(await r.files.read("/tmp/n"))
        await asyncio.sleep(0.5)
        n1 = int(await r.files.read("/tmp/n"))
        print(f"memory snapshot of a Python process holding 200 MiB: {snap_ms:8.1f} ms, stored {s.bytes_added / MiB:7.1f} MiB;"
              f" restore (create from it until ready): {rest_ms:8.1f} ms; counter {n0} -> {n1} after 0.5 s in the restore")
        await r.kill()
    finally:
        await sb.kill()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--big", action="store_true", help="also 1 GiB changed")
    ap.add_argument("--python-root", default="/var/tmp/dsec-snap-py/images/rootfs")
    ap.add_argument("--skip", default="", help="comma list of: sizes, fork, memory, pause")
    args = ap.parse_args()
    skip = set(args.skip.split(",")) - {""}
    st = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=16, memory_mb=64, disk_mb=1024, cpu=1.0, cpu_overcommit=50.0, reconcile_s=10.0))
    await st.start()
    lazy = LazyDaemon(data_dir=st.dir, mount=st.dir / "lazy", nats_url=st.url, host_id="bench")
    lazy.start()
    try:
        roots = sorted(p for p in Path(args.python_root).glob("debian-*") if p.is_dir()) if Path(args.python_root).is_dir() else []
        if "sizes" not in skip:
            await snapshot_sizes(st, [1, 100, *([1024] if args.big else [])])
        if "fork" not in skip:
            await forks(st, [8, 64])
        if "pause" not in skip:
            await pause_resume(st)
        if "memory" not in skip:
            await memory(st, roots[-1] if roots else Path(args.python_root))
    finally:
        await stop_lazy_stack(st, lazy)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
