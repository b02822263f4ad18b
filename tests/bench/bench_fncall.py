"""Benchmark of FnCall (a script, not a test):

    python tests/bench/bench_fncall.py [-n 50] [--per-caller 2] [--pool 8] [--long 120] [--spin 2]

Starts, in this process, nats-server, a host agent (container backend) with fn pools ``base`` and,
when the Debian rootfs with python3 and g++ is cached (tests/integration/test_fncall.py builds it),
``python``, and the HTTP gateway; then measures:

* ``FnCall.run("true")`` and ``run_code("print(1)")``, ordinary and trusted: p50 / p99 of the hot
  path (a member is ready: the call is the NATS round trip, the file writes and the exec; for
  Python, the run on the interpreter started in the member after its last reset), sequential; the
  same through ``POST /run_code`` (which runs trusted, as a grader's run);
* calls/s with 16, 64 and 256 concurrent callers (``--per-caller`` calls each), ``true`` and
  ``print(1)``, through the SDK and through ``POST /run_code``: a member is reset between calls (its
  processes killed, its writable paths and IPC objects put back, a Python interpreter started
  again), so this is bounded by the calls themselves and the resets;
* the reset between calls (off the hot path: the helper's part, starting the interpreter), and a
  member's start and destroy (only for members replaced: at start, after a timeout or an
  out-of-memory, and every ``MAX_USES`` calls);
* ``--long S``: 256 callers for S seconds of ``POST /run_code`` python ``print(1)`` (run_timeout 10 s):
  calls/s, p50/p99 and the count of each status (``ok``, ``TimeLimitExceeded``, ``503 SandboxError
  no_capacity``...), and how late this process's event loop ran meanwhile.

Every throughput line counts each status, so a ``TimeLimitExceeded`` shows as such, not as a pass.

Everything it starts is stopped and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bus.natsd import NatsServer, free_port  # noqa: E402 - after the repo is on sys.path
from tests.busy import BusyNeighbours  # noqa: E402
from tests.netclaim import claim_net  # noqa: E402

KEY = "dsec_bench.secret"  # the bench's NATS runs without authentication: any well-formed key connects


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


def line(label: str, xs: list[float]) -> str:
    return f"{label:<44} p50 {pct(xs, 50):8.1f} ms   p99 {pct(xs, 99):8.1f} ms   (n={len(xs)})"


async def wait_idle(pool: Any, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not pool.idle:
        if time.monotonic() > deadline:
            raise SystemExit(f"no idle member of {pool.template} within {timeout}s")
        await asyncio.sleep(0.005)  # poll interval: the measurement starts once a member is ready


async def hot_path(label: str, pool: Any, call: Any, n: int, fc: Any = None) -> None:
    """``n`` sequential calls, each once a member is idle; ``fc``: also how many a started Python
    interpreter served (the first calls of a new shape teach the pool: they are warm-up, not counted)."""
    for _ in range(3 if fc is not None else 0):
        await wait_idle(pool)
        await call()
    xs = []
    z0 = fc.zygote_calls if fc is not None else 0
    for _ in range(n):
        await wait_idle(pool)
        await asyncio.sleep(0.01)  # (the previous call's reset and interpreter start run meanwhile, as between real calls)
        t0 = time.perf_counter()
        r = await call()
        xs.append((time.perf_counter() - t0) * 1000)
        if isinstance(r, str) and r != "ok":
            raise SystemExit(f"{label}: {r}")
    print(line(label, xs) + (f"   on a started interpreter: {fc.zygote_calls - z0}/{n}" if fc is not None else ""))


async def throughput(label: str, call: Any, callers: int, per_caller: int, until: float = 0.0) -> None:
    """``callers`` concurrent callers, ``per_caller`` calls each (or, with ``until``, calls until that
    monotonic time): calls/s, p50/p99 of a call, and how many answered each status (``call`` returns
    it: ``ok``, ``TimeLimitExceeded``, ``no_capacity``...; an exception counts as its type)."""
    statuses: dict[str, int] = {}
    xs: list[float] = []
    first: dict[str, str] = {}

    async def one() -> None:
        n = 0
        while (time.monotonic() < until) if until else n < per_caller:
            n += 1
            t0 = time.perf_counter()
            try:
                st = await call()
            except Exception as exc:  # noqa: BLE001 - counted and shown
                st = type(exc).__name__
                first.setdefault(st, f"{exc}"[:200])
            xs.append((time.perf_counter() - t0) * 1000)
            statuses[st] = statuses.get(st, 0) + 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(callers)))
    dt = time.perf_counter() - t0
    n = len(xs)
    counts = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items(), key=lambda kv: -kv[1]))
    print(f"{label:<44} {n / dt:8.1f} calls/s   p50 {pct(xs, 50):7.1f} ms   p99 {pct(xs, 99):8.1f} ms   ({n} calls in {dt:.1f}s: {counts})")
    for k, v in first.items():
        print(f"{'':<44} first {k}: {v}")


class LoopLag:
    """How late this process's event loop (host agent, gateway and callers alike) runs a timer: a
    blocked loop shows here."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.lag_ms: list[float] = []
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.period_s)
            self.lag_ms.append((time.perf_counter() - t0 - self.period_s) * 1000)

    def __enter__(self) -> "LoopLag":
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._task is not None:
            self._task.cancel()


