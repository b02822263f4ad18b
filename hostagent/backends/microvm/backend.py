"""The ``microvm`` backend: one QEMU ``-M microvm`` guest per sandbox (its own kernel: a kernel
exploit inside stays inside), booted from an initramfs whose ``/init`` is the dsec agent, root on the
template's EROFS layers (read-only virtio disks) under an overlay on a private ext4 disk. The host
reaches the agent through virtio-serial (``serialmux``); QEMU runs detached, so a restarted host
agent reattaches to it (``recover``). A VM with a network gets a container's sandbox network with a
tap on it (``net``), QEMU running in its netns."""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import structlog

from bus.errors import CreateFailed, ImageError, NotSupported, SnapshotUnsupported
from bus.messages import BackendName, ExecRequest, ExecResult, FileOp, HostBackend, LayerRef, SandboxSpec

from ..._agent import AgentClient, AgentError, ensure_agent_binary
from ..._agentops import agent_exec, agent_files, agent_of
from ..._backend import Handle, HostCapacity, OnOutput, OnStart, Usage
from ..._profiles import Enforcement
from ...network import NetworkConfig, NetworkManager
from . import net, qemu, snapshot
from .kernel import GUEST_MODULES, PACKAGE, PMEM_MODULES, Kernel, build_initramfs, ensure_kernel, has_pmem_dax
from .serialmux import SerialMux

log = structlog.get_logger("dsec.hostagent.microvm")

BOOT_TIMEOUT_S = 90.0  # TCG on a busy host; KVM boots in a fraction of it
MIN_MEMORY_MB = 160  # the cloud kernel and its initramfs
DEFAULT_DISK_MB = 1024
# How the template's layers reach the guest: virtio-pmem regions it reads in place with DAX (one copy
# in the host's page cache for every VM on the host), or read-only virtio-blk disks (each guest
# caches what it reads in its own RAM). "virtio-pmem" is the choice before a guest confirmed DAX.
LayerMode = Literal["virtio-pmem+dax", "virtio-pmem", "virtio-blk"]


