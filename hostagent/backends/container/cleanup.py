"""``python -m hostagent --cleanup --data-dir D``: remove from this machine everything a host agent of
data dir ``D`` may have left, whatever killed it: containers (with their agents, mounts, cgroups,
netns and scratch disks), the private containerd and its shims, layer mounts, and the network
config's nft table, veths and netns mounts.

Run it only while no host agent serves ``D`` (``dsec up`` runs it as its last step, after stopping
every service). Processes are stopped by pid, and only those whose command line names ``D``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from bus import log as _log

from .cgroups import CGROUP_ROOT, children
from .containerd import CGROUP_PARENT

log = _log.get_logger("dsec.hostagent.cleanup")


def _under(path: str, data_dir: str) -> bool:
    return path == data_dir or path.startswith(data_dir + "/")


def _ancestors() -> set[int]:
    """This process and its parents: whoever runs the clean-up (``dsec up``) names the data dir too."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def processes_naming(data_dir: str) -> dict[int, str]:
    """Live processes (not zombies, not this one or its parents) with an argument in or under ``data_dir``."""
    out: dict[int, str] = {}
    mine = _ancestors()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) in mine:
            continue
        try:
            with open(f"/proc/{d}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        # The FUSE holder names its mount in argv[0] ("dsec-fuse-holder:<mount>").
        if any(_under(a.split(":", 1)[-1], data_dir) or _under(a, data_dir) for a in argv if a):
            out[int(d)] = " ".join(argv).strip()
    return out


def mounts_under(data_dir: str) -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return [ln.split()[4] for ln in f if _under(ln.split()[4], data_dir)]


async def _containers(data_dir: str, network: Any) -> None:
    from .backend import ContainerBackend

    backend = ContainerBackend(data_dir, warm_pool=0, network=network)
    await backend.start()  # adopts (or starts) the data dir's containerd: it knows the shims' tasks
    try:
        await backend.recover({})  # no sandbox is known now: every container is an orphan and removed
    finally:
        await backend.stop()  # nothing left running: containerd stops, layer mounts go
    await backend.net.purge()


def _sandbox_cgroups(pid: int) -> set[Path]:
    """The per-sandbox cgroup dirs (``<controller>/dsec/<id>``) ``pid`` is in."""
    out: set[Path] = set()
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for ln in lines:
        _, controllers, path = ln.split(":", 2)
        if path.startswith(CGROUP_PARENT + "/") and controllers:
            for c in controllers.split(","):
                out.add(CGROUP_ROOT / c.removeprefix("name=") / path.lstrip("/"))
    return out


def _kill_all(procs: dict[int, str]) -> set[Path]:
    """SIGKILL ``procs`` (containerd first, so it restarts no shim; a shim's container inits before
    the shim, whose subreaper they are); returns the sandbox cgroups those inits were in."""
    cgroups: set[Path] = set()
    for pid in sorted(procs, key=lambda p: "containerd-shim" in procs[p]):
        victims = children(pid) if "containerd-shim" in procs[pid] else []
        for v in [*victims, pid]:
            cgroups |= _sandbox_cgroups(v)
            log.warning("cleanup_kill", pid=v, cmdline=procs.get(v, f"child of shim {pid}")[:200])
            with contextlib.suppress(ProcessLookupError):
                os.kill(v, signal.SIGKILL)
    return cgroups


async def _rmdir_cgroup(cg: Path, attempts: int = 50) -> None:
    for _ in range(attempts):
        try:
            cg.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:  # EBUSY: a killed task leaves its cgroup a moment after it is reaped
            await asyncio.sleep(0.1)
    log.error("cleanup_cgroup_busy", cgroup=str(cg))


async def cleanup(data_dir: str, network: Any = None) -> list[str]:
    """Remove what is left for ``data_dir`` (and the kernel objects of ``network``, a NetworkConfig);
    returns what was still there after the orderly part."""
    data_dir = os.path.realpath(data_dir)
    try:
        # A data dir that never had a containerd has no container to ask it about.
        if os.path.isdir(os.path.join(data_dir, "containerd")):
            await asyncio.wait_for(_containers(data_dir, network), 120)
    except Exception as exc:  # noqa: BLE001 - the sweep below still removes processes and mounts
        log.error("cleanup_containers_failed", error=f"{type(exc).__name__}: {exc}")
    procs = processes_naming(data_dir)
    found = [f"process {p}: {c[:120]}" for p, c in procs.items()]
    cgroups = _kill_all(procs)
    deadline = time.monotonic() + 10
    while processes_naming(data_dir) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # poll interval while killed processes exit
    for cg in sorted(cgroups, key=lambda p: len(p.parts), reverse=True):
        if cg.exists():
            found.append(f"cgroup {cg}")
            await _rmdir_cgroup(cg)
    for m in reversed(mounts_under(data_dir)):  # deepest first
        found.append(f"mount {m}")
        subprocess.run(["umount", "-l", m], capture_output=True)
    return found


def run_cleanup(data_dir: str, network: Any = None) -> int:
    left = asyncio.run(cleanup(data_dir, network))
    for item in left:
        log.warning("cleanup_removed", item=item)
    still = [f"process {p}" for p in processes_naming(os.path.realpath(data_dir))] + mounts_under(os.path.realpath(data_dir))
    if still:
        log.error("cleanup_incomplete", left=still)
        return 1
    log.info("cleanup_done", data_dir=data_dir)
    return 0
