"""Benchmark: fork of a running desktop VM (a script, not a test).

    python tests/bench/bench_vm_desktop.py [--forks 8] [--memory-mb 512]

It builds (or reuses) the GUI template's rootfs (``compose/gui-rootfs.sh``: Xorg, twm, xterm, Dillo), boots
it on the full-VM backend (``VMBackend``, driven directly: no NATS), waits for the desktop, and reports

* boot to ready (agent answers) and to a desktop taking input (the terminal's shell runs);
* the memory snapshot of the running desktop: QEMU migration to a file (the template's layers left
  out: they are virtio-pmem regions every VM maps) plus the disk, and its packing as a layer;
* ``--forks`` VMs restored from it at once: time until every fork's agent answers with the desktop
  running, and each fork's own restore time; host memory of the forks (anonymous PSS);
* the template's browser (Dillo) opened in the first desktop on a local page: time until the
  screenshot shows the page (its colour over most of the browser's window);

with the host's load average (the machine is shared). Everything it starts is stopped by pid and its
data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
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
from hostagent.backends.microvm import qemu  # noqa: E402
from hostagent.backends.vm import VMBackend  # noqa: E402
from tests.bench.bench_microvm import KERNEL_CACHE, load, smaps_mb  # noqa: E402
from tests.pngpixels import png_pixels  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


async def desktop_up(b: VMBackend, h: Handle) -> bool:
    r = await b.exec(h, ExecRequest(cmd="test -e /run/dsec-desktop && pgrep -x Xorg >/dev/null && pgrep -x twm >/dev/null"), None)
    return r.exit_code == 0


async def browse(b: VMBackend, h: Handle) -> float:
    """Seconds from starting the browser on a local magenta page until the screen shows it."""
    page = '<html><body bgcolor="#ff00ff"><h1>dsec</h1></body></html>'
    await b.exec(h, ExecRequest(cmd=f"cat > /tmp/page.html <<'EOF'\n{page}\nEOF"), None)
    t = time.perf_counter()
    await b.exec(h, ExecRequest(cmd="DISPLAY=:0 HOME=/root setsid dillo -g 640x480+300+100 file:///tmp/page.html </dev/null >/dev/null 2>&1 &"), None)
    while png_pixels(await b.screenshot(h), (255, 0, 255)) < 100_000:  # most of the 640x480 window
        await asyncio.sleep(0.5)  # poll interval while the browser starts
    return time.perf_counter() - t


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--forks", type=int, default=8)
    ap.add_argument("--memory-mb", type=int, default=512)
    args = ap.parse_args()
    print(f"load {load()}")
    rootfs = subprocess.run(["bash", str(REPO / "compose" / "gui-rootfs.sh")], capture_output=True, text=True, check=True).stdout.split()[-1]
    data = Path(tempfile.mkdtemp(prefix="dsec-bench-desk-", dir="/tmp"))
    b = VMBackend(str(data), kernel_cache=KERNEL_CACHE)
    try:
        await b.start()
        base = LayerRef(role="base", digest="sha256:" + "9" * 64, kind="dir", path=rootfs)
        # packed before the clock starts
        await (b._pmem_blob(base) if b.layer_mode != "virtio-blk" else b._blob(base))
        spec = SandboxSpec(sandbox_id="desk", template="gui", backend="vm", cpu=1, memory_mb=args.memory_mb, disk_mb=512)
        t = time.perf_counter()
        h = await b.create(spec, [base])
        boot = time.perf_counter() - t
        while not await desktop_up(b, h):
            await asyncio.sleep(0.5)  # poll interval while Xorg starts
        print(f"desktop ({b.accel}, kernel {b.kernel.release if b.kernel else '?'}, layers {b.layer_mode}): boot to ready {boot:.1f}s, "
              f"to a desktop taking input {time.perf_counter() - t:.1f}s; load {load()}")

        img = data / "img"
        img.mkdir()
        t = time.perf_counter()
        await b.before_freeze(h)
        await b.freeze(h)
        await b.checkpoint(h, str(img), str(data))
        await b.thaw(h)
        save = time.perf_counter() - t
        mem_blob = data / "mem.erofs"
        t = time.perf_counter()
        subprocess.run(["mkfs.erofs", "--quiet", str(mem_blob), str(img)], check=True)
        pack = time.perf_counter() - t
        size = sum(f.stat().st_size for f in img.iterdir()) >> 20
        print(f"snapshot of the running desktop: {save:.1f}s ({size} MiB), packed as a layer in {pack:.1f}s; load {load()}")

        mem = LayerRef(role="memory", digest="sha256:" + "8" * 64, kind="erofs", path=str(mem_blob))
        each: list[float] = []

        async def fork(i: int) -> None:
            t0 = time.perf_counter()
            f = await b.create(SandboxSpec(sandbox_id=f"fork{i}", template="gui", backend="vm", cpu=1, memory_mb=args.memory_mb), [base], memory=mem)
            assert await desktop_up(b, f)
            each.append(time.perf_counter() - t0)

        t = time.perf_counter()
        await asyncio.gather(*(fork(i) for i in range(args.forks)))
        total = time.perf_counter() - t
        anon = [smaps_mb(qemu.read_pid(b._dir(f"fork{i}")) or 0).get("Pss_Anon", 0) for i in range(args.forks)]
        print(f"fork {args.forks} of the running desktop: all ready in {total:.1f}s; each {statistics.median(each):.1f}s median, "
              f"{max(each):.1f}s max; anonymous PSS {statistics.median(anon)} MB per fork; load {load()}")
        print(f"browser (Dillo) shows a local page in {await browse(b, h):.1f}s; load {load()}")
    finally:
        for v in (b.vms.iterdir() if b.vms.exists() else []):
            await b.destroy(v.name)
        await b.stop()
        shutil.rmtree(data, ignore_errors=True)
    print(f"load {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
