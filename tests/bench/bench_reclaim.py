"""Benchmark of memory reclaim, CPU classes and shared layer pages on one host (a script, not a test).

    python tests/bench/bench_reclaim.py [--count 20] [--hold-mb 32] [--readers 16] [--read-mb 64]
    python tests/bench/bench_reclaim.py --count 100          # the issue's figure (a)
    python tests/bench/bench_reclaim.py --only cpu           # one part: memory | cpu | cache

On a fresh stack in this process (bench_sandboxes.Stack: NATS, placement, a host agent with the
container backend, the busybox ``base`` template):

(a) ``--count`` sandboxes each hold the issue's Python process (stdlib modules imported, a list of
    300,000 strings; ``--template python``, the Debian rootfs the fncall tests cache, the default
    when it is there) or a busybox shell with ``--hold-mb`` of text in a variable (``--template base``),
    then idle. Host memory they take with reclaim off (their cgroups' charge) and on (``python -m
    hostagent.reclaim`` started, run until it finds nothing more: their charge plus the zram pool
    their swapped pages take, compressed), with their memory.stat each; the first exec of a typical
    command (``ls -l /bin``) in each, before and after reclaim (also against the warm exec right
    after it, which takes out the machine's drift), the holders alive and the OOM kills.
(b) A latency-sensitive shell loop alone, and with best-effort sandboxes spinning on 50% and 100%
    of the host's CPU, in interleaved rounds (each loaded figure against the alone one of its round),
    with the cores the spinners got (best-effort runs on what the rest leaves: on a shared, busy
    machine that is little); then the same without the classes (all at their plain weight).
(c) ``--readers`` sandboxes on one template whose ``--read-mb`` of files come through the lazy loader
    (EROFS over its FUSE files) read them all: page cache they are charged, plus what stays cached of
    the loader's FUSE files and chunk files, against the bytes read.

Everything it starts is stopped by pid, and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_sandboxes import Stack  # noqa: E402

from sdk import AsyncSandbox  # noqa: E402

MiB = 1 << 20
MEM = Path("/sys/fs/cgroup/memory/dsec")
# Like a Python process holding a list of number strings (the issue's): the numbers as text, in a shell variable.
# Each starts at its own number: no two hold the same pages (KSM would merge them, which says
# nothing of reclaim).
HOLD = 'x=$(seq {start} 1000000000 | head -c {n}); echo $$ >/tmp/held; sleep 100000; : "$x"'
LOOP = "i=0; while [ $i -lt 60000 ]; do i=$((i+1)); done"
TYPICAL = "ls -l /bin >/dev/null"


def cg(stack: Stack, sid: str) -> Path:
    assert stack.host is not None
    h = stack.host.handles[sid]
    return MEM / h.extra.get("cid", sid)


def charged(stack: Stack, sids: list[str]) -> int:
    return sum(int((cg(stack, s) / "memory.usage_in_bytes").read_text()) for s in sids)


def pct(a: float, b: float) -> str:
    return f"{(b - a) / a * 100:+.1f}%" if a else "n/a"


async def create(stack: Stack, n: int, wave: int = 0, **kw: Any) -> list[AsyncSandbox]:
    """``n`` sandboxes, ``wave`` at a time (0: all at once); a create containerd gives up on under
    the machine's load is tried again (twice), and a bench of many goes on with those that started."""
    kw.setdefault("memory_mb", 256)
    out: list[AsyncSandbox] = []
    for tries in range(3):
        while len(out) < n:
            k = min(n - len(out), wave or n)
            got = await asyncio.gather(*(AsyncSandbox.create(nats_url=stack.url, timeout=3600, create_timeout=1800, **kw) for _ in range(k)),
                                       return_exceptions=True)
            out += [g for g in got if isinstance(g, AsyncSandbox)]
            failed = [g for g in got if not isinstance(g, AsyncSandbox)]
            if failed:
                print(f"    {len(failed)} create(s) failed (try {tries + 1}): {failed[0]}")
                break
        if len(out) == n:
            break
    if len(out) < n and not wave:
        raise SystemExit(f"only {len(out)} of {n} sandboxes started")
    return out


async def timed(sb: AsyncSandbox, cmd: str) -> float:
    t0 = time.perf_counter()
    await sb.commands.run(cmd, timeout=300)
    return time.perf_counter() - t0


async def first_and_warm(sb: AsyncSandbox) -> tuple[float, float]:
    """The first exec, and the median of three warm ones right after it."""
    first = await timed(sb, TYPICAL)
    return first, statistics.median([await timed(sb, TYPICAL) for _ in range(3)])


