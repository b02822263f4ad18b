"""The cgroup v1 freezer of a container sandbox: snapshots and pauses stop every task of it at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

from bus.errors import SnapshotUnsupported

FREEZER = Path("/sys/fs/cgroup/freezer")


def freezer_state_file(cgroup: str) -> Path:
    """``cgroup``: the container's cgroup path under each hierarchy (``/dsec/<container id>``)."""
    return FREEZER / cgroup.lstrip("/") / "freezer.state"


async def freeze(cgroup: str, timeout_s: float = 10.0) -> None:
    """Freeze every task of the cgroup and wait until the kernel says FROZEN (a task in an
    uninterruptible sleep holds it in FREEZING a while)."""
    f = freezer_state_file(cgroup)
    await asyncio.to_thread(f.write_text, "FROZEN")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    delay = 0.0005
    while (await asyncio.to_thread(f.read_text)).strip() != "FROZEN":
        if loop.time() > deadline:
            await asyncio.to_thread(f.write_text, "THAWED")
            raise SnapshotUnsupported(f"the sandbox did not freeze within {timeout_s:g}s (a task stuck in the kernel?)")
        await asyncio.sleep(delay)  # poll: the freezer has no notification in cgroup v1
        delay = min(delay * 2, 0.05)


async def thaw(cgroup: str) -> None:
    await asyncio.to_thread(freezer_state_file(cgroup).write_text, "THAWED")


def frozen(cgroup: str) -> bool:
    try:
        return freezer_state_file(cgroup).read_text().strip() == "FROZEN"
    except OSError:
        return False


__all__ = ["freeze", "frozen", "thaw"]
