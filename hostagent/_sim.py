"""Many simulated hosts in one process, on one NATS connection: for control-plane scale runs only."""

from __future__ import annotations

import argparse
import asyncio
import signal

from bus.runtime import connect

from ._backend import SimBackend
from ._service import HostAgent


async def run_sim_hosts(args: argparse.Namespace) -> None:
    nc = await connect(args.nats_url, name="dsec-sim-hosts")
    prefix = args.host_id or "sim"
    agents = [
        HostAgent(
            SimBackend(), nats_url=args.nats_url, host_id=f"{prefix}-{i}", data_dir=args.data_dir,
            concurrency=args.concurrency, pool=args.pool, cpu_overcommit=args.cpu_overcommit,
            mem_overcommit=args.mem_overcommit, max_sandboxes=args.max_sandboxes, persist_state=False, connection=nc,
        )
        for i in range(args.sim_hosts)
    ]
    for a in agents:
        await a.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    await stop.wait()
    for a in agents:
        await a.shutdown()
    await nc.drain()