def majfaults(stack: Stack, sids: list[str]) -> int:
    """Major faults of the sandboxes' processes (a page that comes back from the swap or the disk)."""
    return sum(int(ln.split()[1]) for s in sids for ln in (cg(stack, s) / "memory.stat").read_text().splitlines()
               if ln.startswith("total_pgmajfault "))


def reclaim_service(stack: Stack, idle_s: float) -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSEC_NATS_URL": stack.url, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    log = open(stack.dir / "reclaim.log", "wb")  # noqa: SIM115 - the child's, closed with it
    return subprocess.Popen(
        [sys.executable, "-m", "hostagent.reclaim", "--host-id", "bench", "--data-dir", str(stack.dir), "--idle", str(idle_s),
         "--interval", "1"], env=env, stdout=log, stderr=subprocess.STDOUT,
    )


def stop(p: subprocess.Popen[bytes]) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


# ------------------------------------------------------------------------------------------------- (a)
# The process: stdlib modules imported, a list of 300,000 strings built, then idle. Each
# sandbox's strings start at a number of their own, so KSM merges only what really is identical
# (the interpreter's and the modules' pages), not the data.
PYHOLD = ("import json, re, collections, decimal, email.message, http.client, sqlite3, asyncio, os, time, pathlib; "
          "x = [str(i) for i in range({start}, {start} + 300000)]; open('/tmp/held', 'w').write(str(os.getpid())); time.sleep(10 ** 6)")
HELD = "kill -0 $(cat /tmp/held 2>/dev/null) 2>/dev/null && echo y || true"  # the holder is there and alive
STAT_KEYS = ("total_rss", "total_cache", "total_swap", "total_mapped_file")


def cg_stat(stack: Stack, sids: list[str]) -> dict[str, int]:
    """memory.stat summed over the sandboxes (bytes), and their kernel memory (slab, page tables: never reclaimed here)."""
    out = dict.fromkeys((*STAT_KEYS, "kmem"), 0)
    for s in sids:
        for ln in (cg(stack, s) / "memory.stat").read_text().splitlines():
            k, _, v = ln.partition(" ")
            if k in out:
                out[k] += int(v)
        out["kmem"] += int((cg(stack, s) / "memory.kmem.usage_in_bytes").read_text())
    return out


def show_stat(label: str, st: dict[str, int], n: int) -> str:
    return f"{label}: " + ", ".join(f"{k.removeprefix('total_')} {v / MiB / n:.1f}" for k, v in st.items()) + " MiB each"


def zram_stat() -> tuple[int, int]:
    """(bytes stored, memory they take) over the host's zram devices."""
    stored = used = 0
    for d in Path("/sys/block").glob("zram*"):
        try:
            f = (d / "mm_stat").read_text().split()
            stored, used = stored + int(f[0]), used + int(f[2])
        except (OSError, ValueError, IndexError):
            pass
    return stored, used


async def hold(stack: Stack, sbs: list[AsyncSandbox], args: argparse.Namespace) -> str:
    """Start the holding process in each sandbox; what it holds, in words."""
    py = (await sbs[0].commands.run("command -v python3 || true", timeout=120)).stdout.strip()
    for i, sb in enumerate(sbs):
        start = 1 + i * 1_000_003
        cmd = f'python3 -c "{PYHOLD.format(start=start)}"' if py else HOLD.format(n=args.hold_mb * MiB, start=start)
        await sb.commands.run(cmd, background=True, timeout=0)
    deadline = time.monotonic() + 900
    waiting = list(sbs)
    while waiting:
        if time.monotonic() > deadline:
            raise SystemExit("the sandboxes did not take their memory in 15 minutes")
        await asyncio.sleep(1 + len(waiting) / 50)  # poll (each poll is an exec in every sandbox still starting)
        got = await asyncio.gather(*(sb.commands.run(HELD, timeout=300) for sb in waiting))
        waiting = [sb for sb, r in zip(waiting, got, strict=True) if r.stdout.strip() != "y"]
    return "a Python process (stdlib modules imported, a list of 300,000 strings)" if py else f"a shell holding {args.hold_mb} MiB of text"


