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

# Every container starts with at least this CPU share (runc init, the agent's start-up), and gets
# its own once its agent answers: a small share (0.02 is 2 ms per 100 ms) must not slow its start.
START_CPU = 1.0


def cgroup_path(cid: str) -> str:
    """The container's cgroup path under each hierarchy (``/dsec/<container id>``)."""
    return f"{CGROUP_PARENT}/{cid}"


def set_cpu(cid: str, cpu: float) -> None:
    """Apply a CPU share straight to the container's cgroup v1 files (no runc round trip)."""
    base = CGROUP_ROOT / "cpu" / _REL / cid
    shares, quota = cpu_limits(cpu)
    (base / "cpu.shares").write_text(str(shares))
    (base / "cpu.cfs_quota_us").write_text(str(quota))


# CPU classes. A latency-sensitive sandbox's weight is its CPU share times this; a best-effort one's
# cgroup is SCHED_IDLE (``cpu.idle``): against any non-idle sibling (a latency-sensitive sandbox) it
# gets the kernel's minimum weight and never preempts it on wake-up, so it runs on the cycles the
# others leave. Set on the sandbox's own cgroup, not a shared class parent: a warm container's
# cgroup path is fixed when it is pre-started, before the class of the sandbox that claims it is
# known. The quota (its CPU share) stays only an upper bound.
#
# An idle cgroup is idle only against its siblings: ``/dsec`` itself, where best-effort work runs,
# is a plain busy group against the host agent, NATS and every other task at the top, so their
# wake-ups waited out a best-effort spinner's slice (the latency-sensitive exec path crosses a few:
# +7% at 50% load, more at 100%). So the best-effort sandbox's threads are SCHED_IDLE tasks as well
# (what its agent forks inherits the policy; without CAP_SYS_NICE nothing inside can leave it): the
# kernel lets any other task that wakes preempt an idle-policy one at once, whatever its cgroup, and
# counts a core running only those as idle when it places a wake-up. Host services sit outside
# ``/dsec`` with the normal weight of one group: best-effort work still gets its fair share against
# the rest of the host's work (a top-level idle parent would starve it, its agent too, on a busy host).
LATENCY_WEIGHT = 8
MAX_SHARES = 262144
_POLICY_PASSES = 5  # a thread started while the policy is set is caught by the next pass


def class_shares(cpu: float, priority: str) -> int:
    shares = cpu_limits(cpu)[0]
    return min(MAX_SHARES, shares * LATENCY_WEIGHT) if priority == "latency-sensitive" else shares


def set_class(cid: str, cpu: float, priority: str) -> None:
    """Put the container's cgroup in the CPU class of ``priority``, and its threads in the class's
    scheduling policy. The kernel refuses a weight on an idle group (EINVAL), so the idle flag is
    cleared first and set last."""
    base = CGROUP_ROOT / "cpu" / _REL / cid
    idle = base / "cpu.idle"
    if idle.exists():
        idle.write_text("0")
    (base / "cpu.shares").write_text(str(class_shares(cpu, priority)))
    if priority == "best-effort" and idle.exists():
        idle.write_text("1")
    set_policy(base / "tasks", priority == "best-effort")


def set_policy(tasks: Path, idle: bool) -> None:
    """Every thread listed in ``tasks`` SCHED_IDLE (``idle``) or, if it is SCHED_IDLE, SCHED_OTHER."""
    want = os.SCHED_IDLE if idle else os.SCHED_OTHER
    param = os.sched_param(0)
    for _ in range(_POLICY_PASSES):
        changed = 0
        for tid in tasks.read_text().split():
            try:
                now = os.sched_getscheduler(int(tid))
                if now != want and (idle or now == os.SCHED_IDLE):
                    os.sched_setscheduler(int(tid), want, param)
                    changed += 1
            except ProcessLookupError:  # exited meanwhile
                pass
        if not changed:
            return


def task_policy_idle(cid: str) -> bool:
    """Whether every thread of the container runs SCHED_IDLE (for tests and the dashboard's word)."""
    try:
        tids = (CGROUP_ROOT / "cpu" / _REL / cid / "tasks").read_text().split()
    except OSError:
        return False
    out = True
    for tid in tids:
        try:
            out = out and os.sched_getscheduler(int(tid)) == os.SCHED_IDLE
        except ProcessLookupError:
            pass
    return bool(tids) and out


def cpu_class(cid: str) -> Priority | None:
    """The class the container's cgroup is in (None: no cgroup)."""
    try:
        idle = (CGROUP_ROOT / "cpu" / _REL / cid / "cpu.idle").read_text().strip()
    except OSError:
        return None
    return "best-effort" if idle == "1" else "latency-sensitive"


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
    return [p for p in CGROUP_ROOT.glob(f"*/{_REL}/{cid}") if p.is_dir()]


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
    "in_cgroup", "kill", "memory_bytes", "remove_cgroups", "set_class", "set_cpu", "set_limits", "set_policy", "task_policy_idle",
]
