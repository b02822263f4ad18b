"""QEMU for the microvm backend: the command line of one microVM, the timed probe that picks KVM or
TCG, a minimal QMP client, and how a VM's QEMU process is found again by its pid file."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Accel = Literal["kvm", "tcg"]
Machine = Literal["microvm", "q35"]
QEMU = "qemu-system-x86_64"
PMEM_ALIGN = 2 << 20  # a virtio-pmem region's size: whole 2 MiB pages (the guest maps it with ZONE_DEVICE)
PMEM_SLOT = 0x10  # layer i's virtio-pmem device sits in PCI slot PMEM_SLOT + i: how the guest tells them apart
PMEM_MAX_LAYERS = 15  # slots 0x10..0x1e; a template with more layers gets virtio-blk disks
PROBE_TIMEOUT_S = 8.0  # KVM boots the probe in well under a second; a PVM host's /dev/kvm hangs it


def qemu_binary() -> str | None:
    return shutil.which(QEMU)


def tsc_khz() -> int:
    """The host's TSC rate: under TCG the guest's TSC is the host's, and the guest cannot measure
    it on this machine type (no PIT or HPET to calibrate against; it would hang)."""
    try:
        with open("/proc/cpuinfo") as f:
            mhz = next(float(ln.split(":")[1]) for ln in f if ln.startswith("cpu MHz"))
        return int(mhz * 1000)
    except (OSError, StopIteration, ValueError):
        return 2_000_000


def kernel_cmdline(layers: int, extra: str = "") -> str:
    khz = tsc_khz()
    return (f"console=ttyS0 quiet panic=-1 tsc_early_khz={khz} lpj={khz * 4} "  # lpj: khz*1000/HZ (250)
            f"dsec_layers={layers} {extra}").strip()


@dataclass(frozen=True)
class NetSpec:
    """The VM's NIC: the tap ``tap`` in the netns at ``netns`` (bridged there to the veth whose host
    end carries the egress rules); the guest's eth0 gets ``ip``/30 with its default route via ``gateway``."""

    netns: str
    tap: str
    ip: str
    gateway: str
    mac: str


@dataclass
class VMSpec:
    """One microVM: files in ``dir`` (QMP and serial sockets, pid file, console log, upper disk)."""

    dir: str
    kernel: str
    initrd: str
    accel: Accel
    vcpus: int = 1
    memory_mb: int = 256
    layers: list[str] = field(default_factory=list)  # EROFS blobs, bottom first
    upper: str = ""  # the raw ext4 disk of the overlay's upper dir
    name: str = ""
    incoming: str = ""  # a memory snapshot's dir: QEMU waits for its stream (snapshot.incoming)
    cmdline_extra: str = ""
    machine: Machine = "microvm"  # q35: the full-VM backend's PC with a display (PCI devices)
    net: NetSpec | None = None  # a NIC: QEMU runs in the sandbox's netns, on its tap
    # layers as virtio-pmem regions mapping the blobs read-only and shared (each blob's size a
    # multiple of PMEM_ALIGN): every VM's guest reads the host's one page-cache copy, with DAX in place
    pmem: bool = False
    # virtio-balloon with free page reporting (never inflated): the guest reports the 2 MiB blocks
    # it has freed (the initramfs, boot-time allocations, page cache it dropped) and QEMU drops
    # them from its RAM. Off only for a snapshot saved without the device (the stream must match).
    balloon: bool = True
    # TCG's translation cache, MiB (0: QEMU's default, up to 1 GiB). It is QEMU's anonymous memory and
    # grows with the guest code translated: an idle microVM's boot fills ~55 MiB of it; capped, TCG
    # flushes and translates again, which a booted, mostly idle sandbox seldom needs.
    tcg_tb_mb: int = 0

    def path(self, name: str) -> str:
        return os.path.join(self.dir, name)

    def argv(self, daemonize: bool = True) -> list[str]:
        tcg = f"tcg,tb-size={self.tcg_tb_mb}" if self.tcg_tb_mb else "tcg"
        cpu = ["-accel", "kvm", "-cpu", "host"] if self.accel == "kvm" else ["-accel", tcg, "-cpu", "max"]
        # virtio-pmem needs the PC machine: QEMU's microvm has no device-memory area to map a region in
        # (it plugs one at guest address 0, which the guest cannot claim), so a microVM with pmem
        # layers is a q35 without a display.
        pc = self.machine == "q35" or self.pmem
        bus = "pci" if pc else "device"  # virtio-pci or virtio-mmio devices
        # microvm: ACPI stays on, it is how this kernel finds the virtio-mmio devices (no cmdline devices)
        machine = ["-M", "microvm,acpi=on,rtc=on"] if not pc else ["-M", "q35", "-vga", "std" if self.machine == "q35" else "none"]
        extra = self.cmdline_extra if self.machine == "microvm" else f"console=tty0 {self.cmdline_extra}"
        if pc:
            # The PC's memory-hotplug range (the pmem regions' device memory, above 4 GiB) makes the
            # kernel expect RAM beyond 32-bit DMA and set aside 64 MiB of bounce buffers (SWIOTLB),
            # zeroed at boot: 64 MiB less for the guest and 64 MiB more of QEMU's RAM touched. No
            # device here bounces: virtio without VIRTIO_F_ACCESS_PLATFORM bypasses the DMA API,
            # and the VGA framebuffer is not DMA.
            extra = f"swiotlb=noforce {extra}"
        memory = str(self.memory_mb)
        if self.pmem:
            extra = f"{extra} dsec_pmem=1"
            regions = sum(os.path.getsize(b) for b in self.layers) >> 20
            memory = f"{self.memory_mb},slots={len(self.layers)},maxmem={self.memory_mb + regions}M"
        if self.net is not None:
            extra = f"{extra} dsec_ip={self.net.ip} dsec_gw={self.net.gateway}"
        # With a NIC, QEMU itself runs in the sandbox's netns: it opens the tap there, and it can
        # reach nothing of the host's network either.
        a = ["nsenter", f"--net={self.net.netns}", "--"] if self.net is not None else []
        a += [
            QEMU, "-name", self.name or "dsec-microvm",
            *machine, *cpu, "-m", memory, "-smp", str(self.vcpus),
            "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-kernel", self.kernel, "-initrd", self.initrd, "-append", kernel_cmdline(len(self.layers), extra),
            "-serial", f"file:{self.path('console.log')}",
            "-qmp", f"unix:{self.path('qmp.sock')},server=on,wait=off",
            "-pidfile", self.path("qemu.pid"),
        ]
        if self.upper:
            a += ["-device", f"virtio-serial-{bus}",
                  "-chardev", f"socket,id=agent,path={self.path('serial.sock')},server=on,wait=off",
                  "-device", "virtserialport,chardev=agent,name=dsec.agent",
                  "-drive", f"id=upper,file={self.upper},format=raw,if=none,cache=unsafe,discard=unmap",
                  "-device", f"virtio-blk-{bus},drive=upper,serial=upper"]
        for i, blob in enumerate(self.layers):
            if self.pmem:
                a += ["-object", f"memory-backend-file,id=l{i},mem-path={blob},size={os.path.getsize(blob)},share=on,readonly=on",
                      "-device", f"virtio-pmem-pci,memdev=l{i},id=layer{i},addr={PMEM_SLOT + i:#x}"]
                continue
            a += ["-drive", f"id=l{i},file={blob},format=raw,if=none,readonly=on",
                  "-device", f"virtio-blk-{bus},drive=l{i},serial=layer{i}"]
        if self.balloon:
            a += ["-device", f"virtio-balloon-{bus},free-page-reporting=on"]
        if self.net is not None:
            a += ["-netdev", f"tap,id=n0,ifname={self.net.tap},script=no,downscript=no",
                  "-device", f"virtio-net-{bus},netdev=n0,mac={self.net.mac}"]
        if self.machine == "q35":
            a += ["-device", "virtio-tablet-pci"]  # absolute pointer events (clicks); the guest kernel has no USB
        if self.incoming:
            a += ["-incoming", "defer"]
        if daemonize:
            a.append("-daemonize")
        return a


