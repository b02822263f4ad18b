"""The ``container`` backend: containerd + runc, overlay rootfs over read-only layers, agent as PID 1."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno as _errno
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from bus.errors import CreateFailed, FileError, FileNotFound, ImageError, InvalidArgument, SandboxNotFound, SnapshotUnsupported, UnknownUser
from bus.messages import (
    DirMade,
    Done,
    EntryInfo,
    ExecRequest,
    ExecResult,
    Exists,
    FileData,
    FileExists,
    FileInfo,
    FileList,
    FileListing,
    FileMakeDir,
    FileOp,
    FileRead,
    FileRemove,
    FileRename,
    FileStat,
    FileWrite,
    FileWritten,
    LayerRef,
    SandboxMetrics,
    SandboxSpec,
)

from . import _storage as storage
from ._agent import AgentClient, AgentError, AgentInfo, AgentUnavailable, DirEntry, ensure_agent_binary
from ._execio import result_of
from ._backend import Handle, OnOutput, Usage
from ._containerd import CGROUP_PARENT, ContainerdError, ContainerRuntime, cpu_limits
from ._containerd_daemon import ContainerdDaemon
from ._profiles import Enforcement, compile_profile
from bus.profiles import default_profile
from .network import NetworkConfig, NetworkManager, write_hosts_file
from ._quota import ScratchError, ScratchFS
from ._rootfs import RootfsLayout, overlay_mount
from ._freezer import freeze, frozen, thaw

log = structlog.get_logger("dsec.hostagent.container")

AGENT_DIR_IN_SANDBOX = "/.dsec/bin"
RUN_DIR_IN_SANDBOX = "/.dsec/run"
DEFAULT_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
}
LABEL_SANDBOX = "dsec.sandbox"  # set once the container serves a sandbox (at once, or when claimed from the pool)
LABEL_CONTAINER = "dsec.container"  # every container this backend made
CGROUP_ROOT = Path("/sys/fs/cgroup")
MEM_CGROUP = Path("/sys/fs/cgroup/memory")
READ_CHUNK = 4 * 1024 * 1024
AGENT_LOG = "agent.log"  # the agent's own stderr, in the sandbox's host-side dir (not visible inside)


# Every container starts with at least this CPU share (runc init, the agent's start-up), and gets
# its own once its agent answers: a small share (0.02 is 2 ms per 100 ms) must not slow its start.
START_CPU = 1.0


def _set_cpu(cid: str, cpu: float) -> None:
    """Apply a CPU share straight to the container's cgroup v1 files (no runc round trip)."""
    base = CGROUP_ROOT / "cpu" / CGROUP_PARENT.lstrip("/") / cid
    shares, quota = cpu_limits(cpu)
    (base / "cpu.shares").write_text(str(shares))
    (base / "cpu.cfs_quota_us").write_text(str(quota))


def _set_limits(cid: str, cpu: float, memory_mb: int) -> None:
    """Apply a claimed warm container's limits straight to its cgroup v1 files (no runc round trip)."""
    _set_cpu(cid, cpu)
    mem = CGROUP_ROOT / "memory" / CGROUP_PARENT.lstrip("/") / cid
    limit = str(memory_mb * 1024 * 1024)
    memsw = mem / "memory.memsw.limit_in_bytes"
    # memory+swap must stay >= memory: raise memsw first when growing, lower memory first when shrinking.
    order = [memsw, mem / "memory.limit_in_bytes"] if memory_mb >= 64 else [mem / "memory.limit_in_bytes", memsw]
    for f in order:
        if f.exists():
            f.write_text(limit)


def _criu_log(work_dir: str, name: str) -> str:
    """The errors of CRIU's log (runc keeps it in the work dir), for the error a caller sees."""
    try:
        with open(os.path.join(work_dir, name), errors="replace") as f:
            errs = [ln.strip() for ln in f if "Error" in ln]
    except OSError:
        return ""
    return ("; criu: " + " | ".join(errs[-4:])) if errs else ""


