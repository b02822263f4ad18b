"""Benchmark of the microvm backend on one host (a script, not a test).

    python tests/bench/bench_microvm.py [--vms 8] [--memory-mb 256] [--rootfs DIR]

It drives ``MicroVMBackend`` directly (no NATS: what is measured is QEMU and the guest) and reports

* boot to ready: QEMU started until the guest's agent answers a ping (TCG here; KVM where the
  probe boots), and restore to ready from a memory snapshot (QEMU ``-incoming``);
* host memory per idle microVM: QEMU's RSS and PSS (the machine is shared: MemAvailable is noise);
* ``--vms`` microVMs on one template, its EROFS layer shared (every VM attaches the same blob, one
  copy in the host's page cache) vs private (each VM its own copy of the blob): QEMU PSS plus the
  blobs' pages in the host's page cache (``fincore``), dropped from the cache before each round.
  The layers are virtio-blk disks: the guests still cache what they read in their own RAM (DAX over
  virtio-pmem, which would spare that copy too, is not implemented).

The template is busybox (``imaged._busybox``) unless ``--rootfs`` names a directory. Everything it
starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bus.messages import ExecRequest, LayerRef, SandboxSpec  # noqa: E402
from hostagent._backend import Handle  # noqa: E402
from hostagent.backends.microvm import MicroVMBackend  # noqa: E402
from tests.imaged.conftest import drop_cached_pages  # noqa: E402
from hostagent.backends.microvm import qemu  # noqa: E402

KERNEL_CACHE = "/tmp/dsec-microvm-kernel"


def pss_mb(pid: int) -> int:
    """The process's proportional set size (its shared pages split among their users)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("Pss:")) // 1024
    except (OSError, StopIteration):
        return 0


def cached_mb(paths: list[str]) -> int:
    """Pages of ``paths`` in the host's page cache (util-linux fincore): what the layers cost the host."""
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split()) >> 20


def host_cost_mb(b: MicroVMBackend, sids: list[str], blobs: list[str]) -> tuple[int, int]:
    """(QEMU PSS summed over the VMs, the layer blobs' page cache)."""
    return sum(pss_mb(qemu.read_pid(b._dir(s)) or 0) for s in sids), cached_mb(sorted(set(blobs)))


async def boot_many(b: MicroVMBackend, prefix: str, n: int, layers: list[list[LayerRef]], memory_mb: int) -> tuple[list[float], list[Handle]]:
    """``n`` VMs, one after another (a TCG boot takes the cores it gets); each one's boot time."""
    times, handles = [], []
    for i in range(n):
        t = time.perf_counter()
        h = await b.create(SandboxSpec(sandbox_id=f"{prefix}{i}", template="bench", cpu=1, memory_mb=memory_mb, disk_mb=256), layers[i])
        times.append(time.perf_counter() - t)
        handles.append(h)
        # what an idle sandbox has touched: its shell and the layer's files it ran
        await b.exec(h, ExecRequest(cmd="ls -R / >/dev/null 2>&1; true"), None)
    return times, handles


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--rootfs", default="")
    args = ap.parse_args()
    data = Path(tempfile.mkdtemp(prefix="dsec-bench-mvm-", dir="/tmp"))
    b = MicroVMBackend(str(data), kernel_cache=KERNEL_CACHE)
    try:
        await b.start()
        rootfs = args.rootfs
        if not rootfs:
            from imaged._busybox import build_busybox_rootfs

            rootfs = str(data / "rootfs")
            await asyncio.to_thread(build_busybox_rootfs, rootfs)
        base = LayerRef(role="base", digest="sha256:" + "b" * 64, kind="dir", path=rootfs)
        blob = await b._blob(base)  # packed once as EROFS
        shared = LayerRef(role="base", digest="sha256:" + "c" * 64, kind="erofs", path=blob)
        print(f"accel={b.accel} kernel={b.kernel.release if b.kernel else '?'} layer={os.path.getsize(blob) >> 10} KiB")

        # 1. boot to ready, and memory per idle VM (shared layer)
        drop_cached_pages(blob)
        boots, handles = await boot_many(b, "s", args.vms, [[shared]] * args.vms, args.memory_mb)
        await asyncio.sleep(2)  # let the guests go idle before reading memory
        sids = [f"s{i}" for i in range(args.vms)]
        rss = [qemu.rss_mb(qemu.read_pid(b._dir(s)) or 0) for s in sids]
        shared_pss, shared_cache = host_cost_mb(b, sids, [blob])
        print(f"boot to ready: median {statistics.median(boots):.2f}s min {min(boots):.2f}s max {max(boots):.2f}s (n={len(boots)})")
        print(f"idle microVM ({args.memory_mb} MB guest): QEMU RSS median {statistics.median(rss)} MB, PSS {shared_pss / args.vms:.0f} MB per VM")

        # 2. a memory snapshot of one of them, and restore to ready
        h = handles[0]
        img = data / "img"
        img.mkdir()
        await b.before_freeze(h)
        await b.freeze(h)
        t = time.perf_counter()
        await b.checkpoint(h, str(img), str(data))
        ckpt = time.perf_counter() - t
        await b.thaw(h)
        mem_blob = str(data / "mem.erofs")
        r = await asyncio.create_subprocess_exec("mkfs.erofs", "--quiet", mem_blob, str(img))
        await r.wait()
        mem = LayerRef(role="memory", digest="sha256:" + "d" * 64, kind="erofs", path=mem_blob)
        t = time.perf_counter()
        await b.create(SandboxSpec(sandbox_id="r0", template="bench", cpu=1, memory_mb=args.memory_mb), [shared], memory=mem)
        print(f"memory snapshot: save {ckpt:.2f}s ({sum(f.stat().st_size for f in img.iterdir()) >> 20} MiB); restore to ready {time.perf_counter() - t:.2f}s")
        for sid in ["r0", *(f"s{i}" for i in range(args.vms))]:
            await b.destroy(sid)

        # 3. the same number of VMs, each on a private copy of the layer
        private = []
        for i in range(args.vms):
            copy = str(data / f"private-{i}.erofs")
            shutil.copyfile(blob, copy)
            private.append([LayerRef(role="base", digest=f"sha256:{i:064x}", kind="erofs", path=copy)])
        os.sync()
        paths = [lay[0].path for lay in private]
        for copy in paths:
            drop_cached_pages(copy)
        await boot_many(b, "p", args.vms, private, args.memory_mb)
        await asyncio.sleep(2)
        private_pss, private_cache = host_cost_mb(b, [f"p{i}" for i in range(args.vms)], paths)
        one, each = shared_pss + shared_cache, private_pss + private_cache
        print(f"{args.vms} microVMs: shared layer {one} MB (PSS {shared_pss} + cache {shared_cache}) vs private copies {each} MB "
              f"(PSS {private_pss} + cache {private_cache}): {(one - each) / max(each, 1) * 100:+.1f}%")
        for i in range(args.vms):
            await b.destroy(f"p{i}")
    finally:
        for d in (b.vms.iterdir() if b.vms.exists() else []):
            qemu.kill(str(d))
        await b.stop()
        shutil.rmtree(data, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
