"""Benchmark of the HTTP gateway: the e2b SDK through it, beside dsec's own SDK, in one run (a script, not a test).

    python tests/bench/bench_gateway.py [-n 10] [--exec-n 200] [--file-mb 10]

Starts ``dsec up`` (authentication on, the gateway included) in a temp data dir, issues an API key,
and measures with the unmodified e2b SDK (HTTP to the gateway, which speaks NATS to the sandboxes)
and with dsec's SDK (NATS directly), one after the other on the same stack:

* create latency (p50, sequential);
* ``commands.run("true")`` round trip (p50 / p99);
* ``files.write`` / ``files.read`` of a file of ``--file-mb`` MiB (median of 3, and MiB/s).

Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bus.natsd import free_port  # noqa: E402 - after the repo is on sys.path
from tests.netclaim import claim_net  # noqa: E402

MiB = 1 << 20


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))] if s else float("nan")


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def wait_for(cond: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)  # poll interval


def measure(label: str, create: Callable[[], Any], kill: Callable[[Any], None], run: Callable[[Any], None],
            write: Callable[[Any, bytes], None], read: Callable[[Any], bytes], args: argparse.Namespace) -> dict[str, float]:
    creates = []
    for _ in range(args.n):
        t0 = time.perf_counter()
        sb = create()
        creates.append((time.perf_counter() - t0) * 1000)
        kill(sb)
    sb = create()
    try:
        for _ in range(10):
            run(sb)  # warm up connections
        execs = [timed(lambda: run(sb)) for _ in range(args.exec_n)]
        blob = os.urandom(args.file_mb * MiB)
        writes, reads = [], []
        got: list[bytes] = []
        for _ in range(3):
            writes.append(timed(lambda: write(sb, blob)))
            reads.append(timed(lambda: got.append(read(sb))))
            assert got[-1] == blob, f"{label}: read back {len(got[-1])} bytes, not what was written"
    finally:
        kill(sb)
    w, r = statistics.median(writes), statistics.median(reads)
    return {"create_p50_ms": pct(creates, 50), "exec_p50_ms": pct(execs, 50), "exec_p99_ms": pct(execs, 99),
            "write_ms": w, "read_ms": r, "write_mibs": args.file_mb / (w / 1000), "read_mibs": args.file_mb / (r / 1000)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=10, help="sequential creates per SDK")
    ap.add_argument("--exec-n", type=int, default=200)
    ap.add_argument("--file-mb", type=int, default=10)
    args = ap.parse_args()

    data = Path(tempfile.mkdtemp(prefix="dsec-bench-gw-", dir="/tmp"))
    port, http_port = free_port(), free_port()
    nats_url, gw = f"nats://127.0.0.1:{port}", f"http://127.0.0.1:{http_port}"
    context = data.parent / f"{data.name}.context.json"  # not the machine's default pointer
    net = claim_net()  # network names of its own: not the default ones other stacks on this machine share
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSEC_NATS_URL": nats_url, "PYTHONUNBUFFERED": "1", "DSEC_CONTEXT": str(context), **net.env()}
    log = open(data.parent / f"{data.name}.log", "wb")  # noqa: SIM115 - the child's log, closed in the finally
    up = subprocess.Popen([sys.executable, "-m", "sdk.cli", "up", "--data-dir", str(data), "--port", str(port), "--http-port", str(http_port),
                           "--host-id", f"bench-{data.name[-6:]}"], env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        logf = data.parent / f"{data.name}.log"
        wait_for(lambda: "dsec up: ready" in logf.read_text() or up.poll() is not None, 300, "dsec up")
        if up.poll() is not None:
            raise SystemExit(logf.read_text()[-3000:])
        key = subprocess.run([sys.executable, "-m", "sdk.cli", "api-key", "create", "--name", "bench", "--data-dir", str(data)],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()

        from e2b import Sandbox as E2B

        from bus.auth import with_credentials
        from sdk import Sandbox
        from sdk.gateway._keys import parse_key

        opts = {"api_key": key, "api_url": gw, "sandbox_url": gw}
        tenant_url = with_credentials(nats_url, *parse_key(key))  # the same key's tenant, straight on NATS
        results = {
            "e2b SDK -> gateway": measure(
                "e2b", lambda: E2B.create("base", timeout=300, **opts), lambda sb: sb.kill(), lambda sb: sb.commands.run("true"),
                lambda sb, b: sb.files.write("/tmp/blob", b), lambda sb: bytes(sb.files.read("/tmp/blob", format="bytes")), args),
            "dsec SDK -> NATS": measure(
                "dsec", lambda: Sandbox.create("base", timeout=300, memory_mb=512, nats_url=tenant_url), lambda sb: sb.kill(),
                lambda sb: sb.commands.run("true"), lambda sb, b: sb.files.write("/tmp/blob", b),
                lambda sb: sb.files.read("/tmp/blob", format="bytes"), args),
        }
        print(f"gateway benchmark: {args.n} creates, {args.exec_n} execs, {args.file_mb} MiB files (median of 3), one host, busybox base")
        print(f"{'':22} {'create p50':>11} {'run p50':>9} {'run p99':>9} {'write':>16} {'read':>16}")
        for name, r in results.items():
            print(f"{name:22} {r['create_p50_ms']:9.1f}ms {r['exec_p50_ms']:7.2f}ms {r['exec_p99_ms']:7.2f}ms "
                  f"{r['write_ms']:7.0f}ms {r['write_mibs']:5.0f}MiB/s {r['read_ms']:7.0f}ms {r['read_mibs']:5.0f}MiB/s")
    finally:
        if "sdk._sync" in sys.modules:  # the dsec SDK's connection goes before the stack does
            from sdk._async import close_connections
            from sdk._sync import _run

            _run(close_connections())
        up.send_signal(signal.SIGINT)
        try:
            up.wait(120)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
        log.close()
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)
        context.unlink(missing_ok=True)
        net.release()


if __name__ == "__main__":
    main()
