"""Benchmark of the whole sandbox path on one host (a script, not a test).

    python tests/bench/bench_sandboxes.py [-n 100] [--concurrency 16] [--profile prof.txt]
    python tests/bench/bench_sandboxes.py --lifecycle [--sizes 300,1000] [--cpus 0.02,1] --memory-mb 16 --disk-mb 32 --cpu-overcommit 1000
    python tests/bench/bench_sandboxes.py --exec-agents 64 [--exec-rounds 40] [--think-ms 50,0] [--exec-profile DIR]

A fresh stack in this process: an embedded NATS JetStream server, one placement replica and a host
agent with the container backend (a private containerd + runc) in a temp data dir, and a busybox
``base`` template. Through the real SDK it measures

* create latency, sequential (one at a time) and under a concurrent burst of N, and creates/s of the burst;
* exec round trip of ``true`` (p50 / p99);
* host memory per idle sandbox: RSS and PSS (from /proc/<pid>/smaps_rollup) of the containerd shims
  (shared by a group of sandboxes: apportioned), of the agent that is PID 1 in each sandbox, of the
  growth of containerd and of this process (host agent + placement + SDK: an upper bound of the host
  agent's bookkeeping) per sandbox; the sandbox's memory cgroup usage; and the drop of MemAvailable
  per sandbox (everything, kernel included: mounts, loop devices, page tables);
* CPU time per create, by process: this process, its children (mkfs, ...), containerd, shims + runc.

``--profile FILE`` samples this process with py-spy during the burst and prints where its time goes.

``--exec-agents N``: N sandboxes, then N concurrent agents (one per sandbox, in a client process of
their own, so its CPU is apart from the host agent's) each running ``echo hi`` ``--exec-rounds``
times with ``--think-ms`` between execs (each value of the list in turn; 0: flat out), started all at
once (lockstep: with a constant think time they stay in step, 64 execs arriving together) or each at
a random moment of its first think time (staggered, as independent agents would; ``--exec-start``). Prints
execs/s, p50/p90/p99 and CPU µs per exec by process: the client, this process (the host agent;
placement idles), the agents in the sandboxes (dsec-agent itself, and the commands it ran),
containerd, shims, nats-server, the whole machine; ``--exec-perf`` adds ``perf stat`` figures
(syscalls, context switches, CPU) per exec of the client, host agent, sandbox agents with the
commands they ran, and nats-server. ``--exec-profile DIR`` records the host agent and the client
with py-spy during the flat-out run.
Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
from typing import Any
import asyncio
import collections
import contextlib
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bus import NatsServer, codec, connect, ensure_all  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.messages import LayerRef, TemplateManifest  # noqa: E402
from bus.streams import ensure_kv  # noqa: E402
from hostagent import HostAgent, HostAgentConfig  # noqa: E402
from hostagent.backends.container import ContainerBackend  # noqa: E402
from imaged._busybox import build_busybox_rootfs  # noqa: E402
from placement import Placement  # noqa: E402
from sdk import AsyncSandbox  # noqa: E402
import sdk._async  # noqa: E402
from tests.netclaim import NetClaim, claim_net  # noqa: E402

KiB = 1024
MiB = 1 << 20
CLK = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------------------------ measuring
def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * len(s) + 0.5) - 1))]


def smaps(pid: int) -> tuple[int, int]:
    """(RSS, PSS) in bytes from /proc/<pid>/smaps_rollup; (0, 0) if the process is gone."""
    rss = pss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Rss:"):
                    rss = int(line.split()[1]) * KiB
                elif line.startswith("Pss:"):
                    pss = int(line.split()[1]) * KiB
    except OSError:
        pass
    return rss, pss


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def pids_matching(*needles: str) -> list[int]:
    me = os.getpid()
    out = []
    for n in os.listdir("/proc"):
        if n.isdigit() and int(n) != me:
            c = cmdline(int(n))
            if all(x in c for x in needles):
                out.append(int(n))
    return out


def cpu_s(pid: int, children: bool = False) -> float:
    """utime+stime (and the same of waited-for children) of a process, in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    own = int(fields[11]) + int(fields[12])
    kids = int(fields[13]) + int(fields[14])
    return ((own + kids) if children else own) / CLK


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / CLK  # user nice system irq softirq (not idle, iowait, steal)


def _cgroup_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return ""


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KiB
    return 0


def _cpuacct_dsec() -> float:
    """CPU of every sandbox alive now (their cgroups go away with them: snapshot before killing)."""
    total = 0
    for p in Path("/sys/fs/cgroup/cpuacct/dsec").glob("*/cpuacct.usage"):
        with contextlib.suppress(OSError, ValueError):
            total += int(p.read_text())
    return total / 1e9