def status_of(r: Any) -> str:
    """A ``CommandResult``'s status as /run_code would name it."""
    if r.error and "timed out" in r.error:
        return "TimeLimitExceeded"
    if r.error:
        return "Error"
    return "ok" if r.exit_code == 0 else f"exit {r.exit_code}"


async def measure(args: argparse.Namespace, fc: Any, c: Any, ct: Any, url: str, python: bool) -> None:
    """The figures (see the top); ``c`` calls ordinary, ``ct`` trusted, ``url`` is ``/run_code``'s."""
    import aiohttp

    print(f"load average at start: {os.getloadavg()[0]:.2f}")

    async def trusted(cmd: str, template: str = "base") -> None:
        req = ct._request(cmd, None, None, 30, 0, b"", None)
        req.trusted = True
        r = await ct.call(template, req)
        assert r.run is not None and r.run.exit_code == 0, r

    async def trusted_code(code: str) -> None:
        template, req = ct.code_request(code, "python", None, None, 30)
        req.trusted = True
        r = await ct.call(template, req)
        assert r.run is not None and r.run.stdout == b"1\n", r

    await hot_path("FnCall.run('true')", fc.pools["base"], lambda: c.run("true"), args.n)
    await hot_path("FnCall.run('true') trusted", fc.pools["base"], lambda: trusted("true"), args.n)
    if python:
        await hot_path("FnCall.run_code('print(1)')", fc.pools["python"], lambda: c.run_code("print(1)"), args.n, fc)
        await hot_path("FnCall.run_code('print(1)') trusted", fc.pools["python"], lambda: trusted_code("print(1)"), args.n, fc)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:  # (256 callers: 256 connections)
        async def post(code: str, language: str) -> str:
            async with http.post(url, json={"code": code, "language": language, "run_timeout": 10},
                                 timeout=aiohttp.ClientTimeout(total=600)) as r:
                body = await r.json()
            run = body.get("run_result") or {}
            if r.status == 200 and body["status"] == "Success":
                return "ok"
            if run.get("status") in ("TimeLimitExceeded", "Error"):
                return str(run["status"])
            return f"{r.status} {body.get('status')} {body.get('code', '')}".strip()

        async def sdk_code(code: str) -> str:
            from sdk import NoCapacity

            try:
                return status_of(await c.run_code(code, timeout=10))
            except NoCapacity:
                return "no_capacity"

        async def sdk_run(cmd: str) -> str:
            return status_of(await c.run(cmd))

        await hot_path("POST /run_code sh 'true'", fc.pools["base"], lambda: post("true", "sh"), args.n)
        if python:
            await hot_path("POST /run_code python print(1)", fc.pools["python"], lambda: post("print(1)", "python"), args.n, fc)
        for callers in args.callers:
            await throughput(f"FnCall.run('true') x{callers} callers", lambda: sdk_run("true"), callers, args.per_caller)
            await throughput(f"POST /run_code sh x{callers} callers", lambda: post("true", "sh"), callers, args.per_caller)
        if python:
            for callers in args.callers:
                z0 = fc.zygote_calls
                await throughput(f"FnCall.run_code('print(1)') x{callers} callers", lambda: sdk_code("print(1)"), callers, args.per_caller)
                await throughput(f"POST /run_code python x{callers} callers", lambda: post("print(1)", "python"), callers, args.per_caller)
                print(f"{'  on a started interpreter':<44} {fc.zygote_calls - z0}/{2 * callers * args.per_caller}")
        if args.long:
            code, lang = ("print(1)", "python") if python else ("true", "sh")
            print(f"long run: 256 callers of POST /run_code {lang} {code!r} for {args.long:g}s, load average {os.getloadavg()[0]:.2f}")
            z0 = fc.zygote_calls
            with LoopLag() as lag:
                await throughput(f"POST /run_code x256 for {args.long:g}s", lambda: post(code, lang), 256, 0,
                                 until=time.monotonic() + args.long)
            print(f"{'  on a started interpreter':<44} {fc.zygote_calls - z0}")
            print(line("  event loop lag (this process)", lag.lag_ms) + f"   max {max(lag.lag_ms, default=0):.0f} ms")
            print(f"load average after the long run: {os.getloadavg()[0]:.2f}")


