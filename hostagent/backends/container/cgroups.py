"""The cgroups (v1) of container sandboxes: limits written straight to their files, leftovers, and the
per-sandbox and host figures read from them."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import structlog

from bus.messages import Priority, SandboxMetrics

from .containerd import CGROUP_PARENT, cpu_limits

log = structlog.get_logger("dsec.hostagent.container")

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEM_CGROUP = CGROUP_ROOT / "memory"
_REL = CGROUP_PARENT.lstrip("/")
CPU_ROOT = CGROUP_ROOT / "cpu"
IDLE_PARENT = CPU_ROOT / f"{_REL}-idle"  # the best-effort class (see set_class)

# Every container starts with at least this CPU share (runc init, the agent's start-up), and gets
# its own once its agent answers: a small share (0.02 is 2 ms per 100 ms) must not slow its start.
START_CPU = 1.0


def cgroup_path(cid: str) -> str:
    """The container's cgroup path under each hierarchy (``/dsec/<container id>``)."""
    return f"{CGROUP_PARENT}/{cid}"


def set_cpu(cid: str, cpu: float) -> None:
    """Apply a CPU share straight to the container's cgroup v1 files (no runc round trip), and to its
    idle-class cgroup if it is best-effort."""
    shares, quota = cpu_limits(cpu)
    parked = IDLE_PARENT / cid
    for base in (CPU_ROOT / _REL / cid, *([parked] if parked.is_dir() else [])):
        (base / "cpu.shares").write_text(str(shares))
        (base / "cpu.cfs_quota_us").write_text(str(quota))


# CPU classes. A latency-sensitive sandbox keeps its own cgroup under ``/dsec`` with a weight of its
# CPU share times LATENCY_WEIGHT. A best-effort sandbox's processes are moved (cpu hierarchy only)
# into ``/<parent>-idle/<container id>``: a parent beside ``/dsec`` at the top of the hierarchy with
# ``cpu.idle=1`` (SCHED_IDLE). At the top is what counts: an idle group is idle only against its own
# siblings, and a best-effort cgroup idle inside ``/dsec`` (the earlier layout) still made ``/dsec``
# a busy, full-weight group against the host agent, NATS and every other task at the top, so their
# wake-ups waited behind best-effort spinners (+7% at 50% load, +49% at 100% on this machine). Under
# the top-level idle parent best-effort work gets the kernel's minimum weight against everything
# else and never preempts it on wake-up: it runs on the cycles the rest leaves. Moved, not created
# there: a warm container's cgroup path is fixed when it is pre-started, before the class of the
# sandbox that claims it is known; the processes the sandbox's agent forks later inherit the moved
# cgroup. The quota (its CPU share) stays an upper bound in either class.
LATENCY_WEIGHT = 8
MAX_SHARES = 262144
_MOVE_PASSES = 20  # a process forking while it is moved leaves a child behind: move again


def class_shares(cpu: float, priority: str) -> int:
    shares = cpu_limits(cpu)[0]
    return min(MAX_SHARES, shares * LATENCY_WEIGHT) if priority == "latency-sensitive" else shares


def _idle_parent() -> Path:
    """The best-effort class parent, made idle once (a weight is refused on an idle group: EINVAL,
    so the low weight goes first, and a concurrent host agent may have made it idle already)."""
    IDLE_PARENT.mkdir(exist_ok=True)
    if (IDLE_PARENT / "cpu.idle").read_text().strip() != "1":
        with contextlib.suppress(OSError):
            (IDLE_PARENT / "cpu.shares").write_text("2")
        (IDLE_PARENT / "cpu.idle").write_text("1")
    return IDLE_PARENT


def _move(src: Path, dst: Path) -> None:
    """Every process of cgroup ``src`` into ``dst`` (cpu hierarchy; threads follow their process). A
    process that is exiting stays listed but cannot move (the kernel skips it quietly): tried once."""
    tried: set[str] = set()
    for _ in range(_MOVE_PASSES):
        try:
            pids = set((src / "cgroup.procs").read_text().split()) - tried
        except FileNotFoundError:
            return
        if not pids:
            return
        for pid in pids:
            try:
                (dst / "cgroup.procs").write_text(pid)
            except ProcessLookupError:
                pass
        tried |= pids
    raise OSError(f"processes keep appearing in {src}")


