"""One client process of ``dsec bench create``: drives creates through the real SDK path.

Run by the benchmark as ``python -m sdk._benchclient '<json params>'``; it connects, warms up,
prints ``ready``, waits for the go message, runs its share of creates with a bounded number in flight,
then writes its latencies and requested ids to the result file and prints ``done``.
"""

from __future__ import annotations

import asyncio
import gc
import json
import sys
import time
import uuid
from typing import Any

from bus.runtime import connect
from sdk import AsyncSandbox, DsecError  # the benchmark measures the real client path
from sdk import _async as sdk_async
from sdk._async import close_connections


async def main(p: dict[str, Any]) -> None:
    url = p["nats_url"]
    sdk_async.COALESCE = bool(p.get("client_coalesce", True))
    kw = dict(
        backend="sim", cpu=p["cpu"], memory_mb=p["memory_mb"], disk_mb=p["disk_mb"], timeout=p["sandbox_timeout"],
        nats_url=url, create_timeout=p["create_timeout"],
    )
    prefix = f"b{p['client']}{uuid.uuid4().hex[:6]}"
    ctl = await connect(url, name="dsec-bench-ctl")
    go = asyncio.Event()

    async def on_go(_msg: object) -> None:
        go.set()

    await ctl.subscribe(p["go_subject"], cb=on_go)
    # warm-up (counted in lost/duplicated, not in the rate): the SDK connection and the code paths
    for i in range(p["warmup"]):
        await AsyncSandbox.create("base", sandbox_id=f"{prefix}w{i}", **kw)
    requested: list[str] = [f"{prefix}w{i}" for i in range(p["warmup"])]
    # a load generator: keep the cyclic GC from pausing the burst (it allocates a lot, frees it all)
    gc.collect()
    gc.freeze()
    gc.set_threshold(100_000, 50, 100)
    print("ready", flush=True)
    await go.wait()

    count, batch, window = p["count"], p["batch"], p["concurrency"]
    lat: list[float] = []
    errors: list[str] = []
    ids_all = [f"{prefix}-{i}" for i in range(count)]
    requested.extend(ids_all)
    units = [ids_all[i:i + batch] for i in range(0, count, batch)]
    sem = asyncio.Semaphore(max(1, window // batch) if batch > 1 else window)

    async def one(ids: list[str]) -> None:
        async with sem:
            t = time.perf_counter()
            try:
                if batch > 1:
                    await AsyncSandbox.create_batch(len(ids), "base", sandbox_ids=ids, **kw)
                else:
                    await AsyncSandbox.create("base", sandbox_id=ids[0], **kw)
            except DsecError as exc:
                errors.append(f"{exc.code}: {exc.description}"[:200])
                return
            ms = (time.perf_counter() - t) * 1000
            lat.extend([ms] * len(ids))

    t0 = time.time()
    await asyncio.gather(*(one(u) for u in units))
    t1 = time.time()
    with open(p["result_file"], "w") as f:
        json.dump({"client": p["client"], "start": t0, "end": t1, "latencies_ms": lat, "errors": errors, "requested": requested}, f)
    await close_connections()
    await ctl.close()
    print("done", flush=True)


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