def _kthreads_cpu() -> float:
    total = 0.0
    for n in os.listdir("/proc"):
        if not n.isdigit():
            continue
        try:
            with open(f"/proc/{n}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if n == "2" or fields[1] == "2":  # kthreadd and its children
            total += (int(fields[11]) + int(fields[12])) / CLK
    return total


class CpuMeter:
    """CPU seconds by part of the stack between two snapshots."""

    def __init__(self, data_dir: str, containerd_pid: int, nats_pid: int | None = None) -> None:
        self.data_dir = data_dir
        self.nats_pid = nats_pid
        self.containerd_pid = containerd_pid
        self.shim_cpu_gone = 0.0
        self._shims: dict[int, float] = {}

    def _shim_total(self) -> float:
        live = {p: cpu_s(p, children=True) for p in pids_matching("containerd-shim", self.data_dir)}
        # Shims exit when their group empties: keep the last reading of the ones that went away.
        for p, v in self._shims.items():
            if p not in live:
                self.shim_cpu_gone += v
        self._shims = live
        return sum(live.values()) + self.shim_cpu_gone

    def snapshot(self) -> dict[str, float]:
        me = os.getpid()
        snap = {
            "this process (host agent + placement + SDK)": cpu_s(me),
            "its children (mkfs.ext4, mount, ...)": cpu_s(me, children=True) - cpu_s(me),
            "containerd": cpu_s(self.containerd_pid, children=True),
            "shims + runc": self._shim_total(),
            "nats-server": cpu_s(self.nats_pid) if self.nats_pid else 0.0,
            "inside the sandboxes (cpuacct dsec/*)": _cpuacct_dsec(),
            "kernel threads (kworker, loop, ...)": _kthreads_cpu(),
        }
        total = machine_cpu_s()
        snap["other (interrupts, other processes on the machine)"] = total - sum(snap.values())
        snap["machine (all busy CPU)"] = total
        return snap


# ------------------------------------------------------------------------------------------ phases
PHASES: dict[str, list[float]] = collections.defaultdict(list)


def _wrap(cls: type, name: str, label: str) -> None:
    """Time every call of ``cls.name`` into PHASES[label] (the benchmark's own instrumentation)."""
    orig = getattr(cls, name)
    if asyncio.iscoroutinefunction(orig):
        async def timed_async(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return await orig(*a, **k)
            finally:
                PHASES[label].append((time.perf_counter() - t) * 1000)

        setattr(cls, name, timed_async)
    else:
        def timed_sync(*a, **k):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                PHASES[label].append((time.perf_counter() - t) * 1000)

        setattr(cls, name, timed_sync)


def instrument() -> list[str]:
    """Wrap the steps of a create; returns the labels in path order."""
    from hostagent._agent import AgentClient
    from hostagent.backends.container.containerd import ContainerRuntime
    from hostagent._quota import ScratchFS
    from hostagent._rootfs import RootfsLayout

    from hostagent._intake import Intake
    from hostagent._ops import OpsEndpoint
    from hostagent._records import Records
    from hostagent._registry import Registry

    steps = [
        (Intake, "create_one", "host: whole create (claim .. ready event)"),
        (Records, "claim", "host:  claim id in KV (create)"),
        (Intake, "_do_create", "host:  create .. ready event"),
        (ContainerBackend, "create", "host:   backend.create"),
        (ScratchFS, "allocate", "host:    scratch fs (mkfs + loop + mount)"),
        (ScratchFS, "_reserve", "host:     budget check (lists all images)"),
        (ScratchFS, "_make_image", "host:     mkfs.ext4"),
        (ScratchFS, "_attach_and_mount", "host:     loop device + mount"),
        (RootfsLayout, "create", "host:    upper/work/run dirs"),
        (ContainerRuntime, "create_and_start", "host:    containerd: container+task create+start"),
        (AgentClient, "wait_ready", "host:    agent answers"),
        (OpsEndpoint, "serve", "host:   subscribe to ops"),
        (Records, "record", "host:   KV record (put)"),
        (Records, "sandbox_event", "host:   event (acked publish)"),
        (Registry, "save", "host:   local state file"),
        (Placement, "handle_batch", "placement: handle a batch"),
    ]
    for cls, name, label in steps:
        _wrap(cls, name, label)
    # containerd's gRPC calls, one label per call kind ("create container", "create task", "start task", ...)
    orig_call = ContainerRuntime._call

    async def timed_call(self, method, request, what, timeout=None, **kw):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return await orig_call(self, method, request, what, timeout, **kw)
        finally:
            PHASES["host:     grpc " + " ".join(what.split()[:2])].append((time.perf_counter() - t) * 1000)

    ContainerRuntime._call = timed_call  # type: ignore[method-assign]
    labels = [label for _, _, label in steps]
    i = labels.index("host:    containerd: container+task create+start") + 1
    labels[i:i] = ["host:     grpc create container", "host:     grpc create task", "host:     grpc start task"]
    return labels


def phase_report(labels: list[str], e2e: list[float], title: str) -> None:
    print(f"where a create's time goes, {title} (p50 / mean ms per call; e2e = SDK create .. ready):")
    print(f"  {'SDK create, end to end':58} {pct(e2e, 50):7.1f} {statistics.mean(e2e):7.1f}")
    for label in labels:
        xs = PHASES.get(label, [])
        if xs:
            print(f"  {label:58} {pct(xs, 50):7.1f} {statistics.mean(xs):7.1f}   (x{len(xs)})")


# ------------------------------------------------------------------------------------------ the stack
class Stack:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dir = Path(tempfile.mkdtemp(prefix="dsec-bench-", dir="/tmp"))
        self.nats = NatsServer(self.dir / "nats", port=0)
        self.placement: Placement | None = None
        self.host: HostAgent | None = None
        self.backend: ContainerBackend | None = None
        self.net: NetClaim | None = None
        self.url = ""

    async def start(self) -> None:
        self.nats.start()
        self.url = self.nats.url
        nc = await connect(self.url)
        js = nc.jetstream()
        await ensure_all(js)
        rootfs = self.dir / "rootfs"
        build_busybox_rootfs(str(rootfs))
        kv = await ensure_kv(js, S.KV_IMAGES)
        base = TemplateManifest(name="base", layers=[LayerRef(role="base", digest="sha256:" + "0" * 64, kind="dir", path=str(rootfs))])
        await kv.put("base", codec.encode(base))
        await nc.close()
        self.placement = Placement(self.url, replica_id="bench-p1")
        await self.placement.start()
        self.net = claim_net()  # network names of its own: not the default ones other stacks on this machine share
        self.backend = ContainerBackend(str(self.dir), shim_group_size=self.args.shim_group, warm_pool=self.args.warm_pool, network=self.net.config())
        self.host = HostAgent(self.backend, HostAgentConfig(
            nats_url=self.url, host_id="bench", data_dir=str(self.dir), concurrency=self.args.concurrency, destroy_on_shutdown=True,
            cpu_overcommit=self.args.cpu_overcommit, reconcile_s=self.args.reconcile_s,
        ))
        await self.host.start()
        deadline = time.monotonic() + 15
        while "bench" not in self.placement.table.hosts and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # readiness poll

    async def stop(self) -> list[str]:
        try:
            with contextlib.suppress(Exception):
                await sdk._async.close_connections()
            if self.host is not None:
                await self.host.shutdown()
            if self.placement is not None:
                await self.placement.shutdown()
        finally:  # whatever failed above, the server and the network go too (stopped by pid)
            self.nats.stop()
            if self.net is not None:
                await self.net.purge()
                self.net.release()
        d = str(self.dir)
        with open("/proc/self/mountinfo") as f:
            left = [ln.split()[4] for ln in f if d in ln]
        left += [f"pid {p}: {cmdline(p)}" for p in pids_matching(d)]
        if not left:
            shutil.rmtree(self.dir, ignore_errors=True)
        return left

    def create(self, sid: str | None = None, cpu: float | None = None) -> "asyncio.Future[AsyncSandbox]":
        return AsyncSandbox.create(
            nats_url=self.url, memory_mb=self.args.memory_mb, disk_mb=self.args.disk_mb, cpu=self.args.cpu if cpu is None else cpu,
            timeout=3600, create_timeout=1800, sandbox_id=sid,
        )

    async def leftovers(self, sids: list[str]) -> list[str]:
        """Everything of these sandboxes still on the host or in KV: records not gone, containers,
        agent processes, mounts, cgroups, netns, loop devices, state files."""
        assert self.host is not None and self.backend is not None and self.backend.rt is not None
        left = [f"container {c.id}" for c in await self.backend.rt.list()]
        wanted = set(sids)
        with open("/proc/self/mountinfo") as f:
            left += [f"mount {mp}" for mp in (ln.split()[4] for ln in f) if set(mp.split("/")) & wanted]
        left += [f"cgroup {p}" for p in Path("/sys/fs/cgroup").glob("*/dsec/*") if p.name in wanted]
        for dev in Path("/sys/block").glob("loop*"):
            with contextlib.suppress(OSError):
                if str(self.dir) in (dev / "loop" / "backing_file").read_text():
                    left.append(f"loop {dev.name}")
        left += [f"netns {sid}" for sid in sids if os.path.lexists(self.backend.net.netns_path(sid))]
        left += [f"agent process {p}" for p in pids_matching("dsec-agent") if any(f"/dsec/{s}" in _cgroup_of(p) for s in wanted)]
        left += [f"state file {p.name}" for p in (self.dir / "hosts" / "bench" / "sandboxes").glob("*")]
        left += [f"live {sid}" for sid in self.host.live]
        nc = await connect(self.url)
        try:
            kv = await ensure_kv(nc.jetstream(), S.KV_SANDBOXES)
            sem = asyncio.Semaphore(64)

            async def state(sid: str) -> str:
                async with sem:
                    return codec.SANDBOX_RECORD.decode((await kv.get(sid)).value).state

            states = await asyncio.gather(*(state(s) for s in sids))
            left += [f"record {sid} {st}" for sid, st in zip(sids, states, strict=True) if st != "gone"]
        finally:
            await nc.close()
        return left


async def wait_pool_full(backend: Any, size: int, timeout: float = 600.0) -> None:
    """With a warm pool, measure from a full pool (as a host that had a quiet moment would be)."""
    if size <= 0:
        return
    deadline = time.monotonic() + timeout
    while backend.pool.ready() < size and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # poll interval while the pool refills
    print(f"warm pool: {backend.pool.ready()} started sandboxes ready")


async def timed(coro) -> tuple[float, object]:
    t = time.perf_counter()
    r = await coro
    return (time.perf_counter() - t) * 1000, r


class Profiler:
    """py-spy attached to this process; SIGINT makes it write what it sampled."""

    def __init__(self, path: str, pid: int | None = None) -> None:
        self.path = path
        self.pid = pid or os.getpid()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("py-spy")
        if exe is None:
            print("  (py-spy not installed: pip install py-spy)")
            return
        self.proc = subprocess.Popen([exe, "record", "--pid", str(self.pid), "--rate", "250", "--format", "raw", "--nonblocking", "-o", self.path],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)  # py-spy attaches; not a synchronisation of the system under test

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def report(self, top: int = 25) -> None:
        if self.proc is None or not os.path.exists(self.path):
            return
        own: collections.Counter[str] = collections.Counter()
        incl: collections.Counter[str] = collections.Counter()
        total = 0
        with open(self.path) as f:
            lines = f.readlines()
        for line in lines:
            stack, _, n = line.rstrip("\n").rpartition(" ")
            if not stack:
                continue
            k = int(n)
            total += k
            frames = stack.split(";")
            own[_short(frames[-1])] += k
            for fr in {_short(f) for f in frames}:
                incl[fr] += k
        if not total:
            return
        print(f"\n  py-spy, pid {self.pid} ({total} samples; file {self.path})")
        print("  self time:")
        for fr, k in own.most_common(top):
            print(f"    {100 * k / total:5.1f}%  {fr}")
        print("  inclusive (dsec code):")
        shown = 0
        for fr, k in incl.most_common():
            if any(p in fr for p in ("hostagent/", "placement/", "bus/", "sdk/")):
                print(f"    {100 * k / total:5.1f}%  {fr}")
                shown += 1
                if shown >= top:
                    break


def _short(frame: str) -> str:
    # "func (path/to/file.py:123)" -> "func (file dir/file.py)"
    name, _, loc = frame.partition(" (")
    loc = loc.rstrip(")")
    path = loc.rsplit(":", 1)[0]
    parts = path.split("/")
    return f"{name} ({'/'.join(parts[-2:])})"


def throttled(st: "Stack", sbs: list[AsyncSandbox]) -> tuple[int, float]:
    """How many of these sandboxes' own CPU cgroups were throttled so far, and for how long in all
    (ms). Read while they are idle, that is their start (runc init, the agent coming up)."""
    assert st.host is not None
    n, ns = 0, 0
    for sb in sbs:
        cid = st.host.handles[sb.sandbox_id].extra.get("cid", sb.sandbox_id)
        with contextlib.suppress(OSError):
            stat = dict(line.split() for line in (Path("/sys/fs/cgroup/cpu/dsec") / cid / "cpu.stat").read_text().splitlines())
            n += int(stat["nr_throttled"]) > 0
            ns += int(stat["throttled_time"])
    return n, ns / 1e6


# ------------------------------------------------------------------------------------------ the run
async def run(args: argparse.Namespace) -> None:
    st = Stack(args)
    print(f"dsec sandbox benchmark: N={args.n}, host concurrency {args.concurrency}, {os.cpu_count()} cores, "
          f"sandbox cpu={args.cpu} memory_mb={args.memory_mb} disk_mb={args.disk_mb}, shim group {args.shim_group}; "
          f"load average at start {Path('/proc/loadavg').read_text().split()[0]}")
    b0, w0 = machine_cpu_s(), time.monotonic()
    await asyncio.sleep(1.0)  # measures what else keeps the machine busy (other processes), before we start
    print(f"cores already busy with other work before the run: {(machine_cpu_s() - b0) / (time.monotonic() - w0):.2f} of {os.cpu_count()}")
    await st.start()
    assert st.backend is not None and st.host is not None and st.backend.daemon is not None
    containerd_pid = st.backend.daemon.pid or 0
    cpu = CpuMeter(str(st.dir), containerd_pid, st.nats.pid)
    labels = instrument()
    try:
        # Warm up (first create compiles nothing any more, but fills caches and connections).
        for _ in range(3):
            sb = await st.create()
            await sb.commands.run("true")
            await sb.kill()

        await wait_pool_full(st.backend, args.warm_pool)

        # --- sequential creates, kept alive as idle sandboxes -------------------------------------
        me = os.getpid()
        before_self, before_cd, before_avail = smaps(me), smaps(containerd_pid), mem_available()
        PHASES.clear()
        c0 = cpu.snapshot()
        seq: list[float] = []
        sbs: list[AsyncSandbox] = []
        t_all = time.perf_counter()
        for _ in range(args.n):
            ms, sb = await timed(st.create())
            seq.append(ms)
            sbs.append(sb)  # type: ignore[arg-type]
        seq_wall = time.perf_counter() - t_all
        c1 = cpu.snapshot()
        seq_throttled = throttled(st, sbs)
        seq_phases = {k: list(v) for k, v in PHASES.items()}

        # --- exec round trip ------------------------------------------------------------------------
        ex: list[float] = []
        target = sbs[0]
        for _ in range(args.exec_n):
            ms, _r = await timed(target.commands.run("true"))
            ex.append(ms)
        # and across sandboxes, one after the other
        ex_many: list[float] = []
        for sb in sbs:
            ms, _r = await timed(sb.commands.run("true"))
            ex_many.append(ms)

        # --- memory of N idle sandboxes ---------------------------------------------------------------
        await asyncio.sleep(args.settle)  # let them go idle (measurement settle time, not synchronisation)
        n = len(sbs)
        agents = [smaps(st.host.handles[sb.sandbox_id].pid) for sb in sbs]
        shim_pids = pids_matching("containerd-shim", str(st.dir))
        shims = [smaps(p) for p in shim_pids]
        after_self, after_cd, after_avail = smaps(me), smaps(containerd_pid), mem_available()
        cg_usage, cg_rss, cg_cache = [], [], []
        for sb in sbs:
            base = Path("/sys/fs/cgroup/memory/dsec") / sb.sandbox_id
            with contextlib.suppress(OSError):
                cg_usage.append(int((base / "memory.usage_in_bytes").read_text()))
                stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
                cg_rss.append(int(stat.get("total_rss", 0)))
                cg_cache.append(int(stat.get("total_cache", 0)))

        def mib(b: float) -> str:
            return f"{b / MiB:6.2f} MiB"

        agent_rss = statistics.mean(a[0] for a in agents)
        agent_pss = statistics.mean(a[1] for a in agents)
        shim_rss = sum(s[0] for s in shims) / n
        shim_pss = sum(s[1] for s in shims) / n
        self_rss = (after_self[0] - before_self[0]) / n
        self_pss = (after_self[1] - before_self[1]) / n
        cd_rss = (after_cd[0] - before_cd[0]) / n
        cd_pss = (after_cd[1] - before_cd[1]) / n

        # --- kill them (sequentially, timed) ---------------------------------------------------------
        kills: list[float] = []
        for sb in sbs:
            ms, _r = await timed(sb.kill())
            kills.append(ms)
        sbs = []

        await wait_pool_full(st.backend, args.warm_pool)

        # --- burst ------------------------------------------------------------------------------------
        prof = Profiler(args.profile) if args.profile else None
        if prof:
            prof.start()
        PHASES.clear()
        c2 = cpu.snapshot()
        t0 = time.perf_counter()
        res = await asyncio.gather(*(timed(st.create()) for _ in range(args.n)), return_exceptions=True)
        burst_wall = time.perf_counter() - t0
        c3 = cpu.snapshot()
        burst_phases = {k: list(v) for k, v in PHASES.items()}
        if prof:
            prof.stop()
        ok = [r for r in res if isinstance(r, tuple)]
        burst = [r[0] for r in ok]
        sbs = [r[1] for r in ok]  # type: ignore[misc]
        fails = [r for r in res if not isinstance(r, tuple)]
        burst_throttled = throttled(st, sbs)
        await asyncio.gather(*(sb.kill() for sb in sbs))
        sbs = []

        # --- report -----------------------------------------------------------------------------------
        print()
        print(f"creates, sequential (N={args.n}):  p50 {pct(seq, 50):7.1f} ms   p99 {pct(seq, 99):7.1f} ms   max {max(seq):7.1f} ms"
              f"   ({args.n / seq_wall:.1f}/s)")
        print(f"creates, burst of {args.n} at once:   p50 {pct(burst, 50):7.1f} ms   p99 {pct(burst, 99):7.1f} ms   max {max(burst or [0]):7.1f} ms")
        print(f"burst throughput:                {len(burst) / burst_wall:7.1f} creates/s  ({len(burst)} in {burst_wall:.2f} s, {len(fails)} failed)")
        print(f"exec `true`, same sandbox (x{args.exec_n}): p50 {pct(ex, 50):6.2f} ms   p99 {pct(ex, 99):6.2f} ms")
        print(f"exec `true`, across {n} sandboxes:  p50 {pct(ex_many, 50):6.2f} ms   p99 {pct(ex_many, 99):6.2f} ms")
        print(f"kill, sequential:                p50 {pct(kills, 50):7.1f} ms   p99 {pct(kills, 99):7.1f} ms")
        print(f"start throttled by the sandbox's own CPU share: sequential {seq_throttled[0]}/{args.n} sandboxes ({seq_throttled[1]:.0f} ms in all), "
              f"burst {burst_throttled[0]}/{len(burst)} ({burst_throttled[1]:.0f} ms in all)")
        print()
        print(f"host memory per idle sandbox ({n} idle, busybox, {len(shim_pids)} shim processes):")
        print(f"  {'':44} {'RSS':>10} {'PSS':>10}")
        print(f"  {'agent (PID 1 in the sandbox)':44} {mib(agent_rss):>10} {mib(agent_pss):>10}")
        print(f"  {'containerd-shim (shared, apportioned)':44} {mib(shim_rss):>10} {mib(shim_pss):>10}")
        print(f"  {'containerd growth':44} {mib(cd_rss):>10} {mib(cd_pss):>10}")
        print(f"  {'host agent bookkeeping (process growth)*':44} {mib(self_rss):>10} {mib(self_pss):>10}")
        tot_pss = agent_pss + shim_pss + cd_pss + max(self_pss, 0)
        tot_rss = agent_rss + shim_rss + cd_rss + max(self_rss, 0)
        print(f"  {'total (processes)':44} {mib(tot_rss):>10} {mib(tot_pss):>10}")
        print(f"  memory cgroup usage per sandbox: mean {mib(statistics.mean(cg_usage))} "
              f"(rss {mib(statistics.mean(cg_rss))}, cache {mib(statistics.mean(cg_cache))})")
        print(f"  MemAvailable drop per sandbox (everything, kernel included): {mib((before_avail - after_avail) / n)}")
        print("  * this process runs the host agent, placement and the SDK: its growth bounds the host agent's share from above")
        print()

        def cpu_report(a: dict[str, float], b: dict[str, float], count: int, title: str) -> None:
            print(f"CPU per create, {title}:")
            for k in a:
                print(f"  {k:46} {1000 * (b[k] - a[k]) / count:7.1f} ms")

        cpu_report(c0, c1, args.n, "sequential")
        cpu_report(c2, c3, max(1, len(burst)), "burst")
        print()
        PHASES.clear()
        PHASES.update(seq_phases)
        phase_report(labels, seq, "sequential")
        PHASES.clear()
        PHASES.update(burst_phases)
        phase_report(labels, burst, f"burst of {args.n} (includes waiting for a slot and for CPU)")
        if prof:
            prof.report()
    finally:
        for sb in sbs:
            with contextlib.suppress(Exception):
                await sb.kill()
        left = await st.stop()
        if left:
            print(f"LEFT BEHIND under {st.dir}: {left}", file=sys.stderr)
            sys.exit(1)
        print("\nclean: no mounts, containers or processes left under the data dir")


# ------------------------------------------------------------------------------------------ lifecycle
async def run_lifecycle(args: argparse.Namespace) -> None:
    """For each N and cpu: a burst of N creates, the reconcile loop's cost at N, all N killed at once
    (asyncio.gather), then what is left (must be nothing)."""
    st = Stack(args)
    sizes = [int(x) for x in args.sizes.split(",")]
    cpus = [float(x) for x in args.cpus.split(",")]
    print(f"dsec lifecycle benchmark: N in {sizes}, cpu in {cpus}, memory_mb={args.memory_mb} disk_mb={args.disk_mb}, host concurrency "
          f"{args.concurrency}, {os.cpu_count()} cores; load average at start {Path('/proc/loadavg').read_text().split()[0]}")
    await st.start()
    assert st.host is not None and st.backend is not None
    rows: list[str] = []
    dirty = False
    try:
        for _ in range(3):  # warm-up: caches, connections
            sb = await st.create()
            await sb.kill()
        for n in sizes:
            for cpu in cpus:
                t0 = time.perf_counter()
                res = await asyncio.gather(*(st.create(cpu=cpu) for _ in range(n)), return_exceptions=True)
                create_s = time.perf_counter() - t0
                sbs = [r for r in res if isinstance(r, AsyncSandbox)]
                failed = [r for r in res if not isinstance(r, AsyncSandbox)]
                # The reconcile loop's cost per pass with n sandboxes live (they are idle): local drift
                # check against containerd and the scratch disks, and the sweep of the KV records.
                passes = [await st.host.reconciler.run_pass() for _ in range(args.passes)]
                c0, w0 = time.process_time(), time.perf_counter()
                await st.host.reconciler.sweep_records()
                sweep_cpu, sweep_wall = (time.process_time() - c0) * 1000, (time.perf_counter() - w0) * 1000
                t1 = time.perf_counter()
                kres = await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
                kill_s = time.perf_counter() - t1
                kfailed = [r for r in kres if isinstance(r, BaseException)]
                left = await st.leftovers([sb.sandbox_id for sb in sbs])
                dirty = dirty or bool(left)
                row = (f"N={n:5d} cpu={cpu:<5g} create {len(sbs) / create_s:6.1f}/s ({create_s:6.1f} s, {len(failed)} failed)   "
                       f"kill {len(sbs) / kill_s:6.1f}/s ({kill_s:6.1f} s, {len(kfailed)} failed)   "
                       f"reconcile pass cpu {statistics.median(p['cpu_ms'] for p in passes):7.1f} ms "
                       f"wall {statistics.median(p['wall_ms'] for p in passes):7.1f} ms   "
                       f"KV sweep cpu {sweep_cpu:7.1f} ms wall {sweep_wall:7.1f} ms   leftovers {len(left)}")
                print(row, flush=True)
                if failed:
                    print(f"    first create failure: {failed[0]!r}")
                if kfailed:
                    print(f"    first kill failure: {kfailed[0]!r}")
                if left:
                    print(f"    left: {left[:10]}")
                rows.append(row)
    finally:
        left_dir = await st.stop()
    print()
    for r in rows:
        print(r)
    print(f"data dir after stop: {'clean' if not left_dir else left_dir[:10]}")
    if dirty or left_dir:
        sys.exit(1)


# ------------------------------------------------------------------------------------------ exec
async def _exec_agent(sb: AsyncSandbox, rounds: int, think: float, lat: list[float], errors: list[str], start: float) -> None:
    await asyncio.sleep(start)  # the agent's first step comes when its first think ends
    for i in range(rounds):
        t = time.perf_counter()
        try:
            r = await sb.commands.run("echo hi")
            if r.stdout != "hi\n":
                errors.append(f"stdout {r.stdout!r}")
        except Exception as exc:  # noqa: BLE001 - counted and shown, the run goes on
            errors.append(repr(exc))
        lat.append((time.perf_counter() - t) * 1000)
        if think and i + 1 < rounds:
            await asyncio.sleep(think)  # the agent's think time (what is measured around it)


async def exec_client(args: argparse.Namespace) -> None:
    """The client process of ``--exec-agents``: one agent per sandbox id (stdin's first line), each
    running ``echo hi`` --exec-rounds times with the think time of each "go <think_ms> <start>" line
    of stdin (start "lockstep": all at once, else each at a random moment of its first think time);
    prints one JSON line per run (latencies in ms, wall seconds, its own CPU seconds)."""
    import json

    ids = sys.stdin.readline().split()
    sbs = [await AsyncSandbox.connect(sid, nats_url=args.url) for sid in ids]
    await asyncio.gather(*(sb.commands.run("echo hi") for sb in sbs))  # warm: connection, inbox subscription
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    for line in iter(sys.stdin.readline, ""):
        think = float(line.split()[1]) / 1000
        lockstep = line.split()[2] == "lockstep"
        lat: list[float] = []
        errors: list[str] = []
        rng = random.Random(1)
        starts = [0.0 if lockstep else rng.uniform(0, think) for _ in sbs]
        c0, w0 = time.process_time(), loop.time()
        await asyncio.gather(*(_exec_agent(sb, args.exec_rounds, think, lat, errors, t0) for sb, t0 in zip(sbs, starts, strict=True)))
        wall, cpu = loop.time() - w0, time.process_time() - c0
        print(json.dumps({"lat": lat, "wall": wall, "cpu": cpu, "errors": errors[:5], "n_errors": len(errors)}), flush=True)
    await sdk._async.close_connections()


class PerfStat:
    """``perf stat`` of groups of processes (syscalls, context switches, CPU), per exec."""

    EVENTS = "raw_syscalls:sys_enter,context-switches,task-clock"

    def __init__(self, out_dir: str, groups: dict[str, list[int]]) -> None:
        self.files = {name: os.path.join(out_dir, f"perf-{i}.txt") for i, name in enumerate(groups)}
        exe = shutil.which("perf")
        self.procs = [] if exe is None else [
            subprocess.Popen([exe, "stat", "-x", ",", "-e", self.EVENTS, "-p", ",".join(map(str, pids)), "-o", self.files[name]],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for name, pids in groups.items()
        ]
        time.sleep(0.3)  # perf attaches; not a synchronisation of the system under test

    def report(self, n: int) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
            p.wait(10)
        if not self.procs:
            return
        print("  perf stat, per exec:                       syscalls  ctx switches  CPU µs")
        for name, path in self.files.items():
            vals: dict[str, float] = {}
            with contextlib.suppress(OSError):
                for line in Path(path).read_text().splitlines():
                    f = line.split(",")
                    if len(f) > 2 and f[0].replace(".", "").isdigit():
                        vals[f[2]] = float(f[0])
            print(f"    {name:40} {vals.get('raw_syscalls:sys_enter', 0) / n:9.1f} {vals.get('context-switches', 0) / n:13.1f} "
                  f"{1000 * vals.get('task-clock', 0) / n:7.1f}")


class ExecCpu:
    """CPU seconds by process for the exec run: the sandboxes' agents are read one by one (own time,
    and the time of the commands they ran and reaped), besides the parts CpuMeter knows."""

    def __init__(self, meter: CpuMeter, agent_pids: list[int]) -> None:
        self.meter = meter
        self.agent_pids = agent_pids

    def snapshot(self) -> dict[str, float]:
        snap = self.meter.snapshot()
        own = sum(cpu_s(p) for p in self.agent_pids)
        snap["dsec-agent in the sandboxes (own)"] = own
        snap["commands they ran (sh -c echo, reaped)"] = sum(cpu_s(p, children=True) for p in self.agent_pids) - own
        return snap


def _varz(port: int) -> dict[str, Any]:
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        return json.loads(r.read())


def _exec_report(title: str, res: dict[str, Any], d: dict[str, float], agents: int) -> str:
    """Print one run's figures; returns its summary line."""
    lat, n = res["lat"], len(res["lat"])
    line = (f"exec {title}: {n / res['wall']:7.1f} execs/s  ({n} in {res['wall']:.2f} s, {res['n_errors']} failed)   "
            f"p50 {pct(lat, 50):6.2f} ms  p90 {pct(lat, 90):6.2f} ms  p99 {pct(lat, 99):6.2f} ms  max {max(lat):6.1f} ms")
    print(line, flush=True)
    if res["errors"]:
        print(f"    first failures: {res['errors']}")
    print(f"  CPU per exec (µs), {title}:")
    parts = [
        (f"client (SDK process, {agents} agents)", res["cpu"]),
        ("host agent (this process; placement idles)", d["this process (host agent + placement + SDK)"]),
        ("dsec-agent in the sandboxes (own)", d["dsec-agent in the sandboxes (own)"]),
        ("commands they ran (sh -c echo, reaped)", d["commands they ran (sh -c echo, reaped)"]),
        ("  = inside the sandboxes (cpuacct dsec/*)", d["inside the sandboxes (cpuacct dsec/*)"]),
        ("nats-server", d["nats-server"]),
        ("containerd", d["containerd"]),
        ("shims + runc", d["shims + runc"]),
        ("kernel threads (kworker, loop, ...)", d["kernel threads (kworker, loop, ...)"]),
        ("other (interrupts, other processes, the client)", d["other (interrupts, other processes on the machine)"]),
        ("machine (all busy CPU)", d["machine (all busy CPU)"]),
    ]
    for label, v in parts:
        print(f"    {label:52} {1e6 * v / max(1, n):8.1f}")
    return line


async def run_exec(args: argparse.Namespace) -> None:
    import json

    st = Stack(args)
    thinks = [float(x) for x in args.think_ms.split(",")]
    starts = ["lockstep", "staggered"] if args.exec_start == "both" else [args.exec_start]
    runs = [(t, s) for t in thinks for s in (starts if t else ["lockstep"])]
    print(f"dsec exec benchmark: {args.exec_agents} sandboxes, {args.exec_agents} concurrent agents x {args.exec_rounds} `echo hi`, "
          f"think {thinks} ms, {os.cpu_count()} cores; load average at start {Path('/proc/loadavg').read_text().split()[0]}")
    b0, w0 = machine_cpu_s(), time.monotonic()
    await asyncio.sleep(1.0)  # what else keeps the machine busy (other processes), before we start
    print(f"cores already busy with other work before the run: {(machine_cpu_s() - b0) / (time.monotonic() - w0):.2f} of {os.cpu_count()}")
    await st.start()
    assert st.backend is not None and st.host is not None and st.backend.daemon is not None
    sbs: list[AsyncSandbox] = []
    client: subprocess.Popen[str] | None = None
    try:
        sem = asyncio.Semaphore(16)

        async def one() -> AsyncSandbox:
            async with sem:
                return await st.create()

        sbs = list(await asyncio.gather(*(one() for _ in range(args.exec_agents))))
        idle: list[float] = []
        for _ in range(50):
            ms, _r = await timed(sbs[0].commands.run("echo hi"))
            idle.append(ms)
        print(f"exec `echo hi` on an idle sandbox, one at a time (x50, in this process): p50 {pct(idle, 50):.2f} ms  p99 {pct(idle, 99):.2f} ms")
        agent_pids = [st.host.handles[sb.sandbox_id].pid for sb in sbs]
        cpu = ExecCpu(CpuMeter(str(st.dir), st.backend.daemon.pid or 0, st.nats.pid), agent_pids)
        client = subprocess.Popen(
            [sys.executable, __file__, "--exec-client", "--url", st.url, "--exec-rounds", str(args.exec_rounds)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )
        assert client.stdin is not None and client.stdout is not None
        client.stdin.write(" ".join(sb.sandbox_id for sb in sbs) + "\n")
        client.stdin.flush()
        loop = asyncio.get_running_loop()
        if (await loop.run_in_executor(None, client.stdout.readline)).strip() != "ready":
            raise RuntimeError("the exec client did not start")
        rows = []
        for think, start in runs:
            profs = []
            if args.exec_profile and think == 0:
                os.makedirs(args.exec_profile, exist_ok=True)
                profs = [Profiler(os.path.join(args.exec_profile, f"{name}.txt"), pid) for name, pid in (("hostagent", os.getpid()), ("client", client.pid))]
                for p in profs:
                    p.start()
            counters = None
            if args.exec_perf:
                counters = PerfStat(str(st.dir), {"client": [client.pid], "host agent": [os.getpid()], "dsec-agents (+ their commands)": agent_pids,
                                                  "nats-server": [st.nats.pid or 0]})
            v0 = _varz(st.nats.monitor_port)
            c0 = cpu.snapshot()
            client.stdin.write(f"go {think} {start}\n")
            client.stdin.flush()
            res = json.loads(await loop.run_in_executor(None, client.stdout.readline))
            c1 = cpu.snapshot()
            v1 = _varz(st.nats.monitor_port)
            for p in profs:
                p.stop()
            title = f"think {think:g} ms, {start}" if think else "flat out"
            rows.append(_exec_report(title, res, {k: c1[k] - c0[k] for k in c0}, len(sbs)))
            n = len(res["lat"])
            print(f"  NATS per exec: {(v1['in_msgs'] - v0['in_msgs']) / n:.2f} messages in, {(v1['out_msgs'] - v0['out_msgs']) / n:.2f} out, "
                  f"{(v1['in_bytes'] - v0['in_bytes']) / n:.0f} bytes in")
            if counters is not None:
                counters.report(len(res["lat"]))
            for p in profs:
                p.report(top=30)
        client.stdin.close()
        await loop.run_in_executor(None, client.wait)
        client = None
        print()
        for r in rows:
            print(r)
    finally:
        if client is not None:
            client.kill()
            client.wait()
        await asyncio.gather(*(sb.kill() for sb in sbs), return_exceptions=True)
        left = await st.stop()
        if left:
            print(f"LEFT BEHIND under {st.dir}: {left}", file=sys.stderr)
            sys.exit(1)
        print("clean: no mounts, containers or processes left under the data dir")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=100, help="sandboxes (sequential run, idle set and burst size)")
    ap.add_argument("--concurrency", type=int, default=16, help="the host agent's concurrent creates")
    ap.add_argument("--exec-n", type=int, default=500)
    ap.add_argument("--cpu", type=float, default=0.25)
    ap.add_argument("--memory-mb", type=int, default=64)
    ap.add_argument("--disk-mb", type=int, default=64)
    ap.add_argument("--shim-group", type=int, default=16, help="sandboxes per containerd shim process")
    ap.add_argument("--warm-pool", type=int, default=0, help="started sandboxes kept ready per template (0: every create is cold)")
    ap.add_argument("--settle", type=float, default=1.0, help="seconds idle before measuring memory")
    ap.add_argument("--profile", default=None, help="py-spy raw output file (samples this process during the burst)")
    ap.add_argument("--cpu-overcommit", type=float, default=50.0, help="the host's cpu overcommit (admission)")
    ap.add_argument("--reconcile-s", type=float, default=10.0, help="the host agent's reconcile period")
    ap.add_argument("--lifecycle", action="store_true", help="create/kill rates, reconcile cost and leftovers at --sizes x --cpus")
    ap.add_argument("--sizes", default="300,1000", help="with --lifecycle: burst sizes")
    ap.add_argument("--cpus", default="0.02,1", help="with --lifecycle: sandbox cpu shares")
    ap.add_argument("--passes", type=int, default=3, help="with --lifecycle: reconcile passes measured per size")
    ap.add_argument("--exec-agents", type=int, default=0, help="exec mode: this many sandboxes and concurrent agents")
    ap.add_argument("--exec-rounds", type=int, default=40, help="with --exec-agents: execs per agent")
    ap.add_argument("--think-ms", default="50,0", help="with --exec-agents: think times between execs, one run each")
    ap.add_argument("--exec-start", choices=("lockstep", "staggered", "both"), default="both",
                    help="with think time: agents start all at once (and stay in step), or each at a random moment of its first think time")
    ap.add_argument("--exec-profile", default=None, help="with --exec-agents: py-spy of host agent and client (flat-out run) into DIR")
    ap.add_argument("--exec-perf", action="store_true", help="with --exec-agents: perf stat (syscalls, context switches, CPU) per process group and run")
    ap.add_argument("--exec-client", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    from bus import log as _log

    _log.configure(level=os.environ.get("DSEC_LOG_LEVEL", "WARNING"))
    if args.exec_client:
        asyncio.run(exec_client(args))
        return
    if os.geteuid() != 0:
        sys.exit("needs root (containerd, mounts, cgroups)")
    asyncio.run(run_lifecycle(args) if args.lifecycle else run_exec(args) if args.exec_agents else run(args))


if __name__ == "__main__":
    main()