def set_class(cid: str, cpu: float, priority: str) -> None:
    """Put the container's processes in the CPU class of ``priority`` (see above); idempotent."""
    base, parked = CPU_ROOT / _REL / cid, IDLE_PARENT / cid
    if (base / "cpu.idle").exists():  # the earlier layout's flag on the sandbox's own cgroup
        (base / "cpu.idle").write_text("0")
    (base / "cpu.shares").write_text(str(class_shares(cpu, priority)))
    if priority == "best-effort":
        park(cid)
    elif parked.is_dir():
        unpark(cid)


def park(cid: str) -> None:
    """Move the container's processes into the best-effort class, with its own cgroup's weight and quota."""
    base, parked = CPU_ROOT / _REL / cid, _idle_parent() / cid
    parked.mkdir(exist_ok=True)
    for name in ("cpu.shares", "cpu.cfs_quota_us"):
        (parked / name).write_text((base / name).read_text().strip())
    _move(base, parked)


def unpark(cid: str) -> None:
    """Move a best-effort container's processes back into its own cgroup and drop the idle one (before
    a CRIU dump, which records each process's cgroups under the container's; or a class change)."""
    parked = IDLE_PARENT / cid
    if parked.is_dir():
        _move(parked, CPU_ROOT / _REL / cid)
        try:
            parked.rmdir()
        except FileNotFoundError:
            pass
        except OSError:  # EBUSY: a process killed in the idle class is still dying there; remove_cgroups takes it
            log.info("idle_cgroup_busy", cgroup=str(parked))


def cpu_class(cid: str) -> Priority | None:
    """The class the container's processes are in (None: no cgroup). Parked: its own cgroup is empty
    and its idle one there (one that was unparked may keep its idle one a while, with a dying process)."""
    base = CPU_ROOT / _REL / cid
    try:
        idle = (base / "cpu.idle").read_text().strip()
        procs = (base / "cgroup.procs").read_text().split()
    except OSError:
        return None
    return "best-effort" if idle == "1" or (not procs and (IDLE_PARENT / cid).is_dir()) else "latency-sensitive"


def set_limits(cid: str, cpu: float, memory_mb: int) -> None:
    """Apply a claimed warm container's limits straight to its cgroup v1 files (no runc round trip)."""
    set_cpu(cid, cpu)
    mem = MEM_CGROUP / _REL / cid
    limit = str(memory_mb * 1024 * 1024)
    memsw = mem / "memory.memsw.limit_in_bytes"
    # memory+swap must stay >= memory: raise memsw first when growing, lower memory first when shrinking.
    order = [memsw, mem / "memory.limit_in_bytes"] if memory_mb >= 64 else [mem / "memory.limit_in_bytes", memsw]
    for f in order:
        if f.exists():
            f.write_text(limit)


def cgroups_of(cid: str) -> list[Path]:
    return [p for p in [*CGROUP_ROOT.glob(f"*/{_REL}/{cid}"), IDLE_PARENT / cid] if p.is_dir()]


def remove_cgroups(cid: str) -> None:
    """runc removes a container's cgroups with its task; one left behind (a process that outlived
    its shim) is emptied and removed here. Only ever called for containers of this backend."""
    for p in cgroups_of(cid):
        try:
            for pid in (p / "cgroup.procs").read_text().split():
                kill(int(pid))
            os.rmdir(p)
        except FileNotFoundError:
            pass
        except OSError as exc:  # still busy: the leftovers check reports it and the kill is retried
            log.info("cgroup_busy", cgroup=str(p), error=str(exc))


