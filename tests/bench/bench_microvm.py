"""Benchmark of the microvm backend on one host (a script, not a test).

    python tests/bench/bench_microvm.py [--vms 8] [--memory-mb 256] [--payload-mb 64] [--rootfs DIR]
                                        [--modes pmem,blk-private[,blk-shared]] [--no-snapshot]

It drives ``MicroVMBackend`` directly (no NATS: what is measured is QEMU and the guest) and reports,
with the host's load average before and after (the machine is shared: figures move with it):

* boot to ready: QEMU started until the guest's agent answers (TCG here; KVM where the probe boots);
* host memory per idle microVM: QEMU's RSS and PSS;
* host memory for ``--vms`` microVMs on one template, per way of attaching its EROFS layer:

  - ``pmem``: virtio-pmem with DAX (the backend's default where the guest kernel has it): every
    guest maps the one blob from the host's page cache, no copy in guest RAM;
  - ``blk-private``: virtio-blk, each VM on its own copy of the blob (each copy in the host's page
    cache, and what the guest read cached again in its RAM);
  - ``blk-shared``: virtio-blk, all VMs on the one blob (one host copy, one more per guest).

  Host memory = the QEMUs' anonymous and shmem PSS (guest RAM and QEMU's own) + the blobs' pages in
  the host's page cache (``fincore``; dropped before each round). QEMU's file-backed PSS is left out:
  with DAX it is the blob's page cache again, and QEMU's own binary is the same in every mode.
  Each idle guest has read ``--payload-mb`` of the template's files (a runtime's libraries).
* a memory snapshot of a running VM (QEMU migration to a file) and restore to ready.

The template is busybox (``imaged._busybox``) plus a random payload unless ``--rootfs`` names a
directory. Everything it starts is stopped by pid and its data dirs removed at the end.
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
from hostagent.backends.microvm import MicroVMBackend, qemu  # noqa: E402
from tests.imaged.conftest import drop_cached_pages  # noqa: E402

KERNEL_CACHE = "/tmp/dsec-microvm-kernel"
MODES = ("pmem", "blk-private", "blk-shared")


def smaps_mb(pid: int) -> dict[str, int]:
    """The process's PSS figures (its shared pages split among their users), MiB."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for ln in f:
                k, _, v = ln.partition(":")
                if k.startswith("Pss"):
                    out[k] = int(v.split()[0]) // 1024
    except OSError:
        pass
    return out


def anon_parts_mb(pid: int, memory_mb: int) -> dict[str, int]:
    """Where the QEMU's anonymous memory is, MiB: the guest's RAM (the mapping of its size), TCG's
    translation cache (the executable mapping) and the rest (QEMU's own: devices, TCG's tables, heap)."""
    parts = {"guest RAM": 0, "TCG code": 0, "QEMU": 0}
    size, perms = 0, ""
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for ln in f:
                head = ln.split()
                if not head[0].endswith(":"):
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    size, perms = hi - lo, head[1]
                elif head[0] == "Anonymous:":
                    kind = "guest RAM" if size == memory_mb << 20 else "TCG code" if "x" in perms else "QEMU"
                    parts[kind] += int(head[1])
    except OSError:
        pass
    return {k: v >> 10 for k, v in parts.items()}


async def settled_anon_mb(pids: list[int], timeout_s: float = 60.0) -> int:
    """The QEMUs' anonymous memory once it stops falling: the idle guests' free page reporting
    (virtio-balloon) hands back what they freed a couple of seconds after they freed it."""
    def total() -> int:
        return sum(smaps_mb(p).get("Pss_Anon", 0) for p in pids)

    loop = asyncio.get_running_loop()
    deadline, last = loop.time() + timeout_s, total()
    while loop.time() < deadline:
        await asyncio.sleep(3)  # a few reporting periods (2 s in the guest)
        now = total()
        if now >= last - 1:
            return now
        last = now
    return last


def cached_mb(paths: list[str]) -> int:
    """Pages of ``paths`` in the host's page cache (util-linux fincore): what the layers cost the host."""
    r = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", *paths], capture_output=True, text=True)
    return sum(int(x) for x in r.stdout.split()) >> 20


def load() -> str:
    return "/".join(f"{x:.1f}" for x in os.getloadavg())


async def boot_many(b: MicroVMBackend, prefix: str, layers: list[list[LayerRef]], memory_mb: int) -> tuple[list[float], list[Handle]]:
    """One VM per entry of ``layers``, one after another (a TCG boot takes the cores it gets); each
    one's boot time. Each then reads the template's files, as an idle sandbox's runtime would have."""
    times, handles = [], []
    for i, lay in enumerate(layers):
        t = time.perf_counter()
        h = await b.create(SandboxSpec(sandbox_id=f"{prefix}{i}", template="bench", cpu=1, memory_mb=memory_mb, disk_mb=256), lay)
        times.append(time.perf_counter() - t)
        handles.append(h)
        await b.exec(h, ExecRequest(cmd="ls -R / >/dev/null 2>&1; cat /opt/payload/* >/dev/null 2>&1; true", timeout_s=600), None)
    return times, handles