async def bench_memory(stack: Stack, args: argparse.Namespace) -> None:
    t_start = time.monotonic()
    sbs = await create(stack, args.count, wave=20, template=args.template, memory_mb=128)  # 100 x 256 MiB would not be admitted here
    args.count = len(sbs)
    sids = [sb.sandbox_id for sb in sbs]
    what = await hold(stack, sbs, args)
    print(f"(a) {args.count} idle sandboxes on template {args.template!r}, each holding {what}")
    await asyncio.sleep(args.idle_s)  # idle, as after a turn of the model
    f0 = majfaults(stack, sids)
    before = [await first_and_warm(sb) for sb in sbs]  # first exec after idle, reclaim off
    faults_before = majfaults(stack, sids) - f0
    await asyncio.sleep(args.idle_s)
    st_off = cg_stat(stack, sids)
    off = charged(stack, sids)
    print(f"    reclaim off: {off / MiB:.0f} MiB charged ({off / MiB / args.count:.1f} MiB each)")
    print("      " + show_stat("memory.stat", st_off, args.count))
    z_stored0, z_used0 = zram_stat()
    ksm0 = ksm_sharing()
    svc = reclaim_service(stack, args.idle_s)
    try:
        await asyncio.sleep(args.idle_s)
        last, stable, t0 = -1, 0, time.monotonic()
        while stable < 3 and time.monotonic() - t0 < 600:
            await asyncio.sleep(2)  # poll: reclaim runs in passes
            now = charged(stack, sids)
            stable = stable + 1 if abs(now - last) < MiB * max(1, args.count // 10) else 0
            last = now
        took = time.monotonic() - t0
        st_on, kept = cg_stat(stack, sids), charged(stack, sids)
        z_stored, z_used = zram_stat()
        merged = max(0, ksm_sharing() - ksm0)
        # What the sandboxes' swapped pages take in memory: the pool's growth, or their share of the
        # pool at its compression ratio, whichever is more (another user of a shared swap device
        # moves the first; the second assumes their pages compress as well as the others').
        ratio = (z_used / z_stored) if z_stored else 0.0
        pool = max(z_used - z_used0, int(st_on["total_swap"] * ratio))
        on = kept + pool  # a page KSM merged is uncharged from all but one cgroup: in `kept` already
        print(f"    reclaim on:  {on / MiB:.0f} MiB ({on / MiB / args.count:.1f} MiB each) = {kept / MiB:.0f} MiB charged + "
              f"{pool / MiB:.0f} MiB of zram holding their {st_on['total_swap'] / MiB:.0f} MiB swapped (ratio {1 / ratio if ratio else 0:.1f}x) "
              f"(KSM merged {merged / MiB:.0f} MiB on the host); steady after {took:.0f} s: {pct(off, on)}")
        print("      " + show_stat("memory.stat", st_on, args.count))
        f0 = majfaults(stack, sids)
        after = [await first_and_warm(sb) for sb in sbs]  # the first exec of each after reclaim
        faults_after = majfaults(stack, sids) - f0
        b1, a1 = [f for f, _ in before], [f for f, _ in after]
        b50, a50 = statistics.median(b1), statistics.median(a1)
        print(f"    first exec of `{TYPICAL}` after idle: p50 {b50 * 1000:.1f} ms before reclaim, {a50 * 1000:.1f} ms after ({pct(b50, a50)}); "
              f"mean {statistics.mean(b1) * 1000:.1f} -> {statistics.mean(a1) * 1000:.1f} ms ({pct(statistics.mean(b1), statistics.mean(a1))})")
        # The machine's load drifts between the two rounds: each first exec against the exec that
        # follows it in the same sandbox at once (warm) takes the drift out.
        rb, ra = statistics.median([f / s for f, s in before]), statistics.median([f / s for f, s in after])
        print(f"    first exec / the warm execs right after it, p50 per sandbox: {rb:.3f} before reclaim, {ra:.3f} after ({pct(rb, ra)}); "
              f"warm exec p50 {statistics.median([s for _, s in before]) * 1000:.1f} -> {statistics.median([s for _, s in after]) * 1000:.1f} ms")
        # What the machine's load cannot blur: the pages those execs had to fault back in.
        print(f"    major faults in the sandboxes during those execs: {faults_before} before reclaim, {faults_after} after "
              f"({faults_after / args.count:.1f} per sandbox)")
        alive = await asyncio.gather(*(sb.commands.run(HELD, timeout=300) for sb in sbs))
        print(f"    holders alive {sum(r.stdout.strip() == 'y' for r in alive)}/{args.count}; "
              f"OOM kills {oom_kills(stack, sids)}")
    finally:
        stop(svc)
        # Which swap the service used (its own zram, or one another user of this machine set up and may take away).
        for ln in (stack.dir / "reclaim.log").read_text(errors="replace").splitlines():
            if "reclaim_started" in ln or "reclaim_pass_failed" in ln:
                print(f"    service: {ln[:300]}")
        await asyncio.gather(*(sb.kill() for sb in sbs))
    print(f"    (a) took {time.monotonic() - t_start:.0f} s")


def ksm_sharing() -> int:
    try:
        return int(Path("/sys/kernel/mm/ksm/pages_sharing").read_text()) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def oom_kills(stack: Stack, sids: list[str]) -> int:
    n = 0
    for s in sids:
        for ln in (cg(stack, s) / "memory.oom_control").read_text().splitlines():
            if ln.startswith("oom_kill "):
                n += int(ln.split()[1])
    return n


# ------------------------------------------------------------------------------------------------- (b)
async def bench_cpu(stack: Stack, args: argparse.Namespace) -> None:
    from hostagent.backends.container.cgroups import cgroup_path, set_class

    print(f"(b) a latency-sensitive shell loop, best-effort sandboxes spinning; {args.rounds} rounds, each alone / 50% / 100% "
          f"(median of {args.runs} loops each), interleaved; load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    # Created best-effort, then classed as a latency-sensitive create is: placement admits those only
    # on idle cores, and this machine may be shared.
    ls, be1, be2 = await create(stack, 3, cpu=1.0)
    assert stack.host is not None
    cid = {sb.sandbox_id: stack.host.handles[sb.sandbox_id].extra.get("cid", sb.sandbox_id) for sb in (ls, be1, be2)}
    set_class(cid[ls.sandbox_id], 1.0, "latency-sensitive")

    def used_s() -> float:
        return sum(int(Path("/sys/fs/cgroup/cpuacct", cgroup_path(cid[sb.sandbox_id]).lstrip("/"), "cpuacct.usage").read_text())
                   for sb in (be1, be2)) / 1e9

    async def figure(spinners: int) -> tuple[float, float]:
        """The loop's median time (ms) with ``spinners`` best-effort cores spinning, and the cores they used meanwhile."""
        hs = [await sb.commands.run("while :; do :; done", background=True, timeout=0) for sb in (be1, be2)[:spinners]]
        try:
            u0, t0 = used_s(), time.monotonic()
            ms = statistics.median([await timed(ls, LOOP) for _ in range(args.runs)]) * 1000
            return ms, (used_s() - u0) / (time.monotonic() - t0)
        finally:
            for h in hs:
                await h.kill()

    async def series(label: str) -> None:
        got: dict[int, list[tuple[float, float]]] = {0: [], 1: [], 2: []}
        for _ in range(args.rounds):
            for n in got:
                got[n].append(await figure(n))
        alone = [ms for ms, _ in got[0]]
        parts = [f"alone {statistics.median(alone):.0f} ms"]
        for n, name in ((1, "50%"), (2, "100%")):
            # Each loaded figure against the alone figure of its own round: the machine's drift between rounds cancels.
            ratio = statistics.median([ms / a for (ms, _), a in zip(got[n], alone, strict=True)])
            parts.append(f"{name} load {statistics.median(ms for ms, _ in got[n]):.0f} ms ({(ratio - 1) * 100:+.1f}%; "
                         f"the spinners used {statistics.median(c for _, c in got[n]):.2f} cores)")
        print(f"    {label}: " + "; ".join(parts) + f"; load average {os.getloadavg()[0]:.1f}")

    await series("with classes   ")
    for sb in (ls, be1, be2):  # the control: no classes, plain weights (what main did before the classes)
        set_class(cid[sb.sandbox_id], 1.0, "latency-sensitive")
        Path("/sys/fs/cgroup/cpu", cgroup_path(cid[sb.sandbox_id]).lstrip("/"), "cpu.shares").write_text("1024")
    await series("without classes")
    await asyncio.gather(*(sb.kill() for sb in (ls, be1, be2)))


# ------------------------------------------------------------------------------------------------- (c)
def cached(paths: list[Path]) -> int:
    if not paths:
        return 0
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *map(str, paths)], capture_output=True, text=True, check=True).stdout
    return sum(int(x) for x in out.split())