def _loopback_up(pid: int) -> None:
    """CRIU restores the sandbox's own netns with ``lo`` down (runc sets it up only on a fresh start):
    up again, the kernel gives it 127.0.0.1 back and the restored listeners are reachable."""
    r = subprocess.run(["nsenter", "-t", str(pid), "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    if r.returncode != 0:
        raise CreateFailed(f"cannot bring the restored sandbox's loopback up: {r.stderr.strip()}")
def _cgroups_of(cid: str) -> list[Path]:
    return [p for p in CGROUP_ROOT.glob(f"*/{CGROUP_PARENT.lstrip('/')}/{cid}") if p.is_dir()]


def _remove_cgroups(cid: str) -> None:
    """runc removes a container's cgroups with its task; one left behind (a process that outlived
    its shim) is emptied and removed here. Only ever called for containers of this backend."""
    for p in _cgroups_of(cid):
        try:
            for pid in (p / "cgroup.procs").read_text().split():
                _kill(int(pid))
            os.rmdir(p)
        except FileNotFoundError:
            pass
        except OSError as exc:  # still busy: the leftovers check reports it and the kill is retried
            log.info("cgroup_busy", cgroup=str(p), error=str(exc))


def _cgroup_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""


def _mounts_of(cid: str) -> list[str]:
    """Mount points with ``cid`` as a path component (its scratch fs, its rootfs overlay)."""
    comp = f"/{cid}/"
    with open("/proc/self/mountinfo") as f:
        return [mp for mp in (line.split()[4] for line in f) if comp in mp + "/"]


class _LoopScan:
    """Backing files of the loop devices. A burst of kills checks them all from few listings
    (reading every /sys/block/loop* per kill would cost O(sandboxes) each): a caller takes any
    listing started after its own moment ``after`` (its scratch release), or makes one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at = 0.0
        self._backing: list[tuple[str, str]] = []

    def bound(self, image: str, after: float) -> list[str]:
        with self._lock:
            if self._at < after:
                at = time.monotonic()
                backing = []
                for dev in Path("/sys/block").glob("loop*"):
                    try:
                        backing.append((dev.name, (dev / "loop" / "backing_file").read_text().strip()))
                    except OSError:
                        continue  # not bound
                self._backing, self._at = backing, at
            found = self._backing
        return [f"{name} -> {b}" for name, b in found if b == image or b.startswith(image + " ")]


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except ProcessLookupError:
        pass


def _mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_MS_RDONLY = 1


def _mount_erofs(blob: str, target: str) -> None:
    """Mount an EROFS image straight from its file (Linux 6.12+): no loop device per layer, and the
    reads go to the file itself (the lazy loader's FUSE file). Older kernels want a block device:
    then mount(8) sets up a loop device."""
    if _libc.mount(blob.encode(), target.encode(), b"erofs", _MS_RDONLY, None) == 0:
        return
    err = ctypes.get_errno()
    if err not in (_errno.ENOTBLK, _errno.EINVAL):
        raise ImageError(f"cannot mount layer {blob} at {target}: {os.strerror(err)}")
    r = subprocess.run(["mount", "-t", "erofs", "-o", "ro", blob, target], capture_output=True, text=True)
    if r.returncode != 0:
        raise ImageError(f"cannot mount layer {blob} at {target}: {r.stderr.strip()}")


def _entry(e: DirEntry) -> EntryInfo:
    return EntryInfo(name=e.name, path=e.path, type=e.type, size=e.size, mode=e.mode, mtime=e.mtime)


class ContainerBackend:
    """Sandboxes as runc containers driven through containerd's gRPC API."""

    name = "container"
    enforces_profiles = True  # create() takes security=Enforcement (the sandbox's guard profile)

    def __init__(
        self,
        data_dir: str,
        *,
        containerd_address: str | None = None,
        scratch_size_gb: int | None = 256,
        shim_group_size: int = 16,
        lazy_mount: str | None = None,
        pids_max: int = 1024,
        network: NetworkConfig | None = None,
        warm_pool: int = 0,
        containerd_calls: int = 32,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.containerd_calls = containerd_calls  # containerd calls in flight at once; a burst queues
        self.containerd_address = containerd_address
        self.daemon: ContainerdDaemon | None = None
        self.rt: ContainerRuntime | None = None
        self.scratch = ScratchFS(str(self.data_dir), scratch_size_gb)
        self.layers_dir = self.data_dir / "layers"
        self.lazy_mount = lazy_mount or str(self.data_dir / "lazy")
        self.shim_group_size = shim_group_size
        self.pids_max = pids_max
        self.agent_bin = ""
        self._layer_mounts: dict[str, str] = {}
        self._layer_locks: dict[str, asyncio.Lock] = {}
        self._clients: dict[str, AgentClient] = {}
        self._groups: dict[str, set[str]] = {}
        self._group_of: dict[str, str] = {}
        self._group_up: set[str] = set()  # groups whose shim is running
        self._cpu_prev: tuple[float, float] | None = None
        self._default_enf: Enforcement | None = None
        self.net = NetworkManager(network or NetworkConfig.from_env())  # per-sandbox netns + egress allowlist
        # Warm pool: started sandboxes waiting per (layers, disk, compiled profile), handed out on create with the
        # requested limits applied, so a create skips runc's cold start. Container ids differ from
        # sandbox ids for pooled ones: _cid maps sandbox id -> container id.
        self.warm_pool = warm_pool
        self._cid: dict[str, str] = {}
        self._pool: dict[tuple[Any, ...], list[tuple[str, int, str]]] = {}
        self._pool_args: dict[tuple[Any, ...], tuple[list[str], int, Enforcement]] = {}
        self._refilling: dict[tuple[Any, ...], asyncio.Task[None]] = {}
        self._warm_info: dict[str, AgentInfo] = {}
        self._retiring: set[asyncio.Task[None]] = set()  # removals of warm containers of a changed profile
        self._stopping = False
        self._starting: set[str] = set()  # containers being started (not yet in any table): not orphans
        self._loops = _LoopScan()
        self._cpu_samples: dict[str, tuple[float, int]] = {}  # container -> (monotonic time, cpuacct.usage ns)

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.layers_dir.mkdir(parents=True, exist_ok=True)
        self.agent_bin = await asyncio.to_thread(ensure_agent_binary, str(self.data_dir))
        await self.scratch.ensure_async()
        if self.containerd_address is None:
            self.daemon = ContainerdDaemon(str(self.data_dir))
            await self.daemon.start()
            address = self.daemon.address
            runc_root = self.daemon.runc_root
        else:
            address, runc_root = self.containerd_address, None
        self.rt = ContainerRuntime(address, runc_root=runc_root, max_calls=self.containerd_calls)
        await self.net.start()

    async def stop(self) -> None:
        self._stopping = True
        for t in list(self._refilling.values()):
            t.cancel()
        for t in list(self._refilling.values()):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        self._pool.clear()
        for t in list(self._retiring):
            try:
                await t
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the listing below removes what is left
                pass
        if self.rt is not None:
            # Warm containers (also one a cancelled refill was starting) serve no sandbox: remove them.
            for c in await self.rt.list():
                if c.labels.get(LABEL_CONTAINER) and not c.labels.get(LABEL_SANDBOX):
                    await self._remove(c.id, None)
            alive = [c for c in await self.rt.list() if c.labels.get(LABEL_SANDBOX)]
            await self.rt.close()
        else:
            alive = []
        # Leave containerd up while sandboxes live: a restarted agent recovers them through it.
        if self.daemon is not None and not alive:
            await self._reap_idle_shims()
            await self.daemon.stop()
            for digest, mnt in list(self._layer_mounts.items()):
                await asyncio.to_thread(subprocess.run, ["umount", mnt], capture_output=True)
                self._layer_mounts.pop(digest, None)
        await self.net.stop()  # kernel state (netns, veths, nft) stays for the sandboxes that live on

    async def _reap_idle_shims(self, grace_s: float = 5.0) -> None:
        """With no container left, our shims should exit on their own; stop any that lingers, by pid.

        containerd asks a shim to shut down after its last container's delete; when containerd itself
        stops right after, that request can be lost and the idle shim would stay forever."""
        assert self.daemon is not None
        needle = f"-address\0{self.daemon.address}".encode()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while True:
            pids = []
            for d in os.listdir("/proc"):
                if d.isdigit():
                    try:
                        with open(f"/proc/{d}/cmdline", "rb") as f:
                            cmd = f.read()
                    except OSError:
                        continue
                    if b"containerd-shim" in cmd and needle in cmd:
                        pids.append(int(d))
            if not pids:
                return
            if loop.time() > deadline:
                for pid in pids:
                    # A shim is the subreaper of its containers' inits: a `runc init` left parked by a
                    # create cut short would outlive it holding the sandbox's mounts, so it goes first.
                    for child in _children(pid):
                        log.warning("stopping_orphan_container_init", pid=child, shim=pid)
                        _kill(child)
                    log.warning("stopping_idle_shim", pid=pid)
                    _kill(pid)
                return
            await asyncio.sleep(0.1)  # poll interval while shims exit

    # --- layers ------------------------------------------------------------------------------
    async def _layer_dir(self, ref: LayerRef) -> str:
        if ref.kind == "dir":
            if not ref.path or not os.path.isdir(ref.path):
                raise ImageError(f"layer {ref.digest} ({ref.role}) directory {ref.path!r} is missing on this host")
            return ref.path
        if ref.kind != "erofs":
            raise ImageError(f"layer {ref.digest}: unknown kind {ref.kind!r}")
        hexd = ref.digest.split(":", 1)[-1]
        mnt = self._layer_mounts.get(hexd)
        if mnt is not None:
            return mnt
        lock = self._layer_locks.setdefault(hexd, asyncio.Lock())
        async with lock:
            if hexd in self._layer_mounts:
                return self._layer_mounts[hexd]
            target = str(self.layers_dir / hexd)
            os.makedirs(target, exist_ok=True)
            if not _mounted(target):
                blob = ref.path if ref.path and os.path.exists(ref.path) else os.path.join(self.lazy_mount, hexd)
                try:
                    await asyncio.to_thread(_mount_erofs, blob, target)
                except ImageError as exc:
                    raise ImageError(f"layer {ref.digest} ({ref.role}): {exc}") from None
            # One mount per layer per host, shared by every sandbox that uses it (one page cache).
            self._layer_mounts[hexd] = target
            return target

    def cached_layers(self) -> list[str]:
        """Layers this host holds: mounted ones, plus what the lazy loader's cache index has fetched."""
        held = {f"sha256:{d}" for d in self._layer_mounts}
        try:
            index = json.loads((self.data_dir / "cache" / "index.json").read_text())
            held.update(k for k, v in index.items() if v.get("fetched_bytes", 0) > 0)
        except (OSError, ValueError, AttributeError):
            pass  # no lazy loader on this host (yet)
        return sorted(held)

    # --- create / destroy -------------------------------------------------------------------
    def _pick_group(self, sid: str) -> str | None:
        if self.shim_group_size <= 1:
            return None
        # Only join a group whose shim is up: two creates starting the same group's shim at once
        # can race in containerd and leave a second shim behind.
        for g, members in self._groups.items():
            if g in self._group_up and len(members) < self.shim_group_size:
                members.add(sid)
                self._group_of[sid] = g
                return g
        g = f"grp-{sid}"
        self._groups[g] = {sid}
        self._group_of[sid] = g
        return g

    def _leave_group(self, sid: str) -> None:
        g = self._group_of.pop(sid, None)
        if g is not None:
            members = self._groups.get(g)
            if members is not None:
                members.discard(sid)
                if not members:
                    del self._groups[g]
                    self._group_up.discard(g)

    async def create(self, spec: SandboxSpec, layers: list[LayerRef], security: Enforcement | None = None, memory: LayerRef | None = None) -> Handle:
        """Start the sandbox confined by ``security`` (the built-in default profile when None); with
        ``memory`` (a snapshot's CRIU dump, packed as a layer) its processes are restored instead."""
        assert self.rt is not None
        sid = spec.sandbox_id
        if security is None:
            security = self._default_security()
        if not layers:
            raise ImageError(f"template {spec.template!r} has no layers")
        lowers = [await self._layer_dir(layer) for layer in reversed(layers)]  # overlay wants the top layer first
        if self.warm_pool > 0 and not self.net.wanted(spec.network) and not spec.snapshot:  # a restore's layers are its own: no pool for them
            # Keyed by what the profile compiles to, not its name and version: a pooled container's
            # seccomp filter, capabilities, read-only mounts and Landlock rules were fixed when it
            # started, so it may only serve a sandbox whose profile compiles to the very same.
            key = (tuple(layer.digest for layer in layers), spec.disk_mb, security.profile, security.fingerprint)
            self._pool_args[key] = (lowers, spec.disk_mb, security)
            self._retire_stale(key)
            handle = await self._claim_warm(key, spec)
            self._refill(key)
            if handle is not None:
                return handle
        net = None
        if self.net.wanted(spec.network):
            assert spec.network is not None
            net = await self.net.setup(sid, spec.network)  # torn down by destroy() if anything below fails
        labels = {LABEL_SANDBOX: sid, "dsec.template": spec.template}
        restore = ("", "")
        if memory is not None:
            work = self.data_dir / "criu" / sid
            await asyncio.to_thread(shutil.rmtree, work, True)
            work.mkdir(parents=True)
            restore = (await self._layer_dir(memory), str(work))
        try:
            pid, sdir, group, info = await self._start(sid, lowers, spec.disk_mb, spec.cpu, spec.memory_mb, security, net, labels, restore)
        finally:
            if memory is not None:
                await asyncio.to_thread(shutil.rmtree, restore[1], True)
        self._cid[sid] = sid
        return Handle(sid, pid, self._extra(sid, sdir, group, security, info, net))

    @staticmethod
    def _extra(cid: str, sdir: str, group: str, security: Enforcement, info: AgentInfo, net: Any) -> dict[str, Any]:
        return {
            "cid": cid, "dir": sdir, "group": group or "", "profile": security.profile, "profile_version": security.version,
            "landlock_abi": info.landlock_abi, "seccomp_log": info.seccomp_log, "audit_session": info.audit_session,
            **({"net": net.to_extra()} if net else {}),
        }

    async def _start(
        self, cid: str, lowers: list[str], disk_mb: int, cpu: float, memory_mb: int, security: Enforcement, net: Any,
        labels: dict[str, str] | None = None, restore: tuple[str, str] = ("", ""),
    ) -> tuple[int, str, str, AgentInfo]:
        """Cold start of one container ``cid``: scratch disk, overlay, runc, agent ready."""
        assert self.rt is not None
        self._starting.add(cid)
        try:
            return await self._start_once(cid, lowers, disk_mb, cpu, memory_mb, security, net, labels, restore)
        finally:
            self._starting.discard(cid)

    async def _start_once(
        self, cid: str, lowers: list[str], disk_mb: int, cpu: float, memory_mb: int, security: Enforcement, net: Any,
        labels: dict[str, str] | None, restore: tuple[str, str],
    ) -> tuple[int, str, str, AgentInfo]:
        assert self.rt is not None
        try:
            sdir = await self.scratch.allocate_async(cid, disk_mb)
        except ScratchError as exc:
            raise CreateFailed(f"cannot allocate {disk_mb} MB of disk: {exc}") from None
        layout = RootfsLayout(sdir).create()
        if net is not None and net.hosts:
            await asyncio.to_thread(write_hosts_file, layout.upper, lowers, net.hosts)
        group = self._pick_group(cid)
        try:
            pid = await self.rt.create_and_start(
                cid,
                rootfs_mounts=[overlay_mount(lowers, layout.upper, layout.work)],
                args=[f"{AGENT_DIR_IN_SANDBOX}/dsec-agent", "--socket", f"{RUN_DIR_IN_SANDBOX}/agent.sock", *security.agent_args],
                env=DEFAULT_ENV,
                cpu=max(cpu, START_CPU),  # its own share once its agent answers (below)
                memory_mb=memory_mb,
                pids_max=self.pids_max,
                bind_mounts=[(os.path.dirname(self.agent_bin), AGENT_DIR_IN_SANDBOX, True), (layout.run, RUN_DIR_IN_SANDBOX, False)],
                hostname="sandbox",
                labels={LABEL_CONTAINER: cid, **(labels or {})},
                group=group,
                netns_path=net.netns if net else None,
                stdout_path=os.path.join(sdir, AGENT_LOG),
                seccomp_profile=security.seccomp,
                capabilities=security.capabilities,
                masked_paths=security.masked_paths,
                readonly_paths=security.readonly_paths,
                no_new_privileges=security.no_new_privileges,
                restore_from=restore[0],
                restore_work=restore[1],
            )
        except ContainerdError as exc:
            self._leave_group(cid)
            if restore[0]:
                log.warning("criu_restore_failed", sandbox_id=cid, error=str(exc), criu=_criu_log(restore[1], "restore.log"))
                raise CreateFailed(f"CRIU could not restore the sandbox's processes: {exc}{_criu_log(restore[1], 'restore.log')}") from None
            raise CreateFailed(f"containerd could not start the sandbox: {exc}") from None
        if group:
            self._group_up.add(group)
        if restore[0]:
            if frozen(f"{CGROUP_PARENT}/{cid}"):
                await thaw(f"{CGROUP_PARENT}/{cid}")  # dumped while frozen: CRIU brings the cgroup back frozen
            if net is None:
                await asyncio.to_thread(_loopback_up, pid)
        client = AgentClient(os.path.join(layout.run, "agent.sock"), expected_pid=pid)
        info = await self._wait_agent(cid, sdir, client)
        if cpu < START_CPU:
            # Before the create is answered (and recorded): a host agent that dies in between
            # leaves an unrecorded container, which recovery removes. Two small cgroupfs writes,
            # inline: a hop to the default executor can queue behind a burst's disk work.
            try:
                _set_cpu(cid, cpu)
            except OSError as exc:
                raise CreateFailed(f"cannot apply the sandbox's CPU share: {exc}") from None
        if security.landlock_required and not info.landlock:
            raise CreateFailed(f"sandbox agent runs without the Landlock rules profile {security.profile!r} requires")
        self._clients[cid] = client
        return pid, sdir, group or "", info

    # --- warm pool ---------------------------------------------------------------------------------
    async def _claim_warm(self, key: tuple[Any, ...], spec: SandboxSpec) -> Handle | None:
        assert self.rt is not None
        entries = self._pool.get(key)
        security = self._pool_args[key][2]  # before any await: a concurrent create may retire the key
        while entries:
            cid, pid, sdir = entries.pop()
            try:
                await asyncio.to_thread(_set_limits, cid, spec.cpu, spec.memory_mb)
                await self.rt.set_labels(cid, {LABEL_SANDBOX: spec.sandbox_id, "dsec.template": spec.template})
            except (OSError, ContainerdError) as exc:
                log.warning("warm_claim_failed", container=cid, error=str(exc))
                await self._remove(cid, None)
                continue
            sid = spec.sandbox_id
            self._cid[sid] = cid
            self._clients[sid] = self._clients.pop(cid)
            info = self._warm_info.pop(cid)
            return Handle(sid, pid, self._extra(cid, sdir, self._group_of.get(cid, ""), security, info, None))
        return None

    def _retire_stale(self, key: tuple[Any, ...]) -> None:
        """Drop the pools started for an earlier content of the same profile (same image and disk):
        they can never be claimed again, and would hold their containers until the agent stops."""
        for old in [k for k in self._pool_args if k[:3] == key[:3] and k != key]:
            tasks = []
            t = self._refilling.pop(old, None)
            if t is not None and not t.done():
                t.cancel()  # a container it was starting is removed by the loop itself
                tasks.append(t)
            entries = self._pool.pop(old, [])
            stale = list(entries)
            entries.clear()  # a claim looping over this very list must find it empty now
            del self._pool_args[old]
            if stale:
                log.info("warm_pool_retired", profile=key[2], containers=len(stale))
                tasks.append(asyncio.ensure_future(self._remove_all([cid for cid, _, _ in stale])))
            for t in tasks:  # stop() waits for them
                self._retiring.add(t)
                t.add_done_callback(self._retiring.discard)

    async def _remove_all(self, cids: list[str]) -> None:
        for cid in cids:
            try:
                await self._remove(cid, None)
            except Exception as exc:  # noqa: BLE001 - stop() and recover() remove unclaimed ones too
                log.warning("warm_pool_remove_failed", container=cid, error=str(exc))

    def _refill(self, key: tuple[Any, ...]) -> None:
        if key not in self._pool_args:
            return  # retired while this create claimed from it
        t = self._refilling.get(key)
        if t is None or t.done():
            self._refilling[key] = asyncio.ensure_future(self._refill_loop(key))

    async def _refill_loop(self, key: tuple[Any, ...]) -> None:
        # One at a time: refilling competes with cold creates for the same CPU.
        lowers, disk_mb, security = self._pool_args[key]
        entries = self._pool.setdefault(key, [])
        while not self._stopping and len(entries) < self.warm_pool:
            cid = f"wp-{os.urandom(8).hex()}"
            try:
                pid, sdir, _, info = await self._start(cid, lowers, disk_mb, START_CPU, 64, security, None)
            except asyncio.CancelledError:
                await asyncio.shield(self._remove(cid, None))  # stopped half-way: leave no scratch or task
                raise
            except Exception as exc:  # noqa: BLE001 - the pool is an optimisation: cold creates still work
                log.warning("warm_pool_start_failed", error=str(exc))
                await self._remove(cid, None)
                return
            self._warm_info[cid] = info
            entries.append((cid, pid, sdir))

    def _default_security(self) -> Enforcement:
        if self._default_enf is None:
            self._default_enf = compile_profile(default_profile())
        return self._default_enf

    async def _wait_agent(self, sid: str, sdir: str, client: AgentClient) -> AgentInfo:
        """The agent's ping, or CreateFailed with its last words as soon as it exits (say, a
        confinement it could not apply) instead of after the whole ready timeout."""
        assert self.rt is not None
        ready = asyncio.ensure_future(client.wait_ready(15.0, 0.002))
        exited = asyncio.ensure_future(self.rt.wait(sid))
        try:
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            return ready.result()
        if not ready.done() and exited.done() and not exited.cancelled() and exited.exception() is not None:
            try:  # could not watch the task: just wait for the agent
                return await ready
            except AgentError as exc:
                raise CreateFailed(f"sandbox agent did not start: {exc}") from None
        ready.cancel()
        try:
            await ready
        except (asyncio.CancelledError, AgentError):
            pass
        # The shim copies the agent's stderr to the log on its own schedule: give it a moment.
        last = ""
        deadline = asyncio.get_running_loop().time() + 5.0
        while not last and asyncio.get_running_loop().time() < deadline:
            try:
                with open(os.path.join(sdir, AGENT_LOG), errors="replace") as f:
                    last = f.read()[-2000:].strip()
            except OSError:
                pass
            if not last:
                await asyncio.sleep(0.05)  # poll interval while the shim flushes
        exc = ready.exception() if ready.done() and not ready.cancelled() else None
        why = f"exited: {last}" if last else (str(exc) if exc else "exited")
        raise CreateFailed(f"sandbox agent did not start: {why}")

    async def before_freeze(self, handle: Handle) -> None:
        """Hang up the idle connections to the sandbox's agent (hostagent._snapshots, before it
        freezes the sandbox): a frozen agent cannot close its ends, and CRIU cannot dump them."""
        client = self._clients.get(handle.sandbox_id)
        if client is not None:
            await client.hang_up_idle()

    async def checkpoint(self, handle: Handle, image_dir: str, work_dir: str) -> None:
        """CRIU-dump the sandbox's processes into ``image_dir`` (whole memory: no soft-dirty tracking
        here); the sandbox runs on (or stays frozen, if it was)."""
        assert self.rt is not None
        cid = self._cid.get(handle.sandbox_id, handle.sandbox_id)
        try:
            await self.rt.checkpoint(cid, image_dir, work_dir, exit=False)
        except ContainerdError as exc:
            raise SnapshotUnsupported(f"CRIU could not checkpoint the sandbox: {exc}{_criu_log(work_dir, 'dump.log')}") from None

    async def destroy(self, sandbox_id: str) -> None:
        # The container id is kept until leftovers() finds nothing: a retried kill of a sandbox
        # from the warm pool removes the same container.
        await self._remove(self._cid.get(sandbox_id, sandbox_id), sandbox_id)

    async def leftovers(self, sandbox_id: str) -> list[str]:
        assert self.rt is not None
        cid = self._cid.get(sandbox_id, sandbox_id)
        after = time.monotonic()
        left = [f"container {cid}"] if await self.rt.exists(cid) else []
        left += await asyncio.to_thread(self._host_leftovers, sandbox_id, cid, after)
        if not left:
            self._cid.pop(sandbox_id, None)
        return left

    def _host_leftovers(self, sandbox_id: str, cid: str, after: float) -> list[str]:
        left = [f"cgroup {p}" for p in _cgroups_of(cid)]
        left += [f"mount {m}" for m in _mounts_of(cid)]
        netns = self.net.netns_path(sandbox_id)
        if os.path.lexists(netns):
            left.append(f"netns {netns}")
        for p in (self.scratch.path(cid), self.scratch.image_path(cid)):
            if os.path.lexists(p):
                left.append(f"scratch {p}")
        left += [f"loop {d}" for d in self._loops.bound(self.scratch.image_path(cid), after)]
        return left

    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        """Drift both ways against containerd and this data dir's scratch disks. (Network namespaces and
        cgroups are named in kernel-wide places other host agents on the machine share: only those of
        containers removed here are touched.)"""
        assert self.rt is not None
        removed: list[str] = []
        by_sid: dict[str, Any] = {}
        listed = await self.rt.list()
        # Whether a container is ours is decided now, after the listing (which may take long under
        # load): a warm container started, or a sandbox created, meanwhile is not an orphan.
        for c in listed:
            sid = c.labels.get(LABEL_SANDBOX, "")
            if sid:
                by_sid[sid] = c
            if self._serves(c.id, sid, holds):
                continue
            log.warning("removing_orphan_container", container=c.id, sandbox_id=sid, status=c.status)
            try:
                await self._remove(c.id, sid or None)
                removed.append(f"container {c.id}")
            except Exception as exc:  # noqa: BLE001 - the next pass tries again
                log.warning("orphan_remove_failed", container=c.id, error=str(exc))
        lost = set()
        for sid, pid in running.items():
            if sid in by_sid and by_sid[sid].status in ("running", "paused", "pausing"):
                continue
            # containerd's task listing skips a task whose shim is slow to answer: the kernel says
            # whether its init still runs in its cgroup, and containerd is asked for this one task.
            cid = self._cid.get(sid, sid)
            if pid and f"/{CGROUP_PARENT.lstrip('/')}/{cid}" in _cgroup_of(pid):
                continue
            try:
                if await self.rt.task_pid(cid) is None:
                    lost.add(sid)
            except ContainerdError as exc:  # cannot tell now: the next pass asks again
                log.info("reconcile_task_unknown", sandbox_id=sid, error=str(exc))
        listed_ids = {c.id for c in listed}
        for cid in list((await asyncio.to_thread(self.scratch.list)).keys()):
            if cid not in listed_ids and not self._serves(cid, "", holds):
                log.warning("releasing_orphan_scratch", container=cid)
                await self.scratch.release_async(cid)
                removed.append(f"scratch {cid}")
        return lost, removed

    def _serves(self, cid: str, sid: str, holds: Callable[[str], bool]) -> bool:
        """The container is being started, waits in the warm pool, or serves a sandbox the host agent holds."""
        if cid in self._starting or cid in self._warm_info or cid in self._cid.values():
            return True
        if any(cid == e[0] for entries in self._pool.values() for e in entries):
            return True
        return holds(sid) if sid else holds(cid)

    async def _remove(self, cid: str, sandbox_id: str | None) -> None:
        assert self.rt is not None
        for key in (cid, sandbox_id):
            client = self._clients.pop(key, None) if key is not None else None
            if client is not None:
                client.close_idle()
        self._warm_info.pop(cid, None)
        self._cpu_samples.pop(cid, None)
        # Leave the shim group before the delete: a container started meanwhile must not join a shim
        # whose last member is going away (that shim would exit under it).
        self._leave_group(cid)
        # Nothing below while the task may still run (a delete that failed: containerd slow or down):
        # a scratch fs unmounted under a live task would only be detached, its loop device kept.
        await self.rt.delete(cid)
        await asyncio.to_thread(_remove_cgroups, cid)
        if sandbox_id is not None:
            await self.net.teardown(sandbox_id)  # after the task is gone: the kernel then frees the netns
        await self.scratch.release_async(cid)

    # --- ops ---------------------------------------------------------------------------------------
    def _client(self, handle: Handle) -> AgentClient:
        c = self._clients.get(handle.sandbox_id)
        if c is None:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running on this host")
        return c

    agent_client = _client  # the sandbox's agent, for the ops that drive it directly (hostagent._execio)

    async def exec(
        self, handle: Handle, req: ExecRequest, on_output: OnOutput | None, *, on_start: Any = None,
    ) -> ExecResult:
        env = {**DEFAULT_ENV, **req.envs}
        try:
            out = await self._client(handle).exec(
                req.cmd, env=env, cwd=req.cwd or None, timeout_s=req.timeout_s or None, on_output=on_output,
                cap=req.output_cap if req.output_cap >= 0 else None, background=req.background, stdin=req.stdin,
                user=req.user, on_start=on_start,
            )
        except AgentUnavailable as exc:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} does not answer: {exc.message}") from None
        except AgentError as exc:
            if exc.errno == _errno.ESRCH and req.user:
                raise UnknownUser(f"user {req.user!r} is not in the sandbox's /etc/passwd", user=req.user) from None
            if exc.errno == _errno.ENOENT and req.cwd:
                raise InvalidArgument(f"cwd {req.cwd!r} does not exist in the sandbox") from None
            raise FileError(f"exec failed: {exc.message}") from None
        return result_of(out)

    async def metrics(self, handle: Handle) -> SandboxMetrics:
        """CPU and memory from the sandbox's cgroups (v1), disk from its scratch filesystem."""
        cid = self._cid.get(handle.sandbox_id)
        if cid is None:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running on this host")
        return await asyncio.to_thread(self._metrics, cid, handle.extra.get("dir", ""))

    def _metrics(self, cid: str, sdir: str) -> SandboxMetrics:
        rel = CGROUP_PARENT.lstrip("/") + "/" + cid

        def num(ctrl: str, name: str) -> int:
            try:
                return int((CGROUP_ROOT / ctrl / rel / name).read_text().split()[0])
            except (OSError, ValueError, IndexError):
                return 0

        now = time.monotonic()
        usage = num("cpuacct", "cpuacct.usage")
        prev = self._cpu_samples.get(cid)
        if prev is None:  # no earlier sample to compare with: take a short one
            time.sleep(0.1)
            prev, now, usage = (now, usage), time.monotonic(), num("cpuacct", "cpuacct.usage")
        self._cpu_samples[cid] = (now, usage)
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

    async def files(self, handle: Handle, op: FileOp) -> Any:
        c = self._client(handle)
        try:
            match op:
                case FileWrite(path=p, data=d, offset=off, truncate=tr, mode=mode):
                    storage.ensure_room(self.data_dir, len(d), "file upload")  # the sandbox's disk is a sparse file here
                    await c.write_file(p, d, offset=off, truncate=tr, mode=mode)
                    return FileWritten(path=p, size=off + len(d))
                case FileRead(path=p, offset=off, length=n):
                    # One reply carries at most READ_CHUNK: a longer read comes back short (FileData.size
                    # tells the rest), so no request makes the host hold more than that in memory.
                    data, size = await c.read_file(p, offset=off, length=min(n, READ_CHUNK) if n >= 0 else READ_CHUNK)
                    return FileData(data=data, size=size, offset=off)
                case FileList(path=p):
                    return FileListing(entries=[_entry(e) for e in await c.list_dir(p)])
                case FileRemove(path=p):
                    await c.remove(p)
                    return Done()
                case FileExists(path=p):
                    return Exists(exists=await c.exists(p))
                case FileMakeDir(path=p, mode=mode):
                    return DirMade(path=p, created=await c.mkdir(p, mode))
                case FileRename(path=p, new_path=dst):
                    await c.rename(p, dst)
                    return FileInfo(entry=_entry(await c.stat(dst, follow_symlinks=False)))
                case FileStat(path=p, follow_symlinks=follow):
                    return FileInfo(entry=_entry(await c.stat(p, follow_symlinks=follow)))
        except AgentUnavailable as exc:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} does not answer: {exc.message}") from None
        except AgentError as exc:
            if exc.errno == _errno.ENOENT:
                raise FileNotFound(f"{getattr(op, 'path', '')}: no such file or directory") from None
            if exc.errno == _errno.EEXIST:
                raise FileError(f"{getattr(op, 'path', '')}: exists and is not a directory") from None
            if exc.errno == _errno.ENOSPC:
                raise FileError(f"{getattr(op, 'path', '')}: no space left (the sandbox's disk_mb is full)") from None
            raise FileError(f"{getattr(op, 'path', '')}: {exc.message}") from None
        raise InvalidArgument(f"unsupported file operation {type(op).__name__}")

    # --- recovery and usage ------------------------------------------------------------------
    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        assert self.rt is not None
        alive: dict[str, Handle] = {}
        for c in await self.rt.list():
            sid = c.labels.get(LABEL_SANDBOX)
            if not sid:
                if c.labels.get(LABEL_CONTAINER):
                    log.info("removing_unclaimed_warm_container", container=c.id)
                    await self._remove(c.id, None)  # a warm-pool container nobody claimed
                continue
            h = known.get(sid)
            if h is None or c.status != "running" or not c.pid:
                log.info("removing_orphan_container", sandbox_id=sid, status=c.status)
                await self._remove(c.id, sid)
                continue
            sdir = h.extra.get("dir") or await self.scratch.allocate_async(c.id, 1)
            client = AgentClient(os.path.join(RootfsLayout(sdir).run, "agent.sock"), expected_pid=c.pid)
            cgroup = f"{CGROUP_PARENT}/{c.id}"
            was_frozen = frozen(cgroup)  # paused, or an agent that died mid-snapshot
            if was_frozen:
                await thaw(cgroup)  # a frozen agent cannot answer the ping
            try:
                await client.wait_ready(5.0)
            except AgentError as exc:
                log.warning("recover_agent_unreachable", sandbox_id=sid, error=str(exc))
                await self._remove(c.id, sid)
                continue
            if was_frozen and h.extra.get("paused"):
                await freeze(cgroup)  # it stays paused; a snapshot cut short is simply thawed
            self._clients[sid] = client
            self._cid[sid] = c.id
            g = h.extra.get("group") or ""
            if g:
                self._groups.setdefault(g, set()).add(c.id)
                self._group_of[c.id] = g
                self._group_up.add(g)
            alive[sid] = Handle(sid, c.pid, h.extra)
        # Known sandboxes not running any more are torn down by the host agent: by their container id.
        for sid, h in known.items():
            if sid not in alive:
                self._cid[sid] = h.extra.get("cid", sid)
        # Scratch disks of containers that never got started (the agent died half-way) serve nobody.
        keep = set(self._cid.values()) | {c.id for c in await self.rt.list()}
        for cid in list((await asyncio.to_thread(self.scratch.list)).keys()):
            if cid not in keep:
                log.info("releasing_orphan_scratch", container=cid)
                await self.scratch.release_async(cid)
        # Layers already mounted from an earlier run are reused as they are.
        for d in self.layers_dir.iterdir() if self.layers_dir.exists() else []:
            if _mounted(str(d)):
                self._layer_mounts[d.name] = str(d)
        await self.net.recover({sid: h.extra.get("net") for sid, h in alive.items()})
        return alive

    async def usage(self) -> Usage:
        per: dict[str, int] = {}
        total = 0
        for sid, cid in list(self._cid.items()):
            try:
                b = int((MEM_CGROUP / CGROUP_PARENT.lstrip("/") / cid / "memory.usage_in_bytes").read_text())
            except (OSError, ValueError):
                continue
            per[sid] = b // (1 << 20)
            total += b
        return Usage(mem_resident_mb=total // (1 << 20), cpu_busy=self._cpu_busy(), per_sandbox_mem_mb=per)

    def _cpu_busy(self) -> float:
        with open("/proc/stat") as f:
            vals = [float(x) for x in f.readline().split()[1:]]
        idle, total = vals[3] + vals[4], sum(vals)
        prev, self._cpu_prev = self._cpu_prev, (idle, total)
        if prev is None or total <= prev[1]:
            return 0.0
        return (1 - (idle - prev[0]) / (total - prev[1])) * (os.cpu_count() or 1)

    def capacity(self) -> dict[str, float]:
        with open("/proc/meminfo") as f:
            mem_kb = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
        st = os.statvfs(self.data_dir)
        return {"cpu_total": float(os.cpu_count() or 1), "mem_total_mb": mem_kb // 1024, "disk_total_mb": st.f_blocks * st.f_frsize // (1 << 20)}


__all__ = ["ContainerBackend"]