class MicroVMBackend:
    """Sandboxes as QEMU microVMs (KVM when the probe boots, else TCG)."""

    name: BackendName = "microvm"
    machine: qemu.Machine = "microvm"
    modules: tuple[str, ...] = GUEST_MODULES
    kernel_package = PACKAGE
    tcg_tb_mb = 32  # TCG's translation cache per VM: the boot of the cloud kernel and agent fits (qemu.VMSpec)

    def __init__(
        self, data_dir: str, *, kernel_cache: str | None = None, accel: str | None = None, lazy_mount: str | None = None,
        network: NetworkConfig | None = None, layers: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.root = self.data_dir / "mvm"  # short: the VM's unix socket paths must fit in 107 bytes
        self.vms = self.root / "vms"
        self.kernel_cache = kernel_cache or str(self.root / "kernel")
        self.lazy_mount = lazy_mount or str(self.data_dir / "lazy")
        self.forced_accel = accel
        self.forced_layers = layers  # "blk": never virtio-pmem; "pmem": even if a guest found no DAX before
        self.layer_mode: LayerMode = "virtio-blk"
        self.accel: qemu.Accel = "tcg"
        self.kernel: Kernel | None = None
        self.initrd = ""
        self.links: dict[str, SerialMux] = {}
        self.clients: dict[str, AgentClient] = {}
        self._layer_locks: dict[str, asyncio.Lock] = {}
        self._memory_users: dict[str, int] = {}  # memory layer mounted for restores -> restores reading it
        self.net = NetworkManager(network or NetworkConfig.from_env())  # the container's netns + egress rules, a tap on them

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        if qemu.qemu_binary() is None:
            raise CreateFailed("qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)")
        self.vms.mkdir(parents=True, exist_ok=True)
        self.kernel = await asyncio.to_thread(ensure_kernel, self.kernel_cache, self.kernel_package)
        agent = await asyncio.to_thread(ensure_agent_binary, str(self.data_dir))
        self.layer_mode = self._layer_mode()
        modules = self.modules + (PMEM_MODULES if self.layer_mode != "virtio-blk" else ())
        self.initrd = await asyncio.to_thread(build_initramfs, agent, self.kernel, str(self.root), tuple(dict.fromkeys(modules)))
        if self.forced_accel in ("kvm", "tcg"):
            self.accel = "kvm" if self.forced_accel == "kvm" else "tcg"
        else:
            self.accel = await self._probe()
        await self.net.start()
        log.info("microvm_backend", accel=self.accel, kernel=self.kernel.release, layers=self.layer_mode)

    def _layer_mode(self) -> LayerMode:
        """virtio-pmem when the guest kernel has what DAX needs, unless a guest here found otherwise."""
        assert self.kernel is not None
        if self.forced_layers == "blk" or not has_pmem_dax(self.kernel):
            return "virtio-blk"
        try:
            if self.forced_layers != "pmem" and self._layers_memo().read_text().strip() == "virtio-blk":
                return "virtio-blk"
        except OSError:
            pass
        return "virtio-pmem"

    def _layers_memo(self) -> Path:
        assert self.kernel is not None
        return self.root / f"layers-{self.kernel.release}"

    async def _check_dax(self, sid: str) -> None:
        """The first guest's report of how it mounted its layers (``/run/dsec/layers``): all DAX
        confirms virtio-pmem; anything else falls back to virtio-blk for the VMs that follow."""
        res = await self.exec(Handle(sid), ExecRequest(cmd="cat /run/dsec/layers"), None)
        got = {ln.split()[-1] for ln in res.stdout.decode(errors="replace").splitlines() if ln.strip()}
        if res.exit_code == 0 and got == {"dax"}:
            self.layer_mode = "virtio-pmem+dax"
            return
        log.warning("microvm_no_dax", sandbox_id=sid, report=res.stdout.decode(errors="replace").strip())
        self.layer_mode = "virtio-blk"
        self._layers_memo().write_text("virtio-blk")

    async def _probe(self) -> qemu.Accel:
        """The probe's answer, kept per kernel in the data dir (a restart does not boot it again)."""
        assert self.kernel is not None
        memo = self.root / f"accel-{self.kernel.release}"
        try:
            known = memo.read_text().strip()
            if known in ("kvm", "tcg"):
                return "kvm" if known == "kvm" else "tcg"
        except OSError:
            pass
        found = await qemu.probe_accel(self.kernel.vmlinuz, self.initrd)
        memo.write_text(found)
        return found

    async def stop(self) -> None:
        # The VMs run on: a restarted host agent reattaches (recover); destroy() ends them.
        for sid in list(self.links):
            await self._detach(sid)
        await self.net.stop()  # kernel state (netns, tap, nft) stays for the VMs that run on

    async def _detach(self, sid: str) -> None:
        client = self.clients.pop(sid, None)
        if client is not None:
            client.close_idle()
        link = self.links.pop(sid, None)
        if link is not None:
            await link.close()

    # --- what the host agent advertises ----------------------------------------------------------
    def capacity(self) -> HostCapacity:
        return HostCapacity.of_host(self.data_dir)

    def advertise(self) -> HostBackend:
        kernel = self.kernel.release if self.kernel else ""
        detail = {"accel": self.accel, "kernel": kernel, "layers": self.layer_mode}
        return HostBackend(name=self.name, max_cpu=float(os.cpu_count() or 1), detail=detail)

    # --- create / destroy -------------------------------------------------------------------
    def _dir(self, sid: str) -> str:
        return str(self.vms / sid)

    async def _blob(self, ref: LayerRef) -> str:
        """The layer as an EROFS file QEMU can attach: its blob (or the lazy loader's file of it); a
        ``dir`` layer is packed once with mkfs.erofs into the backend's cache."""
        if ref.kind == "erofs":
            hexd = ref.digest.split(":", 1)[-1]
            return ref.path if ref.path and os.path.exists(ref.path) else os.path.join(self.lazy_mount, hexd)
        if ref.kind != "dir":
            raise ImageError(f"layer {ref.digest}: unknown kind {ref.kind!r}")
        if not ref.path or not os.path.isdir(ref.path):
            raise ImageError(f"layer {ref.digest} ({ref.role}) directory {ref.path!r} is missing on this host")
        key = hashlib.sha256(f"{ref.digest}\0{ref.path}".encode()).hexdigest()[:24]
        out = self.root / "layers" / f"{key}.erofs"
        async with self._layer_locks.setdefault(key, asyncio.Lock()):
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".pack-")
                os.close(fd)
                r = await asyncio.to_thread(subprocess.run, ["mkfs.erofs", "--quiet", tmp, ref.path], capture_output=True, text=True)
                if r.returncode != 0:
                    os.unlink(tmp)
                    raise ImageError(f"cannot pack layer {ref.digest} as EROFS: {r.stderr.strip()}")
                _pad(tmp)
                os.rename(tmp, out)
        return str(out)

    async def _pmem_blob(self, ref: LayerRef) -> str:
        """The layer's blob with a size virtio-pmem can map: the blob itself when it has one, else
        one zero-padded copy per host (EROFS ignores what follows its last block)."""
        blob = await self._blob(ref)
        if os.path.getsize(blob) % qemu.PMEM_ALIGN == 0:
            return blob
        key = hashlib.sha256(f"{ref.digest}\0{blob}".encode()).hexdigest()[:24]
        out = self.root / "layers" / f"{key}.pmem"
        async with self._layer_locks.setdefault(f"pmem-{key}", asyncio.Lock()):
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=".pad-")
                os.close(fd)
                r = await asyncio.to_thread(subprocess.run, ["cp", "--reflink=auto", blob, tmp], capture_output=True, text=True)
                if r.returncode != 0:
                    os.unlink(tmp)
                    raise ImageError(f"cannot copy layer {ref.digest}: {r.stderr.strip()}")
                _pad(tmp)
                os.rename(tmp, out)
        return str(out)

    async def create(
        self, spec: SandboxSpec, layers: list[LayerRef], *, security: Enforcement | None = None, memory: LayerRef | None = None,
    ) -> Handle:
        """Boot a microVM over ``layers``; with ``memory`` (a memory snapshot, packed as a layer) the
        VM resumes where the snapshot stopped it instead: its RAM, devices and disk."""
        sid = spec.sandbox_id
        if not layers:
            raise ImageError(f"template {spec.template!r} has no layers")
        assert self.kernel is not None, "the microvm backend is not started"
        if self.net.wanted(spec.network) and memory is not None:
            # The saved devices have no NIC, and the saved guest holds another sandbox's address.
            raise NotSupported("a microVM restored from a memory snapshot cannot be given a network")
        d = self._dir(sid)
        await self._remove(sid)  # a retried create starts clean
        os.makedirs(d)
        upper = os.path.join(d, "upper.img")
        mem_dir = ""
        nic: qemu.NetSpec | None = None
        att = None
        try:
            if self.net.wanted(spec.network):
                assert spec.network is not None
                att = await self.net.setup(sid, spec.network)  # torn down by _remove() if anything below fails
                nic = await asyncio.to_thread(net.plumb, att, sid)
            vcpus, memory_mb = max(1, math.ceil(spec.cpu)), max(MIN_MEMORY_MB, spec.memory_mb)
            pmem = self.layer_mode != "virtio-blk" and len(layers) <= qemu.PMEM_MAX_LAYERS
            balloon = True
            if memory is not None:
                mem_dir = await self._mount_memory(memory)
                meta = snapshot.read_meta(mem_dir)
                # The snapshot's own file layers are in its disk already: the VM gets the devices it had.
                layers, vcpus, memory_mb = layers[:int(meta["layers"])], int(meta["vcpus"]), int(meta["memory_mb"])
                pmem = bool(meta.get("pmem", False))
                balloon = bool(meta.get("balloon", False))  # a snapshot from before the device had none
                await asyncio.to_thread(snapshot.restore_disk, mem_dir, upper)
            else:
                await asyncio.to_thread(_make_disk, upper, spec.disk_mb or DEFAULT_DISK_MB)
            # bottom first, as the guest's init numbers them
            blobs = [await (self._pmem_blob(layer) if pmem else self._blob(layer)) for layer in layers]
            vm = qemu.VMSpec(
                d, self.kernel.vmlinuz, self.initrd, self.accel, vcpus=vcpus, memory_mb=memory_mb, layers=blobs, upper=upper,
                name=f"dsec-{sid}", incoming=mem_dir, machine=self.machine, net=nic, pmem=pmem, balloon=balloon,
                tcg_tb_mb=self.tcg_tb_mb,
            )
            pid = await qemu.launch(vm)
            if mem_dir:
                await snapshot.incoming(d, mem_dir)
            await self._attach(sid, BOOT_TIMEOUT_S)
            if att is not None and att.hosts:
                await self.exec(Handle(sid), ExecRequest(cmd=net.hosts_script(att.hosts)), None)
            if not mem_dir:
                if pmem and self.layer_mode == "virtio-pmem":
                    await self._check_dax(sid)
                await self._booted(sid)
        except (OSError, RuntimeError, AgentError, asyncio.TimeoutError) as exc:
            console = _tail(os.path.join(d, "console.log"))
            await self._remove(sid)
            raise CreateFailed(f"the microVM did not start: {exc}; console: {console}") from None
        except BaseException:
            await self._remove(sid)
            raise
        finally:
            if memory is not None:
                await self._unmount_memory(memory)
        extra = {"dir": d, "accel": self.accel, "vcpus": vcpus, "memory_mb": memory_mb, "layers": len(blobs), "pmem": pmem, "balloon": balloon}
        return Handle(sid, pid, extra | ({"net": att.to_extra()} if att is not None else {}))

    async def _booted(self, sid: str) -> None:
        """A freshly booted VM's agent answers (the full-VM backend starts its console here)."""

    async def _mount_memory(self, ref: LayerRef) -> str:
        """The memory snapshot's files, its layer mounted read-only while restores read it."""
        hexd = ref.digest.split(":", 1)[-1]
        target = str(self.root / "mem" / hexd)
        async with self._layer_locks.setdefault(f"mem-{hexd}", asyncio.Lock()):
            self._memory_users[hexd] = self._memory_users.get(hexd, 0) + 1
            if not snapshot.mounted(target):
                os.makedirs(target, exist_ok=True)
                blob = await self._blob(ref)
                r = await asyncio.to_thread(subprocess.run, ["mount", "-t", "erofs", "-o", "ro", blob, target], capture_output=True, text=True)
                if r.returncode != 0:
                    self._memory_users[hexd] -= 1
                    raise ImageError(f"cannot mount the memory snapshot {ref.digest}: {r.stderr.strip()}")
        return target

    async def _unmount_memory(self, ref: LayerRef) -> None:
        hexd = ref.digest.split(":", 1)[-1]
        target = str(self.root / "mem" / hexd)
        async with self._layer_locks.setdefault(f"mem-{hexd}", asyncio.Lock()):
            self._memory_users[hexd] = max(0, self._memory_users.get(hexd, 0) - 1)
            if self._memory_users[hexd] == 0 and snapshot.mounted(target):
                await asyncio.to_thread(subprocess.run, ["umount", target], capture_output=True)
                os.rmdir(target)

    async def _attach(self, sid: str, timeout_s: float, *, wait: bool = True) -> None:
        """Connect to the VM's serial socket and wait for its agent (unless ``wait`` is false: a
        stopped VM answers once it is thawed); fails early if QEMU exits."""
        d = self._dir(sid)
        link = SerialMux(os.path.join(d, "serial.sock"), os.path.join(d, "agent.sock"))
        self.links[sid] = link
        await link.start()
        client = AgentClient(os.path.join(d, "agent.sock"), op_timeout_s=120.0)
        if not wait:
            self.clients[sid] = client
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while not link.ready.is_set():
            if qemu.read_pid(d) is None:
                raise RuntimeError("qemu exited during boot")
            if link.closed.is_set():
                raise RuntimeError("qemu closed the agent's serial port")
            if loop.time() >= deadline:
                raise asyncio.TimeoutError(f"no agent after {timeout_s:.0f}s")
            try:
                await asyncio.wait_for(link.ready.wait(), 0.25)  # wakes at once when the link is up
            except asyncio.TimeoutError:
                pass
        await client.wait_ready(15.0, 0.01)
        self.clients[sid] = client

    async def destroy(self, sandbox_id: str) -> None:
        await self._remove(sandbox_id)

    async def _remove(self, sid: str) -> None:
        await self._detach(sid)
        d = self._dir(sid)
        await snapshot.release_disk(d)  # a frozen VM's disk, mounted for a snapshot's diff
        pid = qemu.kill(d)
        if pid is not None:
            for _ in range(500):  # the kernel frees the process at once; wait for it to be reaped
                if not os.path.exists(f"/proc/{pid}") or qemu.read_pid(d) is None:
                    break
                await asyncio.sleep(0.01)  # poll interval while SIGKILL lands
        await self.net.teardown(sid)  # after QEMU is gone: the kernel then frees the netns, its tap and veth
        await asyncio.to_thread(shutil.rmtree, d, True)

    async def leftovers(self, sandbox_id: str) -> list[str]:
        d = self._dir(sandbox_id)
        left = [f"qemu {pid}" for pid in [qemu.read_pid(d)] if pid is not None]
        left += [f"mount {m}" for m in [os.path.join(d, "disk")] if snapshot.mounted(m)]
        if os.path.exists(d):
            left.append(f"dir {d}")
        if os.path.lexists(self.net.netns_path(sandbox_id)):
            left.append(f"netns {self.net.netns_path(sandbox_id)}")
        return left

    # --- recovery and usage ------------------------------------------------------------------
    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        removed: list[str] = []
        for entry in list(self.vms.iterdir()) if self.vms.exists() else []:
            if not holds(entry.name):
                await self._remove(entry.name)
                removed.append(f"microvm {entry.name}")
        lost = {sid for sid in running if qemu.read_pid(self._dir(sid)) is None}
        return lost, removed

    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        alive: dict[str, Handle] = {}
        for sid, h in known.items():
            if qemu.read_pid(self._dir(sid)) is None:
                continue
            try:
                await self._attach(sid, 30.0, wait=not snapshot.is_frozen(self._dir(sid)))
            except (OSError, RuntimeError, AgentError, asyncio.TimeoutError) as exc:
                log.warning("microvm_reattach_failed", sandbox_id=sid, error=str(exc))
                await self._detach(sid)
                continue
            alive[sid] = h
        # The live VMs' allowlists re-armed; every other network of this agent's removed.
        await self.net.recover({sid: h.extra.get("net") for sid, h in alive.items()})
        return alive

    async def usage(self) -> Usage:
        per = {sid: qemu.rss_mb(pid) for sid in self.clients if (pid := qemu.read_pid(self._dir(sid))) is not None}
        return Usage(mem_resident_mb=sum(per.values()), per_sandbox_mem_mb=per)

    # --- the agent channel ---------------------------------------------------------------------
    def agent_client(self, handle: Handle) -> AgentClient:
        return agent_of(self.clients, handle.sandbox_id)

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None, *, on_start: OnStart | None = None) -> ExecResult:
        return await agent_exec(self.agent_client(handle), handle.sandbox_id, req, on_output, on_start)

    async def files(self, handle: Handle, op: FileOp) -> Any:
        return await agent_files(self.agent_client(handle), handle.sandbox_id, op)

    # --- optional abilities: freezing, memory snapshots ------------------------------------------
    async def before_freeze(self, handle: Handle) -> None:
        """The guest's dirty pages onto its disk (read from the host while the VM is stopped), and
        the agent's idle connections closed."""
        client = self.agent_client(handle)
        try:
            await client.exec("sync", timeout_s=60)
        except AgentError as exc:
            raise SnapshotUnsupported(f"the microVM could not sync its disk: {exc}") from None
        await client.hang_up_idle()

    async def freeze(self, handle: Handle) -> None:
        await snapshot.freeze(self._dir(handle.sandbox_id))

    async def thaw(self, handle: Handle) -> None:
        await snapshot.thaw(self._dir(handle.sandbox_id))

    def frozen(self, handle: Handle) -> bool:
        return snapshot.is_frozen(self._dir(handle.sandbox_id))

    def scratch_dir(self, handle: Handle) -> str:
        return snapshot.scratch_dir(self._dir(handle.sandbox_id))

    async def checkpoint(self, handle: Handle, image_dir: str, work_dir: str) -> None:
        """QEMU's migration stream of the stopped VM, and its disk, into ``image_dir``."""
        x = handle.extra
        meta = {"layers": x.get("layers", 1), "vcpus": x.get("vcpus", 1), "memory_mb": x.get("memory_mb", MIN_MEMORY_MB), "accel": self.accel,
                "pmem": bool(x.get("pmem", False)), "balloon": bool(x.get("balloon", False))}
        await snapshot.checkpoint(self._dir(handle.sandbox_id), image_dir, meta)


def _make_disk(path: str, size_mb: int) -> None:
    """A sparse raw disk with an empty ext4 on it (the overlay's upper and work dirs, made by the guest)."""
    with open(path, "wb") as f:
        f.truncate(size_mb << 20)
    # No journal: a synced, stopped guest leaves a consistent disk the host can mount to diff it.
    r = subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", "lazy_itable_init=1", path], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"mkfs.ext4: {r.stderr.strip()}")


def _pad(path: str) -> None:
    """Grow the file with zeros to a whole number of virtio-pmem pages (sparse: no disk used)."""
    size = os.path.getsize(path)
    os.truncate(path, -(-size // qemu.PMEM_ALIGN) * qemu.PMEM_ALIGN)


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-n:].strip()
    except OSError:
        return ""


__all__ = ["MicroVMBackend"]
