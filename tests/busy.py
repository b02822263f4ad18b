"""CPU contention for tests and benchmarks: busy neighbours of the sandboxes."""

from __future__ import annotations

import os
from typing import Any


class BusyNeighbours:
    """``n`` busy loops in a cgroup of their own beside the sandboxes' (``cpu:/<CGROUP_PARENT>/``),
    not idle, with the weight of a one-CPU sandbox's: other tenants' busy sandboxes, as a shared
    host has them. Bounded by the sandboxes' share of the host: the rest of it hardly feels them.
    (``with BusyNeighbours(2, uid):``; 0: none.)"""

    def __init__(self, n: int, uid: str) -> None:
        from hostagent.backends.container.cgroups import CGROUP_ROOT, _REL

        self.n = n
        self.dir = CGROUP_ROOT / "cpu" / _REL / f"busy-{uid}"
        self.procs: list[Any] = []

    def __enter__(self) -> "BusyNeighbours":
        import subprocess

        if not self.n:
            return self
        self.dir.mkdir(exist_ok=True)
        if (self.dir / "cpu.idle").exists():
            (self.dir / "cpu.idle").write_text("0")
        (self.dir / "cpu.shares").write_text("1024")
        try:
            for _ in range(self.n):
                # (busy while this process lives: a run killed before its cleanup leaves no loop behind)
                p = subprocess.Popen(["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do :; done"])
                self.procs.append(p)
                (self.dir / "cgroup.procs").write_text(str(p.pid))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for p in self.procs:
            p.kill()
            p.wait()
        if self.dir.exists():
            self.dir.rmdir()


__all__ = ["BusyNeighbours"]
