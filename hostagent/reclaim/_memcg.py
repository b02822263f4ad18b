"""A sandbox's cgroup v1 memory and CPU accounting, and the one reclaim step the service takes on it.

cgroup v1 has no ``memory.reclaim``; ``memory.force_empty`` takes everything. A step lowers
``memory.limit_in_bytes`` to what should remain (the kernel reclaims page cache and, with swap,
anonymous memory to get there, or gives up with EBUSY) and puts the limit straight back. While the
limit is low the cgroup's OOM killer is off: a process of the sandbox that faults in that window
waits for the limit to come back instead of dying. The sandbox's own bound is ``memory.memsw``
(memory + swap, equal to its memory limit): swap never lets it hold more than it asked for, and the
service takes the limit to restore from it, so a step cut short by a crash is repaired by the next
service (``repair``)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
from pathlib import Path

from . import _pageout

MEMORY = Path("/sys/fs/cgroup/memory")
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
# Only sandbox cgroups, never another one a bad message names.
_CGROUP = re.compile(r"/dsec/[A-Za-z0-9_-]{1,128}")
PAGE = os.sysconf("SC_PAGE_SIZE")


def valid_cgroup(cgroup: str) -> bool:
    return _CGROUP.fullmatch(cgroup) is not None


def _mem(cgroup: str) -> Path:
    return MEMORY / cgroup.lstrip("/")


def _num(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def usage(cgroup: str) -> int | None:
    return _num(_mem(cgroup) / "memory.usage_in_bytes")


def cpu_ns(cgroup: str) -> int | None:
    return _num(CPUACCT / cgroup.lstrip("/") / "cpuacct.usage")


def runnable(cgroup: str) -> bool:
    """Whether a thread of the cgroup is running or waiting for a CPU: a best-effort sandbox that
    spins on a busy host gets next to no CPU time, and is not idle for that."""
    try:
        tids = (_mem(cgroup) / "tasks").read_text().split()
    except OSError:
        return False
    for tid in tids:
        try:
            with open(f"/proc/{tid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "R":
                    return True
        except (OSError, IndexError):
            continue
    return False


def stat(cgroup: str) -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in (_mem(cgroup) / "memory.stat").read_text().splitlines():
            k, _, v = line.partition(" ")
            if v.isdigit():
                out[k] = int(v)
    except OSError:
        pass
    return out


def cpu_class(cgroup: str) -> str:
    try:
        return "best-effort" if (Path("/sys/fs/cgroup/cpu") / cgroup.lstrip("/") / "cpu.idle").read_text().strip() == "1" else "latency-sensitive"
    except OSError:
        return ""


def merged_bytes(cgroup: str) -> int:
    """Pages of the sandbox's processes KSM merged (``/proc/<pid>/ksm_merging_pages``)."""
    total = 0
    try:
        pids = (_mem(cgroup) / "cgroup.procs").read_text().split()
    except OSError:
        return 0
    for pid in pids:
        n = _num(Path(f"/proc/{pid}/ksm_merging_pages"))
        total += n or 0
    return total * PAGE


def _own_limit(d: Path) -> int | None:
    """The sandbox's limit: memory+swap when the host accounts swap (equal to its memory limit)."""
    return _num(d / "memory.memsw.limit_in_bytes") or _num(d / "memory.limit_in_bytes")


def repair(cgroup: str) -> bool:
    """Put back a limit a step left low (the service died inside one); True when it did."""
    d = _mem(cgroup)
    own, cur = _own_limit(d), _num(d / "memory.limit_in_bytes")
    if own is None or cur is None or cur >= own:
        return False
    (d / "memory.limit_in_bytes").write_text(str(own))
    (d / "memory.oom_control").write_text("0")
    with contextlib.suppress(OSError):  # what a new cgroup inherits
        (d / "memory.swappiness").write_text((d.parent / "memory.swappiness").read_text().strip())
    return True


def reclaim_step(cgroup: str, want: int, keep: int, pageout: bool = False, agent_hot: bool = True) -> int:
    """Take up to ``want`` bytes from the cgroup, leaving at least ``keep``; the bytes it freed.
    ``pageout``: first page out the sandbox's own processes but its agent (``_pageout``), which
    goes below ``keep`` where the pages are theirs alone. ``agent_hot``: after a limit step (which
    takes the least recently used pages, the agent's too), fault the agent's pages back in."""
    d = _mem(cgroup)
    before, own = usage(cgroup), _own_limit(d)
    if before is None or own is None:
        return 0
    freed = 0
    if pageout:
        for pid in _pageout.sandbox_processes(d / "cgroup.procs"):
            _pageout.page_out(pid, "/" + cgroup.lstrip("/"))
        now = usage(cgroup)
        if now is None:
            return 0
        freed, before = max(0, before - now), now
    target = max(before - max(0, want - freed), keep)
    if target >= before:
        return freed
    oom, swappiness = d / "memory.oom_control", d / "memory.swappiness"
    was = swappiness.read_text().strip()
    oom.write_text("1")
    try:
        # Anonymous memory first: the page cache a sandbox holds is mostly the binaries its next
        # exec runs (shared with other sandboxes: dropped, it comes back from disk for all of them).
        with contextlib.suppress(OSError):
            swappiness.write_text("200")
        try:
            (d / "memory.limit_in_bytes").write_text(str(target))
        except OSError as exc:
            if exc.errno != errno.EBUSY:  # EBUSY: the kernel freed what it could, not down to target
                raise
    finally:
        (d / "memory.limit_in_bytes").write_text(str(own))
        swappiness.write_text(was)
        oom.write_text("0")
    if agent_hot:
        for pid in _pageout.agent_processes(d / "cgroup.procs"):
            _pageout.touch(pid, "/" + cgroup.lstrip("/"))
    after = usage(cgroup)
    return freed + (max(0, before - after) if after is not None else 0)


__all__ = ["PAGE", "cpu_class", "cpu_ns", "merged_bytes", "reclaim_step", "repair", "runnable", "stat", "usage", "valid_cgroup"]
