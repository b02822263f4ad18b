"""Many simulated hosts in one process, on one NATS connection: for control-plane scale runs only.

Each simulated host is the real ``HostAgent`` (admission, claim, record, events, ops, reaping) with
the ``SimBackend``; only how its durable consumer is pulled differs. A fetch loop per host would send
one pull request per host every second even when idle (1,600 hosts: 1,600 requests/s for nothing);
here every host keeps long-lived pull requests (``expires`` 30 s) for exactly its free slots, and all
of them answer on one inbox subscription that dispatches by host. Idle cost: one request per host per
30 s; busy cost: one request per half a host's concurrency of creates.

Knobs for scale runs come from the environment (the CLI flags of ``python -m hostagent`` stay the
same for real hosts): ``DSEC_SIM_CPU``, ``DSEC_SIM_MEM_MB``, ``DSEC_SIM_DISK_MB`` (host size),
``DSEC_SIM_RESIDENT`` (share of requested memory a sandbox really holds), ``DSEC_SIM_HEARTBEAT_S``,
``DSEC_SIM_STORAGE`` (``file`` or ``memory``: storage of the streams this process creates).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import signal
import time
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import StorageType

from bus.runtime import PullWorker, connect
from bus.subjects import host_durable
from bus.streams import StreamOptions, ensure_all

from ._backend import SimBackend
from ._service import HostAgent

log = structlog.get_logger("dsec.hostagent.sim")

PULL_EXPIRES_S = 30.0


class _InboxMux:
    """One subscription for the pull-request replies of every simulated host in this process."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc
        self.prefix = nc.new_inbox()
        self.pullers: dict[str, "SimPuller"] = {}
        self._sub: Any = None
        self._watchdog: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(self.prefix + ".*", cb=self._on_msg, pending_msgs_limit=1_000_000, pending_bytes_limit=1024**3)
        self._watchdog = asyncio.create_task(self._watch())

    def inbox(self, token: str) -> str:
        return f"{self.prefix}.{token}"

    async def _on_msg(self, msg: Msg) -> None:
        subj = msg.subject
        # A status answer to a pull request is addressed to the puller's inbox; a delivered message
        # keeps its own subject: dsec.host.<host>.<kind>.
        key = subj[len(self.prefix) + 1:] if subj.startswith(self.prefix) else host_durable(subj.split(".", 3)[2])
        p = self.pullers.get(key)
        if p is not None:
            p.on_msg(msg)

    async def _watch(self) -> None:
        """Re-ask for pullers whose requests vanished unanswered (a reconnect, a server restart)."""
        while True:
            await asyncio.sleep(2.0)  # watchdog period
            now = time.monotonic()
            for p in list(self.pullers.values()):
                if p.credits and now - p.last_pull > PULL_EXPIRES_S + 5.0:
                    p.credits = 0
                    p.maybe_pull()

    async def stop(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # noqa: BLE001
                pass


class SimPuller:
    """A host's durable pull consumer with the ``PullWorker`` surface, pulled through the shared inbox."""

    def __init__(self, mux: _InboxMux, js: JetStreamContext, **kwargs: Any) -> None:
        self.mux = mux
        self.js = js
        self._cfg_worker = PullWorker(js, **kwargs)  # the very consumer config a real host uses
        self.stream = kwargs["stream"]
        self.durable = kwargs["durable"]
        self.handler = kwargs["handler"]
        self.capacity = max(1, kwargs["capacity"])
        self.name = kwargs.get("name", self.durable)
        self.inflight = 0
        self.credits = 0
        self.last_pull = 0.0
        self.min_pull = max(1, self.capacity // 2)
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._next = f"$JS.API.CONSUMER.MSG.NEXT.{self.stream}.{self.durable}"
        self._inbox = mux.inbox(self.durable)

    async def start(self) -> None:
        await self.js.add_consumer(self.stream, self._cfg_worker.consumer_config())
        self.mux.pullers[self.durable] = self
        self.maybe_pull()

    def maybe_pull(self) -> None:
        if self._stopping:
            return
        free = self.capacity - self.inflight - self.credits
        if free <= 0 or (free < self.min_pull and self.credits > 0):
            return
        self.credits += free
        self.last_pull = time.monotonic()
        req = json.dumps({"batch": free, "expires": int(PULL_EXPIRES_S * 1e9)}).encode()
        self._spawn(self.mux.nc.publish(self._next, req, reply=self._inbox))

    def _spawn(self, coro: Any) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    def on_msg(self, msg: Msg) -> None:
        hdrs = msg.headers
        if hdrs and not msg.data and "Status" in hdrs:
            if hdrs.get("Status") == "100":
                return
            pending = hdrs.get("Nats-Pending-Messages")
            self.credits = max(0, self.credits - int(pending)) if pending is not None else 0
            self.maybe_pull()
            return
        if self.credits:
            self.credits -= 1
        self.inflight += 1
        self._spawn(self._run(msg))

    async def _run(self, msg: Msg) -> None:
        try:
            await self.handler(msg)
        except Exception as exc:  # noqa: BLE001 - leave un-acked: JetStream redelivers
            log.exception("handler_failed", worker=self.name, error=str(exc))
        finally:
            self.inflight -= 1
            self.maybe_pull()

    async def stop_intake(self) -> None:
        self._stopping = True
        self.mux.pullers.pop(self.durable, None)

    async def finish(self, grace_s: float) -> None:
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)


class SimHostAgent(HostAgent):
    """The real host agent; its consumer is pulled through the process-wide inbox."""

    def __init__(self, *args: Any, mux: _InboxMux, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mux = mux

    async def add_worker(self, **kwargs: Any) -> Any:
        assert self.js is not None
        w = SimPuller(self._mux, self.js, **kwargs)
        await w.start()
        self.workers.append(w)  # type: ignore[arg-type]
        return w


def _env_float(name: str, default: float) -> float:
    v = os.environ.get(name)
    return float(v) if v else default


def sim_backend_from_env() -> SimBackend:
    return SimBackend(
        cpu_total=_env_float("DSEC_SIM_CPU", 64.0),
        mem_total_mb=int(_env_float("DSEC_SIM_MEM_MB", 1024 * 1024)),
        disk_total_mb=int(_env_float("DSEC_SIM_DISK_MB", 16 * 1024 * 1024)),
        resident_fraction=_env_float("DSEC_SIM_RESIDENT", 0.25),
    )


async def run_sim_hosts(args: argparse.Namespace) -> None:
    # Thousands of hosts holding hundreds of thousands of sandboxes make a large, long-lived heap: the
    # default cyclic-GC thresholds would rescan it ever more often as the burst goes on.
    gc.set_threshold(200_000, 50, 100)
    nc = await connect(args.nats_url, name="dsec-sim-hosts", pending_size=64 * 1024 * 1024)
    js = nc.jetstream()
    storage = StorageType.MEMORY if os.environ.get("DSEC_SIM_STORAGE", "file") == "memory" else StorageType.FILE
    mem = storage == StorageType.MEMORY  # memory streams share the server's memory store (1 GB embedded)
    await ensure_all(js, StreamOptions(storage=storage, events_max_bytes=512 * 1024**2 if mem else StreamOptions().events_max_bytes))  # once for all hosts here
    heartbeat_s = _env_float("DSEC_SIM_HEARTBEAT_S", 2.0 if args.sim_hosts <= 400 else 5.0)
    mux = _InboxMux(nc)
    await mux.start()
    prefix = args.host_id or "sim"
    first = int(os.environ.get("DSEC_SIM_FIRST", "0"))
    agents = [
        SimHostAgent(
            sim_backend_from_env(), nats_url=args.nats_url, host_id=f"{prefix}-{first + i}", data_dir=args.data_dir,
            concurrency=args.concurrency, pool=args.pool, cpu_overcommit=args.cpu_overcommit,
            mem_overcommit=args.mem_overcommit, max_sandboxes=args.max_sandboxes, persist_state=False, connection=nc,
            heartbeat_s=heartbeat_s, mux=mux,
        )
        for i in range(args.sim_hosts)
    ]
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for s in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(s, stop.set)
    t0 = time.monotonic()
    gate = asyncio.Semaphore(64)

    async def start(a: SimHostAgent) -> None:
        async with gate:
            await a.start()

    await asyncio.gather(*(start(a) for a in agents))
    gc.freeze()  # what start-up built lives as long as the process: keep it out of collections
    log.info("sim_hosts_started", hosts=len(agents), seconds=round(time.monotonic() - t0, 2))
    await stop.wait()
    await asyncio.gather(*(a.shutdown() for a in agents), return_exceptions=True)
    await mux.stop()
    await nc.drain()
