#!/usr/bin/env python3
"""Benchmark of sandbox networks alone (root; real netns, veths, routes, nft elements; no containers).

What a host agent's network manager costs on the create path (``setup``: a warm-pool hit, or a network
made inline), what making one costs (netns + veth + addresses + routes + nft elements), and teardown:
N networks with an allowlist, without a warm pool (back to back, everything inline) and with one
(creates ``--gap-ms`` apart, what the rest of a create takes at best). The target is p50 < 10 ms on the
create path and for teardown with the warm pool; it is printed, not asserted.

    python tests/bench/bench_network.py [--n 100] [--gap-ms 20] [--warm-pool 8] [--json]

Each run claims its own network names (tests/netclaim.py) and removes everything it made.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bus.messages import NetworkSpec  # noqa: E402
from hostagent.network import NetworkManager  # noqa: E402
from tests.netclaim import claim_net  # noqa: E402

ALLOW = ["198.18.0.2/32", "198.51.100.0/24:443", "203.0.113.9"]  # never contacted: only rules are made


def pct(v: list[float], p: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(p * len(v)))] if v else float("nan")


async def run_one(n: int, warm_pool: int, gap_s: float) -> dict[str, list[float]]:
    claim = claim_net()
    try:
        m = NetworkManager(claim.config(warm_pool=warm_pool))
        await m.start()
        try:
            ids = [f"bench-{i}" for i in range(n)]
            for sid in ids:
                if gap_s:
                    await asyncio.sleep(gap_s)  # the rest of a create, during which the pool refills
                await m.setup(sid, NetworkSpec(allow_out=ALLOW))
            for sid in ids:
                await m.teardown(sid)
            return {k: list(v) for k, v in m.stats.items()}
        finally:
            await m.purge()
            await m.stop()
            deadline = time.monotonic() + 15
            while claim.in_kernel() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)  # the kernel frees a netns (and its veth) asynchronously
    finally:
        claim.release()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100, help="networks per run")
    ap.add_argument("--gap-ms", type=float, default=20.0, help="time between creates with the warm pool")
    ap.add_argument("--warm-pool", type=int, default=8)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("needs root (netns, veths, nftables)")
    runs = [
        (f"no warm pool, {args.n} back to back", 0, 0.0),
        (f"warm pool {args.warm_pool}, {args.n} creates {args.gap_ms:g} ms apart", args.warm_pool, args.gap_ms / 1000),
    ]
    out = {}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    for label, pool, gap in runs:
        st = asyncio.run(run_one(args.n, pool, gap))
        su, mk, td = st["setup_ms"], st["make_ms"], st["teardown_ms"]
        row = {
            "create_path_p50_ms": pct(su, 0.5), "create_path_p90_ms": pct(su, 0.9),
            "make_p50_ms": pct(mk, 0.5), "make_p90_ms": pct(mk, 0.9),
            "teardown_p50_ms": pct(td, 0.5), "teardown_p90_ms": pct(td, 0.9),
            "pool_hits": len(st["pool_hits"]), "pool_misses": len(st["pool_misses"]),
        }
        out[label] = row
        print(f"{label}: create path p50 {row['create_path_p50_ms']:.2f} / p90 {row['create_path_p90_ms']:.2f} ms "
              f"(pool hits {row['pool_hits']}, misses {row['pool_misses']}); making one network p50 {row['make_p50_ms']:.2f} / "
              f"p90 {row['make_p90_ms']:.2f} ms; teardown p50 {row['teardown_p50_ms']:.2f} / p90 {row['teardown_p90_ms']:.2f} ms")
    pooled = out[runs[1][0]]
    ok = pooled["create_path_p50_ms"] < 10.0 and pooled["teardown_p50_ms"] < 10.0
    print(f"target (warm pool: create path and teardown p50 < 10 ms): {'met' if ok else 'NOT met'}")
    if args.json:
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
