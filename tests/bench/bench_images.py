#!/usr/bin/env python3
"""Benchmarks of layered images and lazy loading (root; real NATS, mkfs.erofs, FUSE, EROFS, overlayfs).

(a) A realistic task on the Python template (debian bookworm + python3, pip, git), run in a chroot on an
    overlay over the lazily mounted layer: how much of the image gets fetched (fetched / image bytes),
    cold and warm times, for each chunk size asked for.
(b) N "sandboxes", each from its own workspace layer on a shared base (the Python template's layer):
    lazy vs prefetch - wall time and bytes written to local disk - with the base already cached on the
    host ("warm base") and not ("cold host").

    python tests/bench/bench_images.py [--sandboxes 64] [--ws-mib 48] [--chunk-sizes 131072,262144,1048576]
                                       [--data-dir /var/tmp/dsec-bench] [--json]

The Python rootfs (debootstrap) is cached under --data-dir, so only the first run needs the network.
Everything started is stopped by pid and every mount is undone at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bus.natsd import NatsServer  # noqa: E402
from bus.runtime import connect  # noqa: E402
from bus.streams import ensure_all  # noqa: E402
from hostagent.backends.container.layers import mount_erofs as _mount_erofs  # noqa: E402
from imaged import ImageBuilder, python_rootfs  # noqa: E402
from imaged._util import digest_hex  # noqa: E402

MiB = 1 << 20

TEST_SUITE = '''
import json, re, unittest, collections, dataclasses, tempfile, pathlib, hashlib, textwrap

@dataclasses.dataclass
class Item:
    name: str
    qty: int

class T(unittest.TestCase):
    def test_json(self):
        self.assertEqual(json.loads(json.dumps({"a": [1, 2]})), {"a": [1, 2]})
    def test_re(self):
        self.assertEqual(re.findall(r"\\d+", "a1b22c333"), ["1", "22", "333"])
    def test_counter(self):
        self.assertEqual(collections.Counter("abca")["a"], 2)
    def test_files(self):
        with tempfile.TemporaryDirectory() as d:
            p = pathlib.Path(d) / "x.txt"
            p.write_text(textwrap.dedent("  hi\\n"))
            self.assertEqual(hashlib.sha256(p.read_bytes()).hexdigest()[:4], hashlib.sha256(b"hi\\n").hexdigest()[:4])
    def test_dataclass(self):
        self.assertEqual(Item("x", 2).qty, 2)
'''

TASKS = {
    "unittest": "cd /workspace && python3 -m unittest -q test_small 2>&1",
    "tools": "python3 -c 'import json, re, os, subprocess, asyncio, sqlite3, urllib.request' && pip --version && git --version",
}


# --- helpers -------------------------------------------------------------------------------------------
def sh(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {r.returncode} {r.stderr.strip()}")
    return r


def is_mounted(path: str | Path) -> bool:
    p = os.path.realpath(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == p for line in f)


class Mounts:
    def __init__(self) -> None:
        self.stack: list[Path] = []

    def erofs(self, blob: str | Path, target: Path) -> Path:
        target.mkdir(parents=True, exist_ok=True)
        _mount_erofs(str(blob), str(target))  # as the host agent does: from the file, no loop device
        self.stack.append(target)
        return target

    def overlay(self, lowers: list[Path], upper: Path, work: Path, merged: Path) -> Path:
        for d in (upper, work, merged):
            d.mkdir(parents=True, exist_ok=True)
        opts = f"lowerdir={':'.join(str(x) for x in lowers)},upperdir={upper},workdir={work}"
        sh("mount", "-t", "overlay", "overlay", "-o", opts, str(merged))
        self.stack.append(merged)
        return merged

    def umount(self, target: Path) -> None:
        if is_mounted(target):
            r = sh("umount", str(target), check=False)
            if r.returncode != 0:
                sh("umount", "-l", str(target), check=False)
        if target in self.stack:
            self.stack.remove(target)

    def close(self) -> None:
        for t in reversed(list(self.stack)):
            self.umount(t)


class Daemon:
    """``python -m imaged.lazy``, started and stopped by pid."""

    def __init__(self, data_dir: Path, mount: Path, nats_url: str, mode: str, extra: list[str] | None = None) -> None:
        self.data_dir, self.mount, self.nats_url, self.mode = data_dir, mount, nats_url, mode
        self.extra = extra or []
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Daemon":
        self.mount.mkdir(parents=True, exist_ok=True)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        with open(self.data_dir / "lazy.log", "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "imaged.lazy", "--data-dir", str(self.data_dir), "--mount", str(self.mount),
                 "--nats-url", self.nats_url, "--mode", self.mode, "--host-id", "bench", *self.extra],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(REPO)},
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"lazy daemon exited: {(self.data_dir / 'lazy.log').read_text()[-2000:]}")
            try:
                info = self.info()
                if info.get("pid") == self.proc.pid and info.get("mounted") and is_mounted(self.mount):
                    return self
            except (OSError, ValueError):
                pass
            time.sleep(0.02)  # readiness poll
        raise RuntimeError("lazy daemon did not mount in time")

    def info(self) -> dict:
        return json.loads((self.data_dir / "cache" / "daemon.json").read_text())

    def index(self) -> dict:
        return json.loads((self.data_dir / "cache" / "index.json").read_text())

    def settled_info(self) -> dict:
        """daemon.json once the debounced writer has caught up (two equal reads in a row)."""
        last = None
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            cur = self.info()
            if cur == last:
                return cur
            last = cur
            time.sleep(0.3)  # the daemon rewrites its files at most every 0.2 s
        return last or self.info()

    def io_write_bytes(self) -> int:
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/io") as f:
            for line in f:
                if line.startswith("write_bytes:"):
                    return int(line.split()[1])
        return 0

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def chroot_run(root: Path, cmd: str, timeout: float = 300) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.monotonic()
    r = subprocess.run(["chroot", str(root), "/bin/sh", "-c", cmd], capture_output=True, text=True, timeout=timeout,
                       env={"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"})
    return time.monotonic() - t0, r


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


# --- (a) the Python template -----------------------------------------------------------------------------
async def bench_python(js: Any, nats_url: str, data_dir: Path, work: Path, chunk_sizes: list[int], compress: str | None = None) -> list[dict]:
    out = []
    t0 = time.monotonic()
    rootfs = await python_rootfs(data_dir)
    rootfs_s = time.monotonic() - t0
    for cs in chunk_sizes:
        builder = ImageBuilder(js, data_dir, chunk_size=cs, compress=compress)
        t0 = time.monotonic()
        res = await builder.build_template(f"bench-python-{cs // 1024}k{'-' + compress if compress else ''}", str(rootfs))
        build_s = time.monotonic() - t0
        layer = res.manifest.layers[0]
        for task, cmd in TASKS.items():
            run = work / f"py-{cs}-{task}"
            d = Daemon(run / "host", run / "lazy", nats_url, "lazy").start()
            m = Mounts()
            try:
                lower = m.erofs(d.mount / digest_hex(layer.digest), run / "lower")
                merged = m.overlay([lower], run / "upper", run / "work", run / "merged")
                (merged / "workspace").mkdir(exist_ok=True)
                (merged / "workspace" / "test_small.py").write_text(TEST_SUITE)
                cold_s, r = await asyncio.to_thread(chroot_run, merged, cmd)
                if r.returncode != 0:
                    raise RuntimeError(f"task {task} failed: {r.stdout} {r.stderr}")
                warm_s, _ = await asyncio.to_thread(chroot_run, merged, cmd)
                info = await asyncio.to_thread(d.settled_info)
                fetched = d.index()[layer.digest]["fetched_bytes"]
            finally:
                m.close()
                d.stop()
                shutil.rmtree(run, ignore_errors=True)
            out.append({
                "chunk_size": cs, "task": task, "image_bytes": layer.size, "fetched_bytes": fetched,
                "fetched_pct": round(100 * fetched / layer.size, 2), "downloaded_bytes": info["downloaded_bytes"],
                "cold_s": round(cold_s, 3), "warm_s": round(warm_s, 3), "build_s": round(build_s, 2),
                "rootfs_s": round(rootfs_s, 2), "uploaded_bytes": res.uploaded_bytes, "compress": compress or "",
            })
    return out


# --- (b) fan-out: N sandboxes, N workspace layers, one base ---------------------------------------------------
async def build_workspaces(js: Any, data_dir: Path, work: Path, base_digest: str, n: int, ws_mib: int, chunk: int) -> list[Any]:
    builder = ImageBuilder(js, work / "ws-data", chunk_size=chunk)  # throw-away blobs: not in the cached data dir
    layers = []
    files_per = 8
    for i in range(n):
        src = work / "ws-src" / f"ws{i}"
        (src / "workspace" / "data").mkdir(parents=True, exist_ok=True)
        for j in range(files_per):
            (src / "workspace" / "data" / f"part{j}.bin").write_bytes(os.urandom(ws_mib * MiB // files_per))
        (src / "workspace" / "task.py").write_text(
            "import hashlib, json\n"
            f"data = open('/workspace/data/part{i % files_per}.bin', 'rb').read(65536)\n"
            f"print(json.dumps({{'sandbox': {i}, 'sha': hashlib.sha256(data).hexdigest()[:12]}}))\n"
        )
        res = await builder.build_template(f"bench-ws-{i}", f"layer:{base_digest}", str(src))
        layers.append(res.manifest.layers[1])
        shutil.rmtree(src)
    return layers


async def run_fanout(nats_url: str, work: Path, mode: str, base: Any, workspaces: list[Any], concurrency: int, warm_base: bool) -> dict:
    run = work / f"fan-{mode}-{'warm' if warm_base else 'cold'}"
    d = Daemon(run / "host", run / "lazy", nats_url, mode, ["--fetch-concurrency", "8"]).start()
    m = Mounts()
    try:
        base_blob = d.mount / digest_hex(base.digest)
        if warm_base:  # the base is already on this host: pull it whole before the clock starts
            await asyncio.to_thread(sh, "sh", "-c", f"cat {base_blob} > /dev/null")
        info0 = await asyncio.to_thread(d.settled_info)
        io0 = d.io_write_bytes()
        sem = asyncio.Semaphore(concurrency)
        t0 = time.monotonic()
        base_mnt = await asyncio.to_thread(m.erofs, base_blob, run / "base")
        outputs: list[str] = []

        async def sandbox(i: int, layer: Any) -> None:
            async with sem:
                sb = run / "sb" / str(i)
                ws = await asyncio.to_thread(m.erofs, d.mount / digest_hex(layer.digest), sb / "ws")
                merged = await asyncio.to_thread(m.overlay, [ws, base_mnt], sb / "upper", sb / "work", sb / "merged")
                _, r = await asyncio.to_thread(chroot_run, merged, "python3 /workspace/task.py")
                if r.returncode != 0:
                    raise RuntimeError(f"sandbox {i}: {r.stderr}")
                outputs.append(r.stdout)
                await asyncio.to_thread(m.umount, merged)
                await asyncio.to_thread(m.umount, ws)

        await asyncio.gather(*(sandbox(i, lay) for i, lay in enumerate(workspaces)))
        wall = time.monotonic() - t0
        await asyncio.to_thread(os.sync)
        info1 = await asyncio.to_thread(d.settled_info)
        io1 = d.io_write_bytes()
        assert len(outputs) == len(workspaces)
        return {
            "mode": mode,
            "base": "warm" if warm_base else "cold",
            "sandboxes": len(workspaces),
            "wall_s": round(wall, 3),
            "cache_written_bytes": info1["cache_written_bytes"] - info0["cache_written_bytes"],
            "downloaded_bytes": info1["downloaded_bytes"] - info0["downloaded_bytes"],
            "disk_write_bytes": io1 - io0,  # block-layer writes of the daemon (/proc/<pid>/io)
            "workspace_bytes": sum(lay.size for lay in workspaces),
        }
    finally:
        m.close()
        d.stop()
        shutil.rmtree(run, ignore_errors=True)


async def main_async(args: argparse.Namespace) -> dict:
    data_dir = Path(args.data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-img-", dir=args.work_dir))
    nats_dir = Path(tempfile.mkdtemp(prefix="dsec-bench-nats-", dir=args.work_dir))
    srv = NatsServer(nats_dir, port=0).start()
    results: dict[str, Any] = {}
    try:
        nc = await connect(srv.url)
        js = nc.jetstream()
        await ensure_all(js)
        chunk_sizes = [int(x) for x in args.chunk_sizes.split(",") if x]
        if not args.skip_python:
            print("(a) Python template: building and running tasks ...", file=sys.stderr)
            results["python"] = await bench_python(js, srv.url, data_dir, work, chunk_sizes, args.compress)
        if not args.skip_fanout:
            print(f"(b) fan-out: building {args.sandboxes} workspace layers of {args.ws_mib} MiB ...", file=sys.stderr)
            rootfs = await python_rootfs(data_dir)
            builder = ImageBuilder(js, data_dir, chunk_size=args.fanout_chunk)
            base = (await builder.build_template("bench-base", str(rootfs))).manifest.layers[0]
            t0 = time.monotonic()
            wss = await build_workspaces(js, data_dir, work, base.digest, args.sandboxes, args.ws_mib, args.fanout_chunk)
            results["fanout_build_s"] = round(time.monotonic() - t0, 2)
            runs = []
            for warm in (True, False):
                for mode in ("lazy", "prefetch"):
                    print(f"    {mode} ({'warm' if warm else 'cold'} base) ...", file=sys.stderr)
                    runs.append(await run_fanout(srv.url, work, mode, base, wss, args.concurrency, warm))
            results["fanout"] = runs
            results["fanout_base_bytes"] = base.size
        await nc.close()
    finally:
        srv.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(nats_dir, ignore_errors=True)
    return results


def report(results: dict) -> None:
    if "python" in results:
        rows = results["python"]
        r0 = rows[0]
        print(f"\n(a) Python template: image {human(r0['image_bytes'])}{' (' + r0['compress'] + ')' if r0.get('compress') else ''}"
              f" (rootfs via debootstrap: cached, {r0['rootfs_s']}s this run)")
        print(f"    {'chunk':>7} {'task':<9} {'fetched':>10} {'of image':>9} {'cold s':>7} {'warm s':>7} {'layer build s':>14}")
        for r in rows:
            print(f"    {r['chunk_size'] // 1024:>5}Ki {r['task']:<9} {human(r['fetched_bytes']):>10} {r['fetched_pct']:>8.1f}% "
                  f"{r['cold_s']:>7.2f} {r['warm_s']:>7.2f} {r['build_s']:>14.1f}")
    if "fanout" in results:
        runs = results["fanout"]
        n = runs[0]["sandboxes"]
        print(f"\n(b) {n} sandboxes, each on its own workspace layer ({human(runs[0]['workspace_bytes'] / n)} each) over a shared "
              f"base ({human(results['fanout_base_bytes'])}); layers built in {results['fanout_build_s']}s")
        print(f"    {'base':<5} {'mode':<9} {'wall s':>7} {'cache writes':>13} {'disk writes':>12} {'downloaded':>11}")
        for r in runs:
            print(f"    {r['base']:<5} {r['mode']:<9} {r['wall_s']:>7.2f} {human(r['cache_written_bytes']):>13} "
                  f"{human(r['disk_write_bytes']):>12} {human(r['downloaded_bytes']):>11}")
        for base in ("warm", "cold"):
            lz = next(r for r in runs if r["base"] == base and r["mode"] == "lazy")
            pf = next(r for r in runs if r["base"] == base and r["mode"] == "prefetch")
            speed = pf["wall_s"] / lz["wall_s"] if lz["wall_s"] else float("inf")
            writes = lz["cache_written_bytes"] / pf["cache_written_bytes"] if pf["cache_written_bytes"] else 0
            print(f"    {base} base: lazy is {speed:.1f}x faster and writes {writes:.3f} of prefetch's bytes "
                  f"(1/{1 / writes if writes else float('inf'):.0f})")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data-dir", default=os.environ.get("DSEC_BENCH_DATA_DIR", "/var/tmp/dsec-bench"))
    ap.add_argument("--work-dir", default=None, help="where temp dirs go (default: $TMPDIR)")
    ap.add_argument("--chunk-sizes", default="131072,262144,1048576", help="chunk sizes for (a)")
    ap.add_argument("--compress", default=None, help="mkfs.erofs compressor for (a), e.g. lz4hc")
    ap.add_argument("--fanout-chunk", type=int, default=131072)
    ap.add_argument("--sandboxes", type=int, default=64)
    ap.add_argument("--ws-mib", type=int, default=48, help="size of each workspace layer's data")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-python", action="store_true")
    ap.add_argument("--skip-fanout", action="store_true")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_images: needs root (mounts, FUSE, chroot)", file=sys.stderr)
        return 2
    results = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        report(results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