async def bench_cache(stack: Stack, args: argparse.Namespace) -> None:
    from bus import connect
    from imaged import ImageBuilder
    from tests.imaged.conftest import LazyDaemon

    print(f"(c) {args.readers} sandboxes reading the same {args.read_mb} MiB of template files (lazy EROFS layers)")
    files = max(1, args.read_mb // 4)
    src = stack.dir / "bench-ws" / "data"
    src.mkdir(parents=True)
    for i in range(files):
        (src / f"f{i}.bin").write_bytes(os.urandom(4 * MiB))
    nc = await connect(stack.url)
    res = await ImageBuilder(nc.jetstream(), stack.dir / "bench-builder", chunk_size=1 * MiB).build_template(
        "shared", str(stack.dir / "rootfs"), str(stack.dir / "bench-ws"))
    await nc.close()
    shutil.rmtree(stack.dir / "bench-builder")
    layers = res.manifest.layers
    d = LazyDaemon(data_dir=stack.dir, mount=stack.dir / "lazy", nats_url=stack.url)
    d.start()
    try:
        sbs = await create(stack, args.readers, template="shared", memory_mb=128)
        read = files * 4 * MiB
        cmd = "cat /data/* > /dev/null"
        first = await timed(sbs[0], cmd)
        one = sum(int(ln.split()[1]) for ln in (cg(stack, sbs[0].sandbox_id) / "memory.stat").read_text().splitlines() if ln.startswith("total_cache "))
        rest = [await timed(sb, cmd) for sb in sbs[1:]]
        total = sum(int(ln.split()[1]) for sb in sbs for ln in (cg(stack, sb.sandbox_id) / "memory.stat").read_text().splitlines()
                    if ln.startswith("total_cache "))
        hexd = [lay.digest.split(":", 1)[1] for lay in layers]
        fuse = cached([stack.dir / "lazy" / h for h in hexd])
        chunks = cached([p for p in (stack.dir / "cache" / "chunks").rglob("*") if p.is_file()])
        grown = total + fuse + chunks
        print(f"    read {read / MiB:.0f} MiB in each: first sandbox charged {one / MiB:.1f} MiB ({first:.2f} s), the other "
              f"{len(rest)} together {(total - one) / MiB:.1f} MiB (p50 {statistics.median(rest) if rest else 0:.2f} s each)")
        print(f"    page cache: sandboxes {total / MiB:.1f} MiB + loader's FUSE files {fuse / MiB:.1f} MiB + chunk files "
              f"{chunks / MiB:.1f} MiB = {grown / MiB:.1f} MiB, {grown / read:.2f}x the bytes read")
        await asyncio.gather(*(sb.kill() for sb in sbs))
    finally:
        assert stack.backend is not None
        for lay in layers:
            h = lay.digest.split(":", 1)[1]
            if stack.backend.layers.forget(h):
                subprocess.run(["umount", str(stack.dir / "layers" / h)], check=False)
        d.release()


async def run(args: argparse.Namespace) -> None:
    stack = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=8, memory_mb=256, disk_mb=64, cpu=1.0,
                                     cpu_overcommit=1000.0, reconcile_s=10.0))
    await stack.start()
    try:
        if args.template == "python":
            await python_template(stack)
        parts = {"memory": bench_memory, "cpu": bench_cpu, "cache": bench_cache}
        for name, fn in parts.items():
            if args.only in ("", name):
                await fn(stack, args)
    finally:
        left = await stack.stop()
        if left:
            print(f"left behind: {left}")


