"""Freezing and memory snapshots of a microVM.

Freezing is QEMU's ``stop``/``cont``; while stopped (after a ``sync`` in the guest: its upper disk is
an ext4 without a journal, so a synced disk is consistent) the disk is mounted read-only on the host
under ``<vm>/disk``, and ``<vm>/scratch/upper`` points into it: the host agent's snapshots diff it like
a container's upper dir. A memory snapshot is QEMU's migration stream to a file (RAM and device
state) plus the upper disk as a compact qcow2 and ``vm.json`` (what the restored QEMU must match);
a restore converts the disk back to a raw private copy and starts QEMU with ``-incoming``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from bus.errors import CreateFailed, SnapshotUnsupported

from . import qemu

STATE = "vm.state"
DISK = "upper.qcow2"
META = "vm.json"
MIGRATE_TIMEOUT_S = 600.0
# The layers of a VM with virtio-pmem layers are RAM to QEMU: the stream leaves them out (they are the
# template's blobs, mapped shared and read-only by the restored VM too).
IGNORE_SHARED = ("migrate-set-capabilities", {"capabilities": [{"capability": "x-ignore-shared", "state": True}]})


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True)


def mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def scratch_dir(vm_dir: str) -> str:
    return os.path.join(vm_dir, "scratch")


def is_frozen(vm_dir: str) -> bool:
    return os.path.exists(os.path.join(vm_dir, "frozen"))  # a file: a restarted host agent knows it too


async def freeze(vm_dir: str) -> None:
    await qemu.qmp(os.path.join(vm_dir, "qmp.sock"), ("stop", {}))
    Path(vm_dir, "frozen").touch()
    disk, scratch = os.path.join(vm_dir, "disk"), scratch_dir(vm_dir)
    os.makedirs(disk, exist_ok=True)
    os.makedirs(scratch, exist_ok=True)
    if not mounted(disk):
        r = await asyncio.to_thread(_run, ["mount", "-t", "ext4", "-o", "ro,loop,noload", os.path.join(vm_dir, "upper.img"), disk])
        if r.returncode != 0:
            raise SnapshotUnsupported(f"cannot read the microVM's disk: {r.stderr.strip()}")
    link = os.path.join(scratch, "upper")
    if not os.path.islink(link):
        os.symlink("../disk/upper", link)


async def release_disk(vm_dir: str) -> None:
    disk = os.path.join(vm_dir, "disk")
    if mounted(disk):
        await asyncio.to_thread(_run, ["umount", disk])  # mount(8) frees its loop device with it


async def thaw(vm_dir: str) -> None:
    await release_disk(vm_dir)
    await qemu.qmp(os.path.join(vm_dir, "qmp.sock"), ("cont", {}))
    Path(vm_dir, "frozen").unlink(missing_ok=True)


async def checkpoint(vm_dir: str, image_dir: str, meta: dict[str, Any]) -> None:
    """The (stopped) VM's RAM and devices, its disk and ``meta`` into ``image_dir``; it stays stopped."""
    qmp = os.path.join(vm_dir, "qmp.sock")
    state = os.path.join(image_dir, STATE)
    first = [IGNORE_SHARED] if meta.get("pmem") else []
    await qemu.qmp(qmp, *first, ("migrate", {"uri": f"exec:cat > {state}"}))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + MIGRATE_TIMEOUT_S
    while True:
        (info,) = await qemu.qmp(qmp, ("query-migrate", {}))
        status = info.get("status")
        if status == "completed":
            break
        if status in ("failed", "cancelled") or loop.time() > deadline:
            raise SnapshotUnsupported(f"QEMU could not save the microVM's memory: {info.get('error-desc', status)}")
        await asyncio.sleep(0.05)  # poll interval while QEMU writes the stream
    r = await asyncio.to_thread(_run, ["qemu-img", "convert", "-O", "qcow2", os.path.join(vm_dir, "upper.img"), os.path.join(image_dir, DISK)])
    if r.returncode != 0:
        raise SnapshotUnsupported(f"cannot copy the microVM's disk: {r.stderr.strip()}")
    Path(image_dir, META).write_text(json.dumps(meta))


def read_meta(image_dir: str) -> dict[str, Any]:
    try:
        meta: dict[str, Any] = json.loads(Path(image_dir, META).read_text())
    except (OSError, ValueError) as exc:
        raise CreateFailed(f"not a microVM memory snapshot: {exc}") from None
    return meta


def restore_disk(image_dir: str, upper: str) -> None:
    r = _run(["qemu-img", "convert", "-O", "raw", os.path.join(image_dir, DISK), upper])
    if r.returncode != 0:
        raise CreateFailed(f"cannot restore the microVM's disk: {r.stderr.strip()}")


async def incoming(vm_dir: str, image_dir: str, timeout_s: float = MIGRATE_TIMEOUT_S) -> None:
    """Feed the saved stream to a QEMU started with ``-incoming defer``; returns once the VM runs."""
    qmp = os.path.join(vm_dir, "qmp.sock")
    first = [IGNORE_SHARED] if read_meta(image_dir).get("pmem") else []
    await qemu.qmp(qmp, *first, ("migrate-incoming", {"uri": f"exec:cat {os.path.join(image_dir, STATE)}"}))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        (st,) = await qemu.qmp(qmp, ("query-status", {}))
        if st.get("status") == "running":
            return
        if st.get("status") not in ("inmigrate", "paused", "prelaunch") or loop.time() > deadline:
            raise CreateFailed(f"the microVM did not resume from its snapshot: {st.get('status')}")
        if st.get("status") == "paused":  # loaded, not started (a stream saved from a stopped VM)
            await qemu.qmp(qmp, ("cont", {}))
        await asyncio.sleep(0.05)  # poll interval while QEMU loads the stream


__all__ = ["checkpoint", "freeze", "incoming", "is_frozen", "read_meta", "release_disk", "restore_disk", "scratch_dir", "thaw"]
