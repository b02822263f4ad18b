#!/usr/bin/env python3
"""Benchmark of what snapshots cost the host (root; real NATS with its JetStream file store, the real
snapshot packer ``ImageBuilder.pack_dir`` and its EROFS writer).

For each diff (an 8 GiB sparse file, a random file, a file of one repeated 4 KiB block): pack time,
the layer's size, the host bytes it took (local blob + JetStream's store on disk) and the bytes
uploaded. ``--before`` packs the same trees with mkfs.erofs 1.5 as the packer did before (the sparse
one takes over a minute and 8 GiB of disk: off by default). Then gc: N packed and released
layers (N "deleted snapshots") collected at once.

    python tests/bench/bench_storage.py [--mib 64] [--snapshots 100] [--before] [--data-dir /var/tmp/dsec-bench-storage] [--json]

The issue's sizes: ``--mib 1024 --snapshots 1000``. Everything started is stopped by pid; the data
dir is removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
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
from imaged import ImageBuilder  # noqa: E402
from imaged._erofs import mkfs_erofs  # noqa: E402
from imaged._gc import collect, release  # noqa: E402
from tests.integration.conftest import disk_bytes  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


def make_trees(work: Path, mib: int) -> dict[str, Path]:
    trees = {"sparse-8GiB": work / "sparse", f"random-{mib}MiB": work / "random", f"repeated-4KiB-{mib}MiB": work / "repeated"}
    for t in trees.values():
        t.mkdir(parents=True)
    with open(trees["sparse-8GiB"] / "f", "wb") as f:
        f.truncate(8 * GiB)
    with open(trees[f"random-{mib}MiB"] / "f", "wb") as f:
        for _ in range(mib):
            f.write(os.urandom(MiB))
    block = os.urandom(4096) * 256
    with open(trees[f"repeated-4KiB-{mib}MiB"] / "f", "wb") as f:
        for _ in range(mib):
            f.write(block)
    return trees


async def bench_pack(js: Any, data: Path, nats_dir: Path, trees: dict[str, Path], before: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, tree in trees.items():
        builder = ImageBuilder(js, data / name, upload_concurrency=16)
        host0 = disk_bytes(data / name) + disk_bytes(nats_dir)
        t0 = time.perf_counter()
        built = await builder.pack_dir(tree)
        secs = time.perf_counter() - t0
        await release(js, built.ref.digest)
        row: dict[str, Any] = {
            "seconds": round(secs, 3), "layer_bytes": built.ref.size, "uploaded_bytes": built.uploaded_bytes,
            "host_bytes": disk_bytes(data / name) + disk_bytes(nats_dir) - host0,
        }
        if before and shutil.which("mkfs.erofs"):
            img = data / f"{name}.mkfs.erofs"
            t0 = time.perf_counter()
            await mkfs_erofs(tree, img, exact_times=True)
            row["before_seconds"] = round(time.perf_counter() - t0, 3)
            row["before_layer_bytes"] = img.stat().st_blocks * 512
            img.unlink()
        out[name] = row
        print(f"{name:<24} pack {row['seconds']:>8.3f}s  layer {row['layer_bytes']:>12} B  host +{row['host_bytes']:>12} B"
              + (f"   (mkfs.erofs: {row['before_seconds']:.3f}s, {row['before_layer_bytes']} B)" if "before_seconds" in row else ""), file=sys.stderr)
    return out


async def bench_gc(js: Any, data: Path, n: int) -> dict[str, Any]:
    builder = ImageBuilder(js, data / "gc", upload_concurrency=16)
    src = data / "gc-src"
    t0 = time.perf_counter()
    for i in range(n):  # one small diff each, as a snapshot's: a few files, a few chunks
        shutil.rmtree(src, ignore_errors=True)
        (src / "d").mkdir(parents=True)
        (src / "d" / "f").write_bytes(os.urandom(200_000))
        (src / "n").write_text(str(i))
        built = await builder.pack_dir(src)
        await release(js, built.ref.digest)  # its record written, then removed: garbage
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = await collect(js, builder.store, data_dir=data / "gc", local_grace_s=0.0)
    secs = time.perf_counter() - t0
    print(f"gc of {n} deleted snapshots: {secs:.3f}s ({res['layers']} layers, {res['chunks']} chunks; packing them took {made:.1f}s)", file=sys.stderr)
    return {"snapshots": n, "seconds": round(secs, 3), **{k: v for k, v in res.items() if k != "ms"}}


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="bench-", dir=args.data_dir))
    nats_dir, data = root / "nats", root / "data"
    srv = NatsServer(nats_dir, port=0).start()
    try:
        nc = await connect(srv.url)
        try:
            js = nc.jetstream()
            await ensure_all(js)
            trees = make_trees(root / "trees", args.mib)
            return {"pack": await bench_pack(js, data, nats_dir, trees, args.before), "gc": await bench_gc(js, data, args.snapshots)}
        finally:
            await nc.close()
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=64, help="size of the random and repeated files (the issue's: 1024)")
    ap.add_argument("--snapshots", type=int, default=100, help="deleted snapshots gc collects at once (the issue's: 1000)")
    ap.add_argument("--before", action="store_true", help="also pack with mkfs.erofs, as before (the 8 GiB sparse file: > 1 min, 8 GiB)")
    ap.add_argument("--data-dir", default="/var/tmp")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.data_dir, exist_ok=True)
    res = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