DEBIAN = Path(os.environ.get("DSEC_FNCALL_CACHE", "/var/cache/dsec-fncall")) / "images" / "rootfs"


def debian_rootfs() -> Path | None:
    """The Debian rootfs with python3 the fncall tests cache (their first run builds it), if it is here."""
    return next((p for p in sorted(DEBIAN.glob("debian-*")) if p.is_dir() and (p / "usr/bin/python3").exists()), None)


async def python_template(stack: Stack) -> None:
    from bus import codec, connect
    from bus import subjects as S
    from bus.streams import ensure_kv
    from bus.messages import LayerRef, TemplateManifest

    root = debian_rootfs()
    assert root is not None
    nc = await connect(stack.url)
    kv = await ensure_kv(nc.jetstream(), S.KV_IMAGES)
    await kv.put("python", codec.encode(TemplateManifest(name="python", layers=[
        LayerRef(role="base", digest="sha256:" + "1" * 64, kind="dir", path=str(root))])))
    await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=20, help="(a) idle sandboxes")
    ap.add_argument("--hold-mb", type=int, default=32, help="(a) anonymous memory each holds")
    ap.add_argument("--idle-s", type=float, default=5.0, help="(a) idle time before the first exec, and the service's --idle")
    ap.add_argument("--runs", type=int, default=3, help="(b) loop runs per figure (median)")
    ap.add_argument("--rounds", type=int, default=7, help="(b) rounds of alone / 50%% / 100%% figures, interleaved (median of the ratios)")
    ap.add_argument("--readers", type=int, default=16, help="(c) sandboxes reading the files")
    ap.add_argument("--read-mb", type=int, default=64, help="(c) template files each reads")
    ap.add_argument("--template", choices=("python", "base"), default="python" if debian_rootfs() else "base",
                    help="(a) python: the Debian rootfs the fncall tests cache (the issue's Python process); base: busybox (a shell holding text)")
    ap.add_argument("--only", choices=("", "memory", "cpu", "cache"), default="")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
