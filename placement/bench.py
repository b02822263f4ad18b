"""``dsec bench create``: burst-create sandboxes on simulated hosts, end to end, and count what got lost.

Self-contained: an embedded nats-server on a free port with a temporary store, placement replicas
(``python -m placement``) and simulated hosts (``python -m hostagent --backend sim``) as subprocesses,
a ``base`` template in KV, and client processes that create through the real SDK
(``AsyncSandbox.create`` / ``create_batch``). Afterwards ``lost`` and ``duplicated`` are counted from
the DSEC_EVT stream alone: every requested id must have exactly one ``ready`` event.
It imports no service: everything it measures runs in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType

from bus import codec
from bus import subjects as S
from bus.messages import LayerRef, ReadyMany, SandboxEvent, TemplateManifest
from bus.natsd import NatsCluster
from bus.runtime import connect, scrape_all
from bus.streams import REPLICAS_ENV, StreamOptions, ensure_all, ensure_kv


def register(subparsers: Any) -> None:
    b = subparsers.add_parser("bench", help="benchmarks of the control plane (simulated hosts)")
    bs = b.add_subparsers(dest="bench_cmd", required=True)
    c = bs.add_parser("create", help="burst-create sandboxes end to end on simulated hosts")
    add_create_args(c)
    c.set_defaults(func=lambda a: run_cli(a))


def add_create_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--sim-hosts", type=int, default=160)
    c.add_argument("--count", type=int, default=20000, help="sandboxes to create (after warm-up)")
    c.add_argument("--batch", type=int, default=1, help="1: single creates; B>1: create_batch(B)")
    c.add_argument("--replicas", type=int, default=1, help="placement replicas")
    c.add_argument("--cluster", type=int, default=1, choices=[1, 3, 5], help="nats-server nodes (3: a JetStream cluster on loopback)")
    c.add_argument("--stream-replicas", type=int, default=0, choices=[0, 1, 3, 5], help="copies of every stream and bucket (0: 3 on a cluster, else 1)")
    c.add_argument("--clients", type=int, default=2, help="client processes")
    c.add_argument("--concurrency", type=int, default=200, help="sandboxes in flight per client")
    c.add_argument("--sim-procs", type=int, default=0, help="processes the simulated hosts are spread over (0: auto)")
    c.add_argument("--host-concurrency", type=int, default=8, help="creates a host handles at once")
    c.add_argument("--placement-capacity", type=int, default=512)
    c.add_argument("--coalesce", type=int, default=0, help="placement's runs of single creates to one host (0: its default)")
    c.add_argument("--no-client-coalesce", action="store_true", help="each single create its own request message (the SDK's coalescing off)")
    c.add_argument("--storage", choices=["memory", "file"], default="file", help="JetStream storage of the streams (file: as production runs)")
    c.add_argument("--cpu", type=float, default=1.0)
    c.add_argument("--memory-mb", type=int, default=512)
    c.add_argument("--disk-mb", type=int, default=1024)
    c.add_argument("--mem-overcommit", type=float, default=4.0, help="hosts' memory overcommit (resident memory still admitted)")
    c.add_argument("--host-cpus", type=float, default=0, help="cores per simulated host (0: 64, or more when the count would not fit at 50x)")
    c.add_argument("--warmup", type=int, default=20, help="sequential creates per client before timing")
    c.add_argument("--create-timeout", type=float, default=120.0)
    c.add_argument("--keep", action="store_true", help="keep the temporary directory (logs)")
    c.add_argument("--json", action="store_true", help="print one JSON line")


def run_cli(args: argparse.Namespace) -> int:
    res = run(args)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:>20}: {v}")
    return 0 if res.get("ok") else 1


class _Proc:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path, *, pipe: bool = False) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                argv, env=env, stdout=subprocess.PIPE if pipe else log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace: float = 10.0) -> None:
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) a process used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


async def _placement_quantiles(nc: Any, metric: str = "dsec_placement_seconds") -> dict[float, float | None]:
    """p50 and p99 of the histogram ``metric`` over every placement replica, in ms, as the upper bound
    of the histogram bucket each falls in (None: no replica answered)."""
    cum: dict[float, float] = {}
    for r in await scrape_all(nc, timeout=5.0):
        if r.service != "placement":
            continue
        for line in r.text.splitlines():
            if line.startswith(f"{metric}_bucket{{"):
                le = line.split('le="', 1)[1].split('"', 1)[0]
                bound = math.inf if le == "+Inf" else float(le)
                cum[bound] = cum.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    if not cum or not cum.get(math.inf):
        return {0.5: None, 0.99: None}
    total = cum[math.inf]
    out: dict[float, float | None] = {}
    for q in (0.5, 0.99):
        b = next(b for b in sorted(cum) if cum[b] >= q * total)
        out[q] = None if math.isinf(b) else round(b * 1000, 1)
    return out


def _rss_mb(pid: int | None) -> float:
    """Resident memory of a process in MiB (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return 0.0


def _pct(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, math.ceil(q * len(sorted_vals)) - 1))
    return round(sorted_vals[i], 2)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="dsec-bench-create-"))
    logs = tmp / "logs"
    logs.mkdir()
    size = getattr(args, "cluster", 1)
    reps = getattr(args, "stream_replicas", 0) or (3 if size > 1 else 1)
    os.environ[REPLICAS_ENV] = str(reps)  # this process and every child set the streams up alike
    srv = NatsCluster(tmp / "nats", size=size) if size > 1 else NatsCluster(tmp / "nats", size=1)
    if size == 1:  # one node: no routes
        srv.nodes[0].cluster_port = None
    procs: list[_Proc] = []
    keep = args.keep
    try:
        srv.start()
        return asyncio.run(_run(args, srv.url, tmp, logs, procs, srv.nodes, srv.nodes[0].monitor_port))
    except BaseException:
        keep = True  # the logs say why
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        srv.stop()
        if keep:
            print(f"dsec bench: kept {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)


async def _wait(what: str, check: Any, timeout: float, procs: list[_Proc]) -> None:
    deadline = time.monotonic() + timeout
    while True:
        for p in procs:
            if not p.alive():
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}; see {p.log_path}")
        if await check():
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        await asyncio.sleep(0.1)  # readiness poll interval