async def launch(spec: VMSpec) -> int:
    """Start QEMU detached from us (it outlives a restarting host agent); its pid."""
    proc = await asyncio.create_subprocess_exec(
        *spec.argv(), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"qemu exited {proc.returncode}: {(err or out).decode(errors='replace').strip()[-800:]}")
    pid = read_pid(spec.dir)
    if pid is None:
        raise RuntimeError("qemu wrote no pid file")
    return pid


def read_pid(vm_dir: str) -> int | None:
    """The VM's QEMU pid, if that process still runs and is the QEMU of this dir."""
    try:
        pid = int(Path(vm_dir, "qemu.pid").read_text().strip())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError):
        return None
    return pid if state != "Z" and os.path.join(vm_dir, "qmp.sock").encode() in cmd else None


def kill(vm_dir: str) -> int | None:
    """SIGKILL the dir's QEMU (checked by its command line first); the pid it had."""
    pid = read_pid(vm_dir)
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return pid


def rss_mb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) // 1024
    except (OSError, StopIteration, ValueError):
        return 0


class QMPError(RuntimeError):
    pass


async def qmp(sock: str, *commands: tuple[str, dict[str, Any]], timeout: float = 30.0) -> list[Any]:
    """Run ``commands`` over one short QMP session; their returns."""

    async def run() -> list[Any]:
        r, w = await asyncio.open_unix_connection(sock)
        try:
            await r.readline()  # greeting

            async def call(name: str, args: dict[str, Any]) -> Any:
                w.write(json.dumps({"execute": name, "arguments": args}).encode() + b"\n")
                await w.drain()
                while True:
                    line = await r.readline()
                    if not line:
                        raise QMPError(f"QMP closed during {name}")
                    msg = json.loads(line)
                    if "return" in msg:
                        return msg["return"]
                    if "error" in msg:
                        raise QMPError(f"{name}: {msg['error'].get('desc', msg['error'])}")

            await call("qmp_capabilities", {})
            return [await call(n, a) for n, a in commands]
        finally:
            w.close()

    return await asyncio.wait_for(run(), timeout)


async def probe_accel(kernel: str, initrd: str, timeout_s: float = PROBE_TIMEOUT_S) -> Accel:
    """KVM when it boots the probe guest (which prints ``dsec-probe-ok`` and reboots) in time, else TCG."""
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "tcg"
    d = tempfile.mkdtemp(prefix="dsec-kvmprobe-")
    spec = VMSpec(d, kernel, initrd, "kvm", memory_mb=128, cmdline_extra="dsec_probe=1")
    proc = await asyncio.create_subprocess_exec(
        *spec.argv(daemonize=False), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        await asyncio.wait_for(proc.wait(), timeout_s)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
    try:
        ok = "dsec-probe-ok" in Path(spec.path("console.log")).read_text(errors="replace")
    except OSError:
        ok = False
    shutil.rmtree(d, ignore_errors=True)
    return "kvm" if ok else "tcg"


__all__ = [
    "PMEM_ALIGN", "PMEM_MAX_LAYERS", "Accel", "Machine", "NetSpec", "QMPError", "VMSpec", "kill", "launch", "probe_accel", "qemu_binary",
    "qmp", "read_pid", "rss_mb",
]