def in_cgroup(pid: int, cid: str) -> bool:
    """Whether ``pid`` still runs in the container's cgroup (the kernel's word, not containerd's)."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f"/{_REL}/{cid}" in f.read()
    except OSError:
        return False


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def memory_bytes(cid: str) -> int | None:
    try:
        return int((MEM_CGROUP / _REL / cid / "memory.usage_in_bytes").read_text())
    except (OSError, ValueError):
        return None


class Meter:
    """Per-sandbox metrics from the cgroups (CPU as the share of its quota used since the last sample),
    and the host's busy CPUs from /proc/stat."""

    def __init__(self) -> None:
        self._samples: dict[str, tuple[float, int]] = {}  # container -> (monotonic time, cpuacct.usage ns)
        self._host_prev: tuple[float, float] | None = None
        self._idle_prev: dict[str, int] = {}  # best-effort container -> cpuacct.usage ns at the last host sample

    def forget(self, cid: str) -> None:
        self._samples.pop(cid, None)

    def sandbox(self, cid: str, sdir: str) -> SandboxMetrics:
        """CPU and memory from the sandbox's cgroups (v1), disk from its scratch filesystem."""
        rel = _REL + "/" + cid

        def num(ctrl: str, name: str) -> int:
            try:
                return int((CGROUP_ROOT / ctrl / rel / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return 0

        now = time.monotonic()
        usage = num("cpuacct", "cpuacct.usage")
        prev = self._samples.get(cid)
        if prev is None:  # no earlier sample to compare with: take a short one
            time.sleep(0.1)
            prev, now, usage = (now, usage), time.monotonic(), num("cpuacct", "cpuacct.usage")
        self._samples[cid] = (now, usage)
        quota, period = num("cpu", "cpu.cfs_quota_us"), num("cpu", "cpu.cfs_period_us")
        cores = quota / period if quota > 0 and period > 0 else float(os.cpu_count() or 1)
        dt = now - prev[0]
        pct = (usage - prev[1]) / 1e9 / dt / cores * 100 if dt > 0 and cores > 0 else 0.0
        disk_used = disk_total = 0
        if sdir:
            with contextlib.suppress(OSError):
                st = os.statvfs(sdir)
                disk_total = st.f_blocks * st.f_frsize
                disk_used = (st.f_blocks - st.f_bfree) * st.f_frsize
        return SandboxMetrics(
            at=time.time(), cpu_count=round(cores, 3), cpu_used_pct=round(max(0.0, pct), 2), cpu_usage_s=usage / 1e9,
            mem_used_bytes=num("memory", "memory.usage_in_bytes"), mem_total_bytes=num("memory", "memory.limit_in_bytes"),
            disk_used_bytes=disk_used, disk_total_bytes=disk_total,
        )

    def host_busy(self, idle_class: list[str] | None = None) -> float:
        """CPUs busy on this host since the last call, less what the ``idle_class`` containers
        (best-effort: SCHED_IDLE) used: latency-sensitive work takes those cycles back at once."""
        with open("/proc/stat") as f:
            vals = [float(x) for x in f.readline().split()[1:]]
        used: dict[str, int] = {}
        for cid in idle_class or []:
            try:
                used[cid] = int((CGROUP_ROOT / "cpuacct" / _REL / cid / "cpuacct.usage").read_text())
            except (OSError, ValueError):
                pass
        idle, total = vals[3] + vals[4], sum(vals)
        prev, self._host_prev = self._host_prev, (idle, total)
        before, self._idle_prev = self._idle_prev, used
        if prev is None or total <= prev[1]:
            return 0.0
        cpus = os.cpu_count() or 1
        busy = (1 - (idle - prev[0]) / (total - prev[1])) * cpus
        # /proc/stat counts USER_HZ ticks summed over CPUs: the window in seconds is total / cpus / HZ.
        window_s = (total - prev[1]) / cpus / os.sysconf("SC_CLK_TCK")
        given_up = sum(max(0, n - before[c]) for c, n in used.items() if c in before) / 1e9
        return max(0.0, busy - given_up / window_s) if window_s > 0 else busy


__all__ = [
    "CGROUP_ROOT", "LATENCY_WEIGHT", "MEM_CGROUP", "START_CPU", "Meter", "cgroup_path", "cgroups_of", "children", "class_shares", "cpu_class",
    "IDLE_PARENT", "in_cgroup", "kill", "memory_bytes", "park", "remove_cgroups", "set_class", "set_cpu", "set_limits", "unpark",
]