def sim_heartbeat_s(hosts: int) -> float:
    """Heartbeat period of simulated hosts: 2 s up to 400 hosts, then slower so that the cluster sends
    at most about 320 a second (as Nomad scales its heartbeat TTL with the number of clients)."""
    return max(2.0, hosts / 320.0)


def _start_sim_hosts(args: argparse.Namespace, env: dict[str, str], tmp: Path, logs: Path, procs: list[_Proc]) -> tuple[float, int]:
    """Simulated hosts, big enough to hold the whole run (not a capacity test) at 50x cpu overcommit;
    returns (cores per host, processes)."""
    total = args.count + args.warmup * args.clients
    host_cpus = args.host_cpus or max(64.0, math.ceil(1.25 * total * args.cpu / (args.sim_hosts * 50.0)))
    host_mem = int(max(1024 * 1024, 1.25 * total * args.memory_mb / (args.sim_hosts * args.mem_overcommit)))
    n_procs = args.sim_procs or min(4, max(2, math.ceil(args.sim_hosts / 400)))  # 2 cores: at least 2
    per = [args.sim_hosts // n_procs + (1 if i < args.sim_hosts % n_procs else 0) for i in range(n_procs)]
    first = 0
    for i, n in enumerate(per):
        # heartbeats as the hosts' own default for the whole cluster's size, not each process's share
        e = dict(env, DSEC_SIM_FIRST=str(first), DSEC_SIM_CPU=str(host_cpus), DSEC_SIM_MEM_MB=str(host_mem),
                 DSEC_SIM_HEARTBEAT_S=env.get("DSEC_SIM_HEARTBEAT_S") or str(sim_heartbeat_s(args.sim_hosts)))
        procs.append(_Proc(f"sim-{i}", [sys.executable, "-m", "hostagent", "--backend", "sim", "--sim-hosts", str(n), "--host-id", "sim",
                                        "--data-dir", str(tmp / "data"), "--concurrency", str(args.host_concurrency),
                                        "--mem-overcommit", str(args.mem_overcommit)], e, logs))
        first += n
    return host_cpus, n_procs


async def _start_clients(
    args: argparse.Namespace, url: str, go_subject: str, env: dict[str, str], tmp: Path, logs: Path, procs: list[_Proc]
) -> list[_Proc]:
    """The client processes, each waiting (ready) for ``go_subject``."""
    shares = [args.count // args.clients + (1 if i < args.count % args.clients else 0) for i in range(args.clients)]
    clients: list[_Proc] = []
    for i, share in enumerate(shares):
        params = {
            "nats_url": url, "client": i, "count": share, "batch": max(1, args.batch), "concurrency": args.concurrency,
            "cpu": args.cpu, "memory_mb": args.memory_mb, "disk_mb": args.disk_mb, "sandbox_timeout": 24 * 3600.0,
            "create_timeout": args.create_timeout, "warmup": args.warmup, "go_subject": go_subject,
            "result_file": str(tmp / f"client-{i}.json"), "client_coalesce": not args.no_client_coalesce,
        }
        c = _Proc(f"client-{i}", [sys.executable, "-m", "sdk._benchclient", json.dumps(params)], env, logs, pipe=True)
        clients.append(c)
        procs.append(c)
    loop = asyncio.get_running_loop()
    for c in clients:
        line = await loop.run_in_executor(None, c.proc.stdout.readline)  # type: ignore[union-attr]  # clients start with stdout=PIPE
        if line.strip() != b"ready":
            raise RuntimeError(f"{c.name} did not get ready ({line!r}); see {c.log_path}")
    return clients


def _monitor(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/{path}", timeout=5) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


def server_counters(port: int) -> dict[str, int]:
    """The server's own counters: messages in and out (every publish, ack, pull, reply), JetStream API
    calls, and messages stored per stream (KV buckets included)."""
    v = _monitor(port, "varz")
    j = _monitor(port, "jsz?streams=true")
    out = {"in_msgs": v["in_msgs"], "out_msgs": v["out_msgs"], "js_api": j.get("api", {}).get("total", 0)}
    for acc in j.get("account_details") or []:
        for st in acc.get("stream_detail") or []:
            out[f"stored.{st['name']}"] = st["state"]["last_seq"]
    return out


def per_op(before: dict[str, int], after: dict[str, int], n: int) -> dict[str, float]:
    """Counter deltas per operation (streams created during the run count from 0)."""
    if n <= 0:
        return {}
    d = {k: round((after[k] - before.get(k, 0)) / n, 2) for k in after}
    d["js_stored"] = round(sum(v for k, v in d.items() if k.startswith("stored.")), 2)
    return {k: v for k, v in d.items() if v}


async def _run(
    args: argparse.Namespace, url: str, tmp: Path, logs: Path, procs: list[_Proc], nodes: list[Any], monitor_port: int
) -> dict[str, Any]:
    storage = StorageType.MEMORY if args.storage == "memory" else StorageType.FILE
    nc = await connect(url, name="dsec-bench")
    js = nc.jetstream(timeout=30)
    await ensure_all(js, StreamOptions(storage=storage, events_max_bytes=512 * 1024**2 if storage == StorageType.MEMORY else StreamOptions().events_max_bytes))
    kv_img = await ensure_kv(js, S.KV_IMAGES)
    base = TemplateManifest(name="base", layers=[LayerRef(role="base", digest="sha256:" + "0" * 64)], created_at=time.time(), description="bench")
    await kv_img.put("base", codec.encode(base))

    env = dict(os.environ)
    env.update({
        "DSEC_NATS_URL": url, "DSEC_LOG_LEVEL": "WARNING", "DSEC_SIM_STORAGE": args.storage,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    })
    py = sys.executable
    # placement first: its ensure_all() must not race the simulated hosts' consumer creation
    for r in range(args.replicas):
        procs.append(_Proc(f"placement-{r}", [py, "-m", "placement", "--replica-id", f"p{r}", "--capacity", str(args.placement_capacity),
                                              "--stream-storage", args.storage, *(["--coalesce", str(args.coalesce)] if args.coalesce else [])], env, logs))

    async def placement_ready() -> bool:
        try:
            ci = await js.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
            return bool((ci.num_waiting or 0) >= args.replicas)
        except Exception:  # noqa: BLE001
            return False

    t_setup = time.monotonic()
    await _wait("placement replicas", placement_ready, 60, procs)
    host_cpus, n_procs = _start_sim_hosts(args, env, tmp, logs, procs)
    kv_hosts = await ensure_kv(js, S.KV_HOSTS)

    async def hosts_ready() -> bool:
        # a host heartbeats once it takes hand-offs
        try:
            hinfo = await js.stream_info(f"KV_{S.KV_HOSTS}")
            return bool(hinfo.state.messages >= args.sim_hosts)
        except Exception:  # noqa: BLE001
            return False

    await _wait("simulated hosts", hosts_ready, 60 + args.sim_hosts / 20, procs)
    await _wait("placement's host table", placement_ready, 60, procs)
    setup_s = time.monotonic() - t_setup
    del kv_hosts

    go_subject = f"_dsec_bench.{uuid.uuid4().hex[:8]}.go"
    clients = await _start_clients(args, url, go_subject, env, tmp, logs, procs)
    loop = asyncio.get_running_loop()

    def cpu_by_role() -> dict[str, float]:
        out = {"nats": sum(_cpu_s(n.pid) for n in nodes)}
        for p in procs:
            role = p.name.rsplit("-", 1)[0]
            out[role] = out.get(role, 0.0) + _cpu_s(p.proc.pid)
        return out

    counters0 = await loop.run_in_executor(None, server_counters, monitor_port)
    cpu0 = cpu_by_role()
    await nc.publish(go_subject, b"go")
    await nc.flush()
    cpu1: dict[str, float] = {}
    counters1: dict[str, int] = {}
    for i, c in enumerate(clients):
        line = await loop.run_in_executor(None, c.proc.stdout.readline)  # type: ignore[union-attr]  # clients start with stdout=PIPE
        if line.strip() != b"done":
            raise RuntimeError(f"{c.name} did not finish ({line!r}); see {c.log_path}")
        if i == 0:
            cpu1 = cpu_by_role()  # the burst is over when the first client is done (clients run alike)
            counters1 = await loop.run_in_executor(None, server_counters, monitor_port)
        await loop.run_in_executor(None, c.proc.wait)
    cpu_s = {k: round(cpu1.get(k, 0.0) - v, 2) for k, v in cpu0.items()}
    placed = await _placement_quantiles(nc)
    decided = await _placement_quantiles(nc, "dsec_placement_decision_seconds")

    results = [json.loads((tmp / f"client-{i}.json").read_text()) for i in range(len(clients))]
    lat = sorted(x for r in results for x in r["latencies_ms"])
    errors = [e for r in results for e in r["errors"]]
    requested = [sid for r in results for sid in r["requested"]]
    span = max(r["end"] for r in results) - min(r["start"] for r in results)

    ready, ready_hosts = await _count_ready(js)
    req_set = set(requested)
    lost = sum(1 for sid in req_set if ready.get(sid, 0) == 0)
    duplicated = sum(1 for sid in req_set if ready.get(sid, 0) > 1)
    multi_host = sum(1 for sid in req_set if len(ready_hosts.get(sid, ())) > 1)
    unexpected = sum(1 for sid in ready if sid not in req_set)
    rec_info = await js.stream_info(f"KV_{S.KV_SANDBOXES}")
    await nc.close()
    n_ok = len(lat)
    return {
        "ok": lost == 0 and duplicated == 0 and not errors,
        "creates_per_s": round(n_ok / span, 1) if span > 0 else 0.0,
        "p50_ms": _pct(lat, 0.50),
        "p90_ms": _pct(lat, 0.90),
        "p99_ms": _pct(lat, 0.99),
        "max_ms": round(lat[-1], 2) if lat else 0.0,
        "lost": lost,
        "duplicated": duplicated,
        "ready_on_two_hosts": multi_host,
        "unexpected_ready": unexpected,
        "client_errors": len(errors),
        "first_errors": errors[:3],
        "created": n_ok,
        "requested": len(req_set),
        "ready_events": sum(ready.values()),
        "records": rec_info.state.messages,
        "seconds": round(span, 3),
        "count": args.count,
        "batch": args.batch,
        "coalesce": args.coalesce,
        "client_coalesce": not args.no_client_coalesce,
        "replicas": args.replicas,
        "sim_hosts": args.sim_hosts,
        "sim_procs": n_procs,
        "clients": args.clients,
        "concurrency_per_client": args.concurrency,
        "storage": args.storage,
        "host_cpus": host_cpus,
        "setup_s": round(setup_s, 2),
        "cpu_s": cpu_s,
        # what the run really got from the machine: on a shared box the rate alone misleads
        "cores_used": round(sum(cpu_s.values()) / span, 2) if span > 0 else 0.0,
        "cpu_us_per_create": round(sum(cpu_s.values()) / n_ok * 1e6, 1) if n_ok else 0.0,
        "cpu_us_per_create_by_process": {k: round(v / n_ok * 1e6, 1) for k, v in cpu_s.items()} if n_ok else {},
        # measured from the go message to the first client's end: the other client's tail is not in it
        "nats_per_create": per_op(counters0, counters1, n_ok),
        # placement's own histogram (request stored -> handed to a host: queueing and the decision),
        # as bucket upper bounds over every replica
        "placement_p50_ms": placed.get(0.5), "placement_p99_ms": placed.get(0.99),
        # the decision alone: from a request's delivery to placement to its hand-off (no queueing)
        "decision_p50_ms": decided.get(0.5), "decision_p99_ms": decided.get(0.99),
        "nats_nodes": len(nodes),
        "stream_replicas": int(os.environ.get(REPLICAS_ENV, "1")),
        # resident memory at the end, the sandboxes still held: each nats-server node and each process
        "rss_mb": {**{f"nats-n{i}": _rss_mb(n.pid) for i, n in enumerate(nodes)}, **{p.name: _rss_mb(p.proc.pid) for p in procs if p.alive()}},
        "cpus": os.cpu_count(),
    }


async def _count_ready(js: Any) -> tuple[dict[str, int], dict[str, set[str]]]:
    """Every announcement of ``ready`` in DSEC_EVT, per sandbox id (and the hosts that sent them): a
    sandbox's own ``ready`` event, or a host batch's event naming it (bus.messages.ReadyMany)."""
    counts: dict[str, int] = {}
    hosts: dict[str, set[str]] = {}
    info = await js.stream_info(S.STREAM_EVT)
    if not info.state.messages:
        return counts, hosts
    durable = f"bench-count-{uuid.uuid4().hex[:6]}"
    sub = await js.pull_subscribe(
        "", durable=durable, stream=S.STREAM_EVT,
        config=ConsumerConfig(
            durable_name=durable, deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE, max_waiting=4,
            filter_subjects=[f"{S.PREFIX}.evt.sandbox.*.*.ready", S.EVT_READY_ALL],
        ),
    )
    try:
        while True:
            ci = await js.consumer_info(S.STREAM_EVT, durable)
            if ci.num_pending == 0 and ci.num_ack_pending == 0:
                # everything delivered: drain what is buffered, then stop
                try:
                    msgs = await sub.fetch(5000, timeout=0.5)
                except Exception:  # noqa: BLE001 - nothing left
                    break
            else:
                try:
                    msgs = await sub.fetch(5000, timeout=2)
                except Exception:  # noqa: BLE001
                    continue
            for m in msgs:
                ev = codec.EVENT.decode(m.data)
                if isinstance(ev, ReadyMany):
                    named = [(sid, ev.host_id) for sid in ev.sandbox_ids]
                else:  # dsec.evt.sandbox.<tenant>.<id>.ready
                    named = [(m.subject.split(".")[4], ev.host_id if isinstance(ev, SandboxEvent) else "")]
                for sid, host in named:
                    counts[sid] = counts.get(sid, 0) + 1
                    if host:
                        hosts.setdefault(sid, set()).add(host)
    finally:
        await sub.unsubscribe()
        await js.delete_consumer(S.STREAM_EVT, durable)
    return counts, hosts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m placement.bench")
    add_create_args(ap)
    sys.exit(run_cli(ap.parse_args(argv)))


if __name__ == "__main__":
    main()