async def round_(mode: str, data: Path, rootfs: str, args: argparse.Namespace) -> dict[str, float]:
    """``args.vms`` VMs attached as ``mode``; their boot times and host memory."""
    d = data / mode
    b = MicroVMBackend(str(d), kernel_cache=KERNEL_CACHE, layers="pmem" if mode == "pmem" else "blk")
    try:
        await b.start()
        base = LayerRef(role="base", digest="sha256:" + "b" * 64, kind="dir", path=rootfs)
        blob = await b._blob(base)  # packed once as EROFS
        if mode == "pmem" and b.layer_mode == "virtio-blk":
            print(f"{mode}: the guest kernel has no virtio-pmem/DAX here; skipped")
            return {}
        if mode == "blk-private":
            blobs = []
            for i in range(args.vms):
                copy = str(d / f"private-{i}.erofs")
                shutil.copyfile(blob, copy)
                blobs.append(copy)
            os.sync()
        else:
            blobs = [blob] * args.vms
        layers = [[LayerRef(role="base", digest=f"sha256:{i:064x}", kind="erofs", path=p)] for i, p in enumerate(blobs)]
        if mode == "pmem":  # the padded blob virtio-pmem maps (the packed one is already whole 2 MiB pages)
            blobs = [await b._pmem_blob(layers[0][0])] * args.vms
        for p in set(blobs):
            drop_cached_pages(p)
        boots, handles = await boot_many(b, "v", layers, args.memory_mb)
        pids = [qemu.read_pid(b._dir(h.sandbox_id)) or 0 for h in handles]
        await settled_anon_mb(pids)  # the guests idle, what they freed handed back
        figs = [smaps_mb(p) for p in pids]
        private = sum(f.get("Pss_Anon", 0) + f.get("Pss_Shmem", 0) for f in figs)
        cache = cached_mb(sorted(set(blobs)))
        rss = [qemu.rss_mb(p) for p in pids]
        print(f"{mode} ({b.layer_mode}): boot to ready median {statistics.median(boots):.2f}s min {min(boots):.2f}s "
              f"max {max(boots):.2f}s; per idle VM: RSS median {statistics.median(rss)} MB, anon+shmem PSS {private / args.vms:.0f} MB; "
              f"{args.vms} VMs: host {private + cache} MB (PSS {private} + layer page cache {cache}); load {load()}")
        parts = [anon_parts_mb(p, args.memory_mb) for p in pids]
        mem = await b.exec(handles[0], ExecRequest(cmd="grep -E '^(MemTotal|MemFree|Cached):' /proc/meminfo"), None)
        guest = ", ".join(f"{ln.split()[0]} {int(ln.split()[1]) >> 10}" for ln in mem.stdout.decode().splitlines())
        print("  per VM (median MB) anonymous: " + ", ".join(f"{k} {statistics.median(p[k] for p in parts):.0f}" for k in parts[0])
              + f"; guest {guest} MB")
        out = {"host": private + cache, "boot": statistics.median(boots)}
        if mode == "pmem" and not args.no_snapshot:
            await snapshot(b, handles[0], layers[0], d, args.memory_mb)
        return out
    finally:
        for v in (b.vms.iterdir() if b.vms.exists() else []):
            await b.destroy(v.name)
        await b.stop()


async def snapshot(b: MicroVMBackend, h: Handle, layers: list[LayerRef], d: Path, memory_mb: int) -> None:
    img = d / "img"
    img.mkdir()
    await b.before_freeze(h)
    await b.freeze(h)
    t = time.perf_counter()
    await b.checkpoint(h, str(img), str(d))
    ckpt = time.perf_counter() - t
    await b.thaw(h)
    mem_blob = str(d / "mem.erofs")
    r = await asyncio.create_subprocess_exec("mkfs.erofs", "--quiet", mem_blob, str(img))
    await r.wait()
    mem = LayerRef(role="memory", digest="sha256:" + "d" * 64, kind="erofs", path=mem_blob)
    t = time.perf_counter()
    await b.create(SandboxSpec(sandbox_id="r0", template="bench", cpu=1, memory_mb=memory_mb), layers, memory=mem)
    print(f"memory snapshot: save {ckpt:.2f}s ({sum(f.stat().st_size for f in img.iterdir()) >> 20} MiB, the layers left out); "
          f"restore to ready {time.perf_counter() - t:.2f}s; load {load()}")


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--payload-mb", type=int, default=64)
    ap.add_argument("--rootfs", default="")
    ap.add_argument("--modes", default="pmem,blk-private")
    ap.add_argument("--no-snapshot", action="store_true")
    args = ap.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if not set(modes) <= set(MODES):
        ap.error(f"--modes: each of {', '.join(MODES)}")
    data = Path(tempfile.mkdtemp(prefix="dsec-bench-mvm-", dir="/tmp"))
    print(f"load {load()}; {args.vms} VMs of {args.memory_mb} MB per mode")
    try:
        rootfs = args.rootfs
        if not rootfs:
            from imaged._busybox import build_busybox_rootfs

            rootfs = str(data / "rootfs")
            await asyncio.to_thread(build_busybox_rootfs, rootfs)
            os.makedirs(f"{rootfs}/opt/payload")
            for i in range(max(1, args.payload_mb // 8)):  # random: EROFS cannot shrink it
                Path(f"{rootfs}/opt/payload/lib{i}.so").write_bytes(os.urandom(min(8, args.payload_mb) << 20))
        got = {m: await round_(m, data, rootfs, args) for m in modes}
        if got.get("pmem") and got.get("blk-private"):
            one, each = got["pmem"]["host"], got["blk-private"]["host"]
            print(f"{args.vms} microVMs, host memory: shared DAX layers {one:.0f} MB vs private virtio-blk copies {each:.0f} MB: "
                  f"{(one - each) / max(each, 1) * 100:+.1f}%")
    finally:
        for v in data.glob("*/mvm/vms/*"):
            qemu.kill(str(v))
        shutil.rmtree(data, ignore_errors=True)
    print(f"load {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
