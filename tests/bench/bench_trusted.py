"""Benchmark: what a trusted run (``commands.run(cmd, trusted=True)``) costs over an ordinary one
(a script, not a test).

    python tests/bench/bench_trusted.py [--runs 200]

On a fresh stack in this process (see bench_sandboxes.Stack), one busybox sandbox; ordinary and
trusted runs alternate (so drift in the machine's load hits both alike) for ``true`` and for a
command that uses its HOME (``ls -a $HOME``). The extra work of a trusted run is the agent's: the
read-only check of the system directories (statvfs each), the private HOME (mkdtemp, then its
removal) and the environment it builds. Prints p50 / p90 of each and the p50 difference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import stop_stack  # noqa: E402
from bench_sandboxes import Stack  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(len(s) * q))]


async def run(args: argparse.Namespace) -> None:
    stack = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=4, memory_mb=128, disk_mb=256, cpu=1.0,
                                     cpu_overcommit=4.0, reconcile_s=60.0))
    await stack.start()
    try:
        sb = await stack.create()
        for _ in range(10):  # warm: connections, the agent's page cache
            await sb.commands.run("true")
            await sb.commands.run("true", trusted=True)
        print(f"trusted vs ordinary runs, {args.runs} each, alternating (load average {os.getloadavg()[0]:.1f}):")
        for cmd in ("true", "ls -a $HOME"):
            times: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.runs):
                for trusted in (False, True):
                    t0 = time.perf_counter()
                    await sb.commands.run(cmd, trusted=trusted)
                    times[trusted].append((time.perf_counter() - t0) * 1000)
            o, t = times[False], times[True]
            print(f"  {cmd!r:16} ordinary p50 {statistics.median(o):6.2f} ms p90 {pct(o, 0.9):6.2f} ms | "
                  f"trusted p50 {statistics.median(t):6.2f} ms p90 {pct(t, 0.9):6.2f} ms | "
                  f"overhead p50 {statistics.median(t) - statistics.median(o):+6.2f} ms")
        await sb.kill()
    finally:
        await stop_stack(stack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=200)
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
