"""Benchmark of templates users define (a script, not a test).

    python tests/bench/bench_templates.py [--image-mb 64]

A fresh stack in this process (``bench_sandboxes.py``'s: embedded NATS JetStream, a placement
replica, a host agent with the container backend), this host's real lazy loader (it packs the build
steps' snapshots), the image service, and a real registry (Debian's docker-registry on 127.0.0.1).
Through the real SDK it measures

* a Dockerfile of 10 steps (COPY, ENV, WORKDIR, RUNs writing files): the first build, an unchanged
  rebuild (all cached), and a rebuild after changing the last step; time and bytes stored;
* an image in the registry (busybox + ``--image-mb`` of data in a second layer): the pull into a
  template (download, convert to EROFS, upload the chunks), a second pull of the same image (nothing
  to fetch), the first create from it and a second one.

Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bus import codec  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.streams import ensure_kv  # noqa: E402
from sdk import AsyncSandbox  # noqa: E402
from sdk._builder import build_dockerfile  # noqa: E402
from tests import registry as R  # noqa: E402
from tests.bench._common import stop_lazy_stack  # noqa: E402
from tests.bench.bench_sandboxes import Stack  # noqa: E402
from tests.imaged.conftest import LazyDaemon  # noqa: E402

MiB = 1 << 20

DOCKERFILE = """\
FROM base
ENV APP=/srv/app
WORKDIR /srv/app
COPY data/ ./data/
RUN head -c 4194304 /dev/urandom > blob1
RUN mkdir -p gen && for i in 1 2 3 4 5 6 7 8; do echo line $i > gen/f$i; done
RUN head -c 2097152 /dev/urandom > blob2
ENV MODE=bench
RUN echo $MODE > mode.txt
RUN echo {last} > last.txt
"""


def ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1000


async def _stored(st: Stack, snapshot_ids: list[str]) -> int:
    """Bytes the build's new step snapshots put into the blob store (new chunks only)."""
    from bus.runtime import connect

    nc = await connect(st.url)
    try:
        kv = await ensure_kv(nc.jetstream(), S.KV_SNAPSHOTS)
        return sum([codec.SNAPSHOT.decode((await kv.get(sid)).value).bytes_added for sid in snapshot_ids])
    finally:
        await nc.close()


async def dockerfile(st: Stack, work: Path) -> None:
    ctx = work / "ctx"
    (ctx / "data").mkdir(parents=True)
    for i in range(4):
        (ctx / "data" / f"d{i}.bin").write_bytes(os.urandom(256 * 1024))
    print("Dockerfile of 10 steps (FROM, 2 ENV, WORKDIR, COPY of 1 MiB, 5 RUN writing ~6 MiB):")
    for label, last in (("first build", "one"), ("unchanged rebuild", "one"), ("last step changed", "two")):
        (ctx / "Dockerfile").write_text(DOCKERFILE.format(last=last))
        t0 = time.perf_counter()
        rep = await build_dockerfile("bench-df", ctx / "Dockerfile", nats_url=st.url)
        took = ms(t0)
        fresh = [s.snapshot for s in rep.steps if s.snapshot and not s.cached]
        stored = await _stored(st, fresh)
        cached = sum(1 for s in rep.steps if s.cached)
        print(f"  {label:18s} {took:8.1f} ms, {cached} steps cached, {rep.sandboxes} build sandbox(es), stored {stored / 1024:8.1f} KiB,"
              f" template of {len(rep.manifest.layers)} layers")


async def pulled_image(st: Stack, work: Path, image_mb: int) -> None:
    from imaged import ImageBuilder
    from imaged._oci import build_from_image

    reg = R.LocalRegistry().start()
    try:
        data = R.tar_layer({"opt": ("dir",), "opt/data.bin": os.urandom(image_mb * MiB)})
        layout = R.oci_layout(work / "img", [R.busybox_layer(), data], {"Env": ["PATH=/bin"], "WorkingDir": "/opt"})
        t0 = time.perf_counter()
        reg.push(layout, "bench/img", "v1")
        print(f"image of busybox + {image_mb} MiB (pushed with skopeo in {ms(t0):.0f} ms):")
        from bus.runtime import connect

        nc = await connect(st.url)
        builder = ImageBuilder(nc.jetstream(), st.dir / "imaged")
        try:
            t0 = time.perf_counter()
            res, pulled = await build_from_image(builder, "bench-img", f"{reg.host}/bench/img:v1")
            print(f"  pull + convert + store   {ms(t0):8.1f} ms ({len(pulled.fetched)} layers fetched, uploaded {res.uploaded_bytes / MiB:.1f} MiB)")
            t0 = time.perf_counter()
            _, again = await build_from_image(builder, "bench-img2", f"{reg.host}/bench/img:v1")
            print(f"  same image again         {ms(t0):8.1f} ms ({len(again.fetched)} layers fetched)")
        finally:
            await builder.store.close()
            await nc.close()
        for label in ("first create", "second create"):
            t0 = time.perf_counter()
            sb = await AsyncSandbox.create("bench-img", nats_url=st.url, timeout=600)
            took = ms(t0)
            r = await sb.commands.run("wc -c < /opt/data.bin")
            await sb.kill()
            print(f"  {label:24s} {took:8.1f} ms (reads {int(r.stdout) / MiB:.0f} MiB file)")
    finally:
        reg.close()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--image-mb", type=int, default=64)
    args = ap.parse_args()
    missing = R.missing()
    if missing:
        print(missing)
        return 2
    st = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=16, memory_mb=64, disk_mb=1024, cpu=1.0, cpu_overcommit=50.0, reconcile_s=10.0))
    await st.start()
    lazy = LazyDaemon(data_dir=st.dir, mount=st.dir / "lazy", nats_url=st.url, host_id="bench")
    lazy.start()
    from imaged._service import ImagedService

    svc = ImagedService(st.url, data_dir=st.dir / "imaged", ensure_base=False)
    await svc.start()
    work = Path(tempfile.mkdtemp(prefix="bench-tmpl-"))
    try:
        await dockerfile(st, work)
        await pulled_image(st, work, args.image_mb)
    finally:
        await svc.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        await stop_lazy_stack(st, lazy)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
