"""CRIU through runc: a sandbox's processes dumped (memory snapshots) and restored into a fresh
container."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

from bus.errors import CreateFailed, SnapshotUnsupported

from .containerd import ContainerdError, ContainerRuntime


def criu_log(work_dir: str, name: str) -> str:
    """The errors of CRIU's log (runc keeps it in the work dir), for the error a caller sees."""
    try:
        with open(os.path.join(work_dir, name), errors="replace") as f:
            errs = [ln.strip() for ln in f if "Error" in ln]
    except OSError:
        return ""
    return ("; criu: " + " | ".join(errs[-4:])) if errs else ""


def loopback_up(pid: int) -> None:
    """CRIU restores the sandbox's own netns with ``lo`` down (runc sets it up only on a fresh start):
    up again, the kernel gives it 127.0.0.1 back and the restored listeners are reachable."""
    r = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise CreateFailed(f"cannot bring the restored sandbox's loopback up: {r.stderr.strip()}")


@contextlib.asynccontextmanager
async def restore_work_dir(data_dir: Path, sid: str) -> AsyncIterator[str]:
    """CRIU's scratch dir for one restore, empty at the start and gone after."""
    work = data_dir / "criu" / sid
    await asyncio.to_thread(shutil.rmtree, work, True)
    work.mkdir(parents=True)
    try:
        yield str(work)
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


def restore_failed(exc: ContainerdError, work_dir: str) -> CreateFailed:
    return CreateFailed(f"CRIU could not restore the sandbox's processes: {exc}{criu_log(work_dir, 'restore.log')}")


async def checkpoint(rt: ContainerRuntime, cid: str, image_dir: str, work_dir: str) -> None:
    """CRIU-dump the container's processes into ``image_dir`` (whole memory: no soft-dirty tracking
    here); the sandbox runs on (or stays frozen, if it was)."""
    try:
        await rt.checkpoint(cid, image_dir, work_dir, exit=False)
    except ContainerdError as exc:
        raise SnapshotUnsupported(f"CRIU could not checkpoint the sandbox: {exc}{criu_log(work_dir, 'dump.log')}") from None


__all__ = ["checkpoint", "criu_log", "loopback_up", "restore_failed", "restore_work_dir"]
