"""Many simulated hosts in one process, on one NATS connection: for control-plane scale runs only.

Each simulated host is the real ``HostAgent`` (hand-off inbox, admission, claim, record, events,
ops, reaping) with the ``SimBackend``, all on one connection; a host costs one subscription for its
hand-offs and nothing else while idle but its heartbeat and reaper tick.

Knobs for scale runs come from the environment (the CLI flags of ``python -m hostagent`` stay the
same for real hosts): ``DSEC_SIM_CPU``, ``DSEC_SIM_MEM_MB``, ``DSEC_SIM_DISK_MB`` (host size),
``DSEC_SIM_RESIDENT`` (share of requested memory a sandbox really holds), ``DSEC_SIM_HEARTBEAT_S``,
``DSEC_SIM_STORAGE`` (``file`` or ``memory``: storage of the streams this process creates).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time

import structlog
from nats.js.api import StorageType

from bus.runtime import connect
from bus.streams import StreamOptions, ensure_all

from ..._config import HostAgentConfig
from ..._service import HostAgent
from . import _env_float, from_config

log = structlog.get_logger("dsec.hostagent.sim")


async def run_sim_hosts(config: HostAgentConfig, host_id_prefix: str = "") -> None:
    # Thousands of hosts holding hundreds of thousands of sandboxes make a large, long-lived heap: the
    # default cyclic-GC thresholds would rescan it ever more often as the burst goes on.
    gc.set_threshold(200_000, 50, 100)
    nc = await connect(config.nats_url, name="dsec-sim-hosts", pending_size=64 * 1024 * 1024)
    js = nc.jetstream()
    storage = StorageType.MEMORY if os.environ.get("DSEC_SIM_STORAGE", "file") == "memory" else StorageType.FILE
    mem = storage == StorageType.MEMORY  # memory streams share the server's memory store (1 GB embedded)
    await ensure_all(js, StreamOptions(storage=storage, events_max_bytes=512 * 1024**2 if mem else StreamOptions().events_max_bytes))  # once for all hosts here
    heartbeat_s = _env_float("DSEC_SIM_HEARTBEAT_S", max(2.0, config.sim_hosts / 320.0))
    prefix = host_id_prefix or "sim"
    first = int(os.environ.get("DSEC_SIM_FIRST", "0"))
    each = config.replace(persist_state=False, heartbeat_s=heartbeat_s)
    agents = [
        HostAgent(from_config(each), each.replace(host_id=f"{prefix}-{first + i}"), connection=nc)
        for i in range(config.sim_hosts)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    t0 = time.monotonic()
    gate = asyncio.Semaphore(64)

    async def start(a: HostAgent) -> None:
        async with gate:
            await a.start()

    await asyncio.gather(*(start(a) for a in agents))
    gc.freeze()  # what start-up built lives as long as the process: keep it out of collections
    log.info("sim_hosts_started", hosts=len(agents), seconds=round(time.monotonic() - t0, 2))
    await stop.wait()
    await asyncio.gather(*(a.shutdown() for a in agents), return_exceptions=True)
    await nc.drain()
