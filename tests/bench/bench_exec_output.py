"""Benchmark of command output and file transfer through the SDK (a script, not a test).

    python tests/bench/bench_exec_output.py [--mib 64] [--runs 3]

On a fresh stack in this process (see bench_sandboxes.Stack): one sandbox; a file of ``--mib`` MiB
of base64 text made inside it; then, per run, the wall time and throughput of

* ``cat`` of it with ``on_stdout`` (every byte streamed, checksummed here against the sandbox's),
* the same without a callback (only the capped result comes back),
* ``files.write`` and ``files.read`` of ``--mib`` MiB of random bytes,

and the p50 of ``commands.run("true")`` and of a background start + wait of ``true``.
Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import stop_stack  # noqa: E402
from bench_sandboxes import Stack  # noqa: E402

MiB = 1 << 20


def _feed(h: "hashlib._Hash", sizes: list[int], text: str) -> None:
    data = text.encode()
    h.update(data)
    sizes.append(len(data))


async def run(args: argparse.Namespace) -> None:
    stack = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=4, memory_mb=256, disk_mb=4 * args.mib + 256, cpu=1.0))
    await stack.start()
    try:
        sb = await stack.create()
        size = args.mib * MiB
        raw = size * 3 // 4
        digest = (await sb.commands.run(f"head -c {raw} /dev/urandom | base64 -w 0 > /tmp/o.b64 && sha256sum /tmp/o.b64", timeout=120)).stdout.split()[0]
        streamed, capped, writes, reads = [], [], [], []
        for _ in range(args.runs):
            h, sizes = hashlib.sha256(), []
            t0 = time.perf_counter()
            res = await sb.commands.run("cat /tmp/o.b64", on_stdout=functools.partial(_feed, h, sizes), timeout=600)
            streamed.append(time.perf_counter() - t0)
            assert sum(sizes) == size and h.hexdigest() == digest and res.stdout_bytes == size, (sum(sizes), res.stdout_bytes)
            t0 = time.perf_counter()
            res = await sb.commands.run("cat /tmp/o.b64", timeout=600)
            capped.append(time.perf_counter() - t0)
            assert res.stdout_bytes == size and res.stdout_truncated
            data = os.urandom(size)
            t0 = time.perf_counter()
            await sb.files.write("/tmp/f.bin", data)
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            back = await sb.files.read("/tmp/f.bin", format="bytes")
            reads.append(time.perf_counter() - t0)
            assert back == data
        rtt = []
        for _ in range(50):
            t0 = time.perf_counter()
            await sb.commands.run("true")
            rtt.append((time.perf_counter() - t0) * 1000)
        bg = []
        for _ in range(20):
            t0 = time.perf_counter()
            hd = await sb.commands.run("true", background=True)
            await hd.wait(timeout=30)
            bg.append((time.perf_counter() - t0) * 1000)
        await sb.kill()

        def line(label: str, xs: list[float]) -> None:
            med = statistics.median(xs)
            print(f"  {label:44} median {med:6.2f} s  {args.mib / med:7.1f} MiB/s   (runs: {', '.join(f'{x:.2f}' for x in xs)})")

        print(f"exec output and files, {args.mib} MiB, {args.runs} runs (load average {os.getloadavg()[0]:.1f}):")
        line("stdout streamed to on_stdout (checksummed)", streamed)
        line("stdout, capped result only", capped)
        line("files.write", writes)
        line("files.read", reads)
        print(f"  commands.run('true')                          p50 {statistics.median(rtt):6.2f} ms  p99 {sorted(rtt)[int(len(rtt) * 0.99) - 1]:6.2f} ms")
        print(f"  background start + wait of 'true'             p50 {statistics.median(bg):6.2f} ms")
    finally:
        await stop_stack(stack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--runs", type=int, default=3)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
