"""Page out the memory of an idle sandbox's own processes (``process_madvise(MADV_PAGEOUT)``).

A memcg limit step takes the cgroup's least recently used pages, whichever process they belong to,
and stops at the service's ``keep`` floor so that the in-sandbox agent and the binaries of the next
exec stay resident. Most of what an idle sandbox holds is the heap of the processes that wait for
the model (an interpreter, a language server): this pages out exactly those — the private pages
of their anonymous mappings, to the swap — and leaves the agent, the page cache (the binaries the
next exec runs) and every page another process maps too where they are.
Nothing changes for the process but the time of its next touch of those pages: no limit moves,
so nothing can be OOM-killed by it."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
from collections.abc import Iterator
from pathlib import Path

# x86_64 and aarch64 alike (the generic syscall table numbers these the same since 5.x).
_SYS_PIDFD_OPEN = 434
_SYS_PROCESS_MADVISE = 440
MADV_PAGEOUT = 21
# The agent serves the sandbox's next operation: its pages stay.
AGENT_COMM = "dsec-agent"
# Mappings the kernel refuses to page out (special or locked): skipped, not an error.
_SPECIAL = ("[vvar", "[vsyscall]", "[vdso]", "[uprobes]")

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


def available() -> bool:
    """Whether this kernel has process_madvise (5.10+): probed on ourselves with no ranges."""
    fd = _libc.syscall(_SYS_PIDFD_OPEN, os.getpid(), 0)
    if fd < 0:
        return False
    try:
        return _libc.syscall(_SYS_PROCESS_MADVISE, fd, None, 0, MADV_PAGEOUT, 0) >= 0
    finally:
        os.close(fd)


def _ranges(pid: int, files: bool = False) -> list[tuple[int, int]]:
    """The process's anonymous mappings (heap, stack, its allocator's): a file mapping's pages are
    page cache, the binaries and libraries the next exec runs; the limit step's to take. ``files``:
    its readable file mappings too."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) > 5 else ""
            if path.startswith(_SPECIAL) or (path and not path.startswith("[") and not files) or not parts[1].startswith("r"):
                continue
            lo, _, hi = parts[0].partition("-")
            out.append((int(lo, 16), int(hi, 16)))
    return out


def _in_cgroup(pid: int, cgroup: str) -> bool:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return any(ln.rstrip("\n").split(":", 2)[1:] == ["memory", cgroup] for ln in f)
    except OSError:
        return False


@contextlib.contextmanager
def _pinned(pid: int, cgroup: str) -> Iterator[int | None]:
    """A pidfd of ``pid`` while it is in memory cgroup ``cgroup`` (None when it is gone or elsewhere).
    The cgroup is checked with the pidfd held: the pid cannot be reused for another process from then on."""
    fd = _libc.syscall(_SYS_PIDFD_OPEN, pid, 0)
    if fd < 0:
        yield None
        return
    try:
        yield fd if _in_cgroup(pid, cgroup) else None
    finally:
        os.close(fd)


def page_out(pid: int, cgroup: str) -> int:
    """Ask the kernel to page out ``pid``'s memory if it is (still) in memory cgroup ``cgroup``; the
    bytes of the ranges it took the advice on (what it really freed is less: shared and locked pages
    stay). 0 for a process that is gone or elsewhere."""
    done = 0
    with _pinned(pid, cgroup) as fd:
        if fd is None:
            return 0
        try:
            for lo, hi in _ranges(pid):
                iov = _IoVec(lo, hi - lo)
                n = _libc.syscall(_SYS_PROCESS_MADVISE, fd, ctypes.byref(iov), 1, MADV_PAGEOUT, 0)
                if n < 0 and ctypes.get_errno() == errno.ESRCH:
                    break  # it exited
                done += max(n, 0)
        except OSError:  # /proc/<pid>/maps gone: it exited
            pass
    return done


def _processes(procs: Path, agent: bool) -> list[int]:
    try:
        pids = [int(p) for p in procs.read_text().split()]
    except (OSError, ValueError):
        return []
    out = []
    for pid in pids:
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if (comm == AGENT_COMM) == agent:
            out.append(pid)
    return out


def sandbox_processes(procs: Path) -> list[int]:
    """The pids in a cgroup's ``cgroup.procs`` but the agent's."""
    return _processes(procs, agent=False)


def agent_processes(procs: Path) -> list[int]:
    """The in-sandbox agent's pid(s) in a cgroup's ``cgroup.procs``."""
    return _processes(procs, agent=True)


# What one touch reads at most: the agent maps about 1.6 MiB; anything far bigger is not the agent.
_TOUCH_MAX = 64 << 20


def touch(pid: int, cgroup: str) -> int:
    """Fault ``pid``'s pages back in by reading its memory (``/proc/<pid>/mem``), if it is (still) in
    memory cgroup ``cgroup``; the bytes read. For the agent after a limit step, which takes the
    cgroup's least recently used pages whoever's they are: the sandbox's next operation starts in
    the agent, and must not wait for its pages to come back from the swap or the disk. A page it
    never touched reads as the zero page: nothing is allocated."""
    done = 0
    with _pinned(pid, cgroup) as fd:
        if fd is None:
            return 0
        try:
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
                for lo, hi in _ranges(pid, files=True):
                    if done + (hi - lo) > _TOUCH_MAX:
                        break
                    try:
                        done += len(os.pread(mem.fileno(), hi - lo, lo))
                    except OSError:  # a guard page or a mapping gone meanwhile
                        continue
        except OSError:  # it exited
            pass
    return done


__all__ = ["AGENT_COMM", "agent_processes", "available", "page_out", "sandbox_processes", "touch"]