async def main(args: argparse.Namespace) -> None:
    from aiohttp import web

    import sdk._async
    from bus import connect, ensure_all
    from hostagent import HostAgent, HostAgentConfig
    from hostagent.backends.container import ContainerBackend
    from imaged._busybox import build_busybox_rootfs
    from sdk import AsyncFnCall
    from sdk.gateway._app import make_app
    from sdk.gateway._config import GatewayConfig
    from tests.integration.test_fncall import _register, debian_rootfs

    uid = uuid.uuid4().hex[:8]
    data = Path(tempfile.mkdtemp(prefix=f"dsec-fnbench-{uid}-", dir="/tmp"))
    nats = NatsServer(str(data / "nats"), port=free_port())
    nats.start()
    net = claim_net()
    host = None
    runner = None
    try:
        nc = await connect(nats.url, name="bench")
        await ensure_all(nc.jetstream())
        await asyncio.to_thread(build_busybox_rootfs, str(data / "rootfs"))
        await _register(nc.jetstream(), "base", str(data / "rootfs"), {})
        debian = await debian_rootfs()
        pools = f"base={args.pool}"
        if debian is not None:
            await _register(nc.jetstream(), "python", str(debian), {})
            pools += f",python={args.pool}"
        await nc.close()
        backend = ContainerBackend(str(data), scratch_size_gb=64, warm_pool=0, network=net.config())
        host = HostAgent(backend, HostAgentConfig(nats_url=nats.url, host_id=f"bench-{uid}", data_dir=str(data), pool=f"bench-{uid}",
                                                  destroy_on_shutdown=True, fn_pools=pools))
        await host.start()
        fc = host.fncalls
        for p in fc.pools.values():
            await wait_idle(p)
        port = free_port()
        runner = web.AppRunner(make_app(GatewayConfig(nats_url=nats.url, http_port=port), extensions=[]))
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        url = f"http://127.0.0.1:{port}/k/{KEY}/run_code"
        c = AsyncFnCall(nats_url=nats.url, queue_timeout=290)
        print(f"pools: {pools}   (python: {'yes' if debian else 'no: the Debian rootfs is not cached'})")

        with BusyNeighbours(args.spin, uid):
            if args.spin:
                print(f"{args.spin} busy loops in a cgroup beside the sandboxes' (not idle, 1024 shares)")
            await measure(args, fc, c, AsyncFnCall(nats_url=nats.url, queue_timeout=290), url, debian is not None)
        starts, destroys, resets = list(fc.start_ms), list(fc.destroy_ms), list(fc.reset_ms)
        print(line("reset between calls (off the hot path)", resets))
        helpers = getattr(backend, "fnreset", None)
        if helpers is not None:
            print(line("  of which: waiting for a reset helper", list(helpers.wait_ms)))
            print(line("  of which: the helper's work (files, IPC)", list(helpers.work_ms)))
        print(line("Python interpreter start (after a reset, until loaded)", list(fc.zygote_ms)))
        print(line("member start (off the hot path)", starts))
        print(line("member destroy (off the hot path)", destroys))
        served = sum(p.served for p in fc.pools.values())
        print(f"{'calls served / members started':<44} {served} / {len(starts)}")
        print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    finally:
        if runner is not None:
            await runner.cleanup()
        await sdk._async.close_connections()
        if host is not None:
            await host.shutdown()
        nats.stop()
        await net.purge()
        net.release()
        shutil.rmtree(data, ignore_errors=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=50, help="sequential calls per hot-path figure")
    ap.add_argument("--per-caller", type=int, default=2, help="calls per caller in the throughput runs")
    ap.add_argument("--pool", type=int, default=8, help="members per fn pool")
    ap.add_argument("--callers", type=lambda v: [int(x) for x in v.split(",") if x], default=[16, 64, 256],
                    help="concurrent callers of the throughput runs, comma-separated ('': none)")
    ap.add_argument("--long", type=float, default=0.0, help="seconds of 256 callers through /run_code (0: skip)")
    ap.add_argument("--spin", type=int, default=0, help="busy loops beside the sandboxes (other tenants' busy sandboxes)")
    asyncio.run(main(ap.parse_args()))
