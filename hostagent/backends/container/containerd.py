"""Container sandboxes on containerd 1.6 (gRPC, runtime io.containerd.runc.v2, cgroups v1).

`ContainerRuntime(address, namespace="dsec")` talks to containerd over one grpc.aio channel
(namespace in the `containerd-namespace` metadata header). It builds the OCI runtime spec
itself (no images, no snapshotter): the root filesystem is passed as mounts to Tasks.Create so
the runc shim mounts it at `<bundle>/rootfs` and unmounts it when the task is deleted.

Spec defaults follow Docker's: new pid/mount/uts/ipc/network namespaces (network: an empty netns
unless a netns path is given), Docker's masked/read-only /proc and /sys paths, Docker's default
capability set minus NET_RAW and MKNOD, no_new_privileges, deny-all device cgroup (runc adds the
standard null/zero/full/random/urandom/tty/ptmx), cgroup v1 cpu/memory(+memsw, no swap)/pids
limits. Security settings come from the sandbox's guard profile (`hostagent._profiles`:
`seccomp_profile`, `capabilities`, `masked_paths`, `readonly_paths`); without one, the built-in
default profile's seccomp allow-list applies (native syscall ABI only; mount API, namespaces,
bpf, perf, io_uring, userfaultfd, keyrings, modules, kexec, ptrace ... refused).

Shim grouping: containers created with the same `group` carry the spec annotation
`io.containerd.runc.v2.group`, which makes containerd-shim-runc-v2 (1.6) reuse one shim process
for all of them instead of one shim per container. Measured here (30 sleeping sandboxes):
shim memory 79 MiB PSS (30 shims) vs 14 MiB (one shim), i.e. ~2.7 MiB -> ~0.5 MiB per sandbox,
and create+start ~15 ms faster (no shim spawn). The shim lives until its last container is
deleted. Trade-off: a crash of the group's shim takes all its containers' tasks with it.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Protocol, Sequence

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import grpc  # noqa: E402

from containerd.services.containers.v1 import containers_pb2, containers_pb2_grpc  # noqa: E402
from containerd.services.tasks.v1 import tasks_pb2, tasks_pb2_grpc  # noqa: E402
from containerd.types import mount_pb2  # noqa: E402
from containerd.types.task import task_pb2  # noqa: E402
from google.protobuf import any_pb2, field_mask_pb2  # noqa: E402

__all__ = [
    "ContainerRuntime",
    "ContainerInfo",
    "ContainerdError",
    "ContainerNotFound",
    "ContainerExists",
    "ContainerdUnavailable",
    "MountLike",
    "ContainerSpec",
    "build_spec",
    "DEFAULT_CAPABILITIES",
    "GROUP_ANNOTATION",
    "RUNTIME",
]

RUNTIME = "io.containerd.runc.v2"
SPEC_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/Spec"
RESOURCES_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"
RUNC_OPTIONS_TYPE_URL = "containerd.runc.v1.Options"
GROUP_ANNOTATION = "io.containerd.runc.v2.group"
CGROUP_PARENT = "/dsec"
CPU_PERIOD_US = 100_000
DEFAULT_OOM_SCORE_ADJ = 500  # sandboxes die before host services under global memory pressure
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

# Docker's default set without NET_RAW (raw sockets are an attack surface; unprivileged ICMP
# "ping sockets" are enabled instead via net.ipv4.ping_group_range in our private netns) and
# without MKNOD (no device nodes). The guard profile's list replaces this one.
DEFAULT_CAPABILITIES: tuple[str, ...] = (
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
)

MASKED_PATHS: tuple[str, ...] = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
)

READONLY_PATHS: tuple[str, ...] = (
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
)



# ----------------------------------------------------------------------------- errors
class ContainerdError(Exception):
    """Root of the containerd error family. `code` is the gRPC status code (if any)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class ContainerNotFound(ContainerdError):
    pass


class ContainerExists(ContainerdError):
    pass


class ContainerdUnavailable(ContainerdError):
    pass


def _map_error(e: grpc.aio.AioRpcError, what: str) -> ContainerdError:
    code = e.code()
    msg = f"{what}: {e.details() or code.name}"
    if code == grpc.StatusCode.NOT_FOUND:
        return ContainerNotFound(msg, code)
    if code == grpc.StatusCode.ALREADY_EXISTS:
        return ContainerExists(msg, code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return ContainerdUnavailable(msg, code)
    return ContainerdError(msg, code)


# ----------------------------------------------------------------------------- data
class MountLike(Protocol):
    @property
    def type(self) -> str: ...

    @property
    def source(self) -> str: ...

    @property
    def options(self) -> Sequence[str]: ...


@dataclass(frozen=True)
class ContainerSpec:
    """One container to create and start (``ContainerRuntime.create_and_start``).

    ``restore_from``: a CRIU dump (``checkpoint``) the task's processes are restored from, in this
    container's fresh namespaces and root (which must hold the files they had open), with
    ``restore_work`` as CRIU's scratch dir. ``stdout_path``: a host file receiving the init's
    stdout+stderr (debugging); default null I/O.
    """

    sandbox_id: str
    rootfs_mounts: Sequence[MountLike]
    args: Sequence[str]
    env: Mapping[str, str]
    cpu: float
    memory_mb: int
    pids_max: int
    bind_mounts: Sequence[tuple[str, str, bool]] = ()
    hostname: str = "sandbox"
    labels: Mapping[str, str] = field(default_factory=dict)
    netns_path: str | None = None
    group: str | None = None
    cwd: str = "/"
    stdout_path: str | None = None
    annotations: dict[str, str] | None = None
    oom_score_adj: int | None = DEFAULT_OOM_SCORE_ADJ
    seccomp: bool = True
    seccomp_profile: dict[str, Any] | None = None
    capabilities: Sequence[str] = DEFAULT_CAPABILITIES
    masked_paths: Sequence[str] = MASKED_PATHS
    readonly_paths: Sequence[str] = READONLY_PATHS
    no_new_privileges: bool = True
    setup_capabilities: Sequence[str] = ()  # the agent's alone, never in the bounding set (see build_spec)
    restore_from: str = ""
    restore_work: str = ""


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    labels: dict[str, str] = field(default_factory=dict)
    pid: int | None = None
    # created | running | stopped | paused | pausing | unknown | none (container without task)
    status: str = "none"
    exit_status: int | None = None


_STATUS = {v: k.lower() for k, v in task_pb2.Status.items()}
_LIVE = {task_pb2.CREATED, task_pb2.RUNNING, task_pb2.PAUSED, task_pb2.PAUSING}


# ----------------------------------------------------------------------------- spec
def _cgroup_v2() -> bool:
    return os.path.exists("/sys/fs/cgroup/cgroup.controllers")


def _memsw_supported() -> bool:
    return _cgroup_v2() or os.path.exists("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes")


_MEMSW = _memsw_supported()


def _has_cap(bit: int) -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> bit & 1)
    except OSError:
        pass
    return False


def _max_nofile(wanted: int) -> int:
    """RLIMIT_NOFILE for the sandbox: raising above our hard limit needs CAP_SYS_RESOURCE."""
    if _has_cap(24):  # CAP_SYS_RESOURCE
        return wanted
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def cpu_limits(cpu: float) -> tuple[int, int]:
    """cgroup v1 ``cpu.shares`` and ``cpu.cfs_quota_us`` (per CPU_PERIOD_US) of a CPU share."""
    return max(2, int(cpu * 1024)), max(1000, int(cpu * CPU_PERIOD_US))


def _resources(cpu: float | None, memory_mb: int | None, pids_max: int | None) -> dict[str, Any]:
    res: dict[str, Any] = {}
    if memory_mb is not None:
        limit = int(memory_mb) * 1024 * 1024
        mem: dict[str, Any] = {"limit": limit}
        if _MEMSW:
            mem["swap"] = limit  # v1 memsw = memory+swap == memory  ->  no swap escape
        res["memory"] = mem
    if cpu is not None:
        if cpu <= 0:
            raise ValueError("cpu must be > 0")
        shares, quota = cpu_limits(cpu)
        res["cpu"] = {"shares": shares, "quota": quota, "period": CPU_PERIOD_US}
    if pids_max is not None:
        res["pids"] = {"limit": int(pids_max)}
    return res


_default_seccomp: dict[str, Any] | None = None


def _seccomp() -> dict[str, Any]:
    """The built-in default profile's OCI seccomp object (callers without a guard profile)."""
    global _default_seccomp
    if _default_seccomp is None:
        from ..._profiles import compile_oci_seccomp
        from bus.profiles import default_profile

        _default_seccomp = compile_oci_seccomp(default_profile().syscalls)
    return _default_seccomp


def build_spec(
    sandbox_id: str,
    *,
    args: list[str],
    env: dict[str, str],
    cpu: float | None,
    memory_mb: int | None,
    pids_max: int | None,
    bind_mounts: Iterable[tuple[str, str, bool]] = (),
    hostname: str = "sandbox",
    netns_path: str | None = None,
    cwd: str = "/",
    group: str | None = None,
    annotations: dict[str, str] | None = None,
    oom_score_adj: int | None = DEFAULT_OOM_SCORE_ADJ,
    seccomp: bool = True,
    nofile: int = 65536,
    shm_mb: int = 64,
    capabilities: Sequence[str] = DEFAULT_CAPABILITIES,
    seccomp_profile: dict[str, Any] | None = None,
    masked_paths: Sequence[str] = MASKED_PATHS,
    readonly_paths: Sequence[str] = READONLY_PATHS,
    no_new_privileges: bool = True,
    setup_capabilities: Sequence[str] = (),
) -> dict[str, Any]:
    """The OCI runtime spec (as a dict) for one sandbox container.

    `seccomp_profile`: the OCI `linux.seccomp` object to use (from the sandbox's guard profile);
    None with `seccomp=True` uses the built-in default profile's.

    `setup_capabilities`: capabilities the first process (the agent) holds on top of `capabilities`
    only while it confines itself: it drops them from every set, the bounding set included, before
    it serves (``--setup-cap``; it exits if it cannot). They have to be in the bounding set at its
    start: runc drops the bounding set before it sets the others, and the kernel then refuses any
    capability outside it (and no execve would carry one over).
    """
    if not args:
        raise ValueError("args must not be empty")
    envd = {"PATH": DEFAULT_PATH, "HOME": "/root", "HOSTNAME": hostname}
    envd.update(env)
    for k in envd:
        if not k or "=" in k or "\0" in k:
            raise ValueError(f"invalid env name {k!r}")
    caps = list(capabilities)
    extra = [c for c in setup_capabilities if c not in caps]
    process: dict[str, Any] = {
        "terminal": False,
        "user": {"uid": 0, "gid": 0},
        "args": list(args),
        "env": [f"{k}={v}" for k, v in envd.items()],
        "cwd": cwd,
        "capabilities": {"bounding": caps + extra, "effective": caps + extra, "permitted": caps + extra},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": (n := _max_nofile(nofile)), "soft": n}],
        "noNewPrivileges": bool(no_new_privileges),
    }
    if oom_score_adj is not None:
        process["oomScoreAdj"] = int(oom_score_adj)

    mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
         "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
         "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={int(shm_mb) * 1024}k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue",
         "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs",
         "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
         "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]
    for src, dst, ro in bind_mounts:
        if not os.path.isabs(src) or not os.path.isabs(dst):
            raise ValueError(f"bind mount paths must be absolute: {src!r} -> {dst!r}")
        mounts.append(
            {
                "destination": dst,
                "type": "bind",
                "source": src,
                "options": ["rbind", "rprivate", "nosuid", "nodev", "ro" if ro else "rw"],
            }
        )

    namespaces: list[dict[str, str]] = [
        {"type": "pid"},
        {"type": "ipc"},
        {"type": "uts"},
        {"type": "mount"},
        {"type": "network", "path": netns_path} if netns_path else {"type": "network"},
    ]
    resources = _resources(cpu, memory_mb, pids_max)
    resources["devices"] = [{"allow": False, "access": "rwm"}]
    linux: dict[str, Any] = {
        "resources": resources,
        "cgroupsPath": f"{CGROUP_PARENT}/{sandbox_id}",
        "namespaces": namespaces,
        "maskedPaths": list(masked_paths),
        "readonlyPaths": list(readonly_paths),
    }
    if netns_path is None:
        # Only in our own fresh netns: never write sysctls into a namespace we were handed.
        linux["sysctl"] = {"net.ipv4.ping_group_range": "0 2147483647"}
    if seccomp:
        linux["seccomp"] = seccomp_profile if seccomp_profile is not None else _seccomp()
    ann = dict(annotations or {})
    if group:
        ann[GROUP_ANNOTATION] = group
    spec: dict[str, Any] = {
        "ociVersion": "1.0.2-dev",
        "process": process,
        "root": {"path": "rootfs", "readonly": False},
        "hostname": hostname,
        "mounts": mounts,
        "linux": linux,
    }
    if ann:
        spec["annotations"] = ann
    return spec


def _runc_options(root: str | None, shim_cgroup: str | None, criu_image_path: str = "", criu_work_path: str = "") -> any_pb2.Any | None:
    """containerd.runc.v1.Options, hand-encoded (the PyPI stubs do not ship it). A task created with
    ``criu_image_path`` is restored from that CRIU dump instead of started afresh."""
    buf = bytearray()
    for field_no, value in ((3, shim_cgroup), (7, root), (10, criu_image_path), (11, criu_work_path)):
        if value:
            _pb_str(buf, field_no, value)
    if not buf:
        return None
    return any_pb2.Any(type_url=RUNC_OPTIONS_TYPE_URL, value=bytes(buf))


CHECKPOINT_OPTIONS_TYPE_URL = "containerd.runc.v1.CheckpointOptions"


def _pb_str(buf: bytearray, field_no: int, s: str) -> None:
    data = s.encode()
    buf.append((field_no << 3) | 2)
    n = len(data)
    while True:
        b = n & 0x7F
        n >>= 7
        buf.append(b | (0x80 if n else 0))
        if not n:
            break
    buf.extend(data)


def _checkpoint_options(image_path: str, work_path: str, *, exit: bool, open_tcp: bool, unix_sockets: bool, file_locks: bool) -> any_pb2.Any:
    """containerd.runc.v1.CheckpointOptions, hand-encoded (the PyPI stubs do not ship it)."""
    buf = bytearray()
    for field_no, on in ((1, exit), (2, open_tcp), (3, unix_sockets), (5, file_locks)):
        if on:
            buf += bytes(((field_no << 3) | 0, 1))
    _pb_str(buf, 8, image_path)
    _pb_str(buf, 9, work_path)
    return any_pb2.Any(type_url=CHECKPOINT_OPTIONS_TYPE_URL, value=bytes(buf))


def _set_map(field: Any, values: dict[str, str]) -> None:
    # The 1.5.3 stubs predate protobuf's current map handling: with protobuf >= 5 their map
    # fields load as repeated `XEntry` messages (same wire format), older ones as real maps.
    for k, v in values.items():
        if hasattr(field, "add"):
            field.add(key=str(k), value=str(v))
        else:
            field[str(k)] = str(v)


def _get_map(field: Any) -> dict[str, str]:
    if hasattr(field, "items"):
        return dict(field.items())
    return {e.key: e.value for e in field}


# ----------------------------------------------------------------------------- runtime
class ContainerRuntime:
    """containerd client for sandbox containers. Create inside the event loop that uses it.

    `runc_root`: runc's state root (default /run/containerd/runc); pass
    `ContainerdDaemon.runc_root` to keep it inside the private daemon's state dir.
    `shim_cgroup`: put shim processes in this cgroup (must already exist in every v1 hierarchy;
    cpuset needs cpuset.cpus/mems set), e.g. to account shim memory separately.
    Both are sent as containerd.runc.v1.Options with every container.
    """

    def __init__(
        self,
        address: str,
        namespace: str = "dsec",
        *,
        runc_root: str | None = None,
        shim_cgroup: str | None = None,
        call_timeout: float = 30.0,
        max_calls: int = 32,
    ) -> None:
        self.address = address
        self.namespace = namespace
        self.call_timeout = call_timeout
        # Calls in flight at once: a burst (1,000 kills) queues here instead of piling onto containerd,
        # where each would wait out its deadline. A call's deadline starts when it leaves the queue.
        self.max_calls = max_calls
        self._gate = asyncio.Semaphore(max_calls)
        self._queued = 0  # calls waiting for a slot of the gate
        self._md = (("containerd-namespace", namespace),)
        self._runc_opts = _runc_options(runc_root, shim_cgroup)
        self._runc_root, self._shim_cgroup = runc_root, shim_cgroup
        self._channel: grpc.aio.Channel | None = None
        self._containers: containers_pb2_grpc.ContainersStub | None = None
        self._tasks: tasks_pb2_grpc.TasksStub | None = None

    # ------------------------------------------------------------------ channel
    def _stubs(self) -> tuple[containers_pb2_grpc.ContainersStub, tasks_pb2_grpc.TasksStub]:
        if self._channel is None:
            self._channel = grpc.aio.insecure_channel(
                "unix://" + self.address,
                options=[
                    ("grpc.enable_http_proxy", 0),
                    ("grpc.max_receive_message_length", 16 << 20),
                    # containerd restarts should not leave us in a long reconnect backoff
                    ("grpc.initial_reconnect_backoff_ms", 50),
                    ("grpc.min_reconnect_backoff_ms", 50),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self._containers = containers_pb2_grpc.ContainersStub(self._channel)
            self._tasks = tasks_pb2_grpc.TasksStub(self._channel)
        assert self._containers is not None and self._tasks is not None
        return self._containers, self._tasks

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
            self._containers = self._tasks = None

    async def __aenter__(self) -> "ContainerRuntime":
        self._stubs()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def queued(self) -> int:
        """Calls waiting for a slot right now."""
        return self._queued

    async def _call(self, method: Any, request: Any, what: str, timeout: float | None = None, *, watch: bool = False) -> Any:
        """One unary call, queued behind ``max_calls``; ``watch``: a call that only waits for an event
        (a task's exit) and takes no slot."""
        try:
            if watch:
                return await method(request, metadata=self._md, timeout=timeout if timeout is not None else self.call_timeout)
            self._queued += 1
            try:
                await self._gate.acquire()
            finally:
                self._queued -= 1
            try:
                return await method(request, metadata=self._md, timeout=timeout if timeout is not None else self.call_timeout)
            finally:
                self._gate.release()
        except grpc.aio.AioRpcError as e:
            raise _map_error(e, what) from None

    # ------------------------------------------------------------------ lifecycle
    async def create_and_start(self, c: ContainerSpec) -> int:
        """Create the container and its task, start it; return the init's host pid. On any failure
        everything created so far is removed again."""
        sandbox_id, labels, rootfs_mounts, stdout_path = c.sandbox_id, c.labels, c.rootfs_mounts, c.stdout_path
        restore_from, restore_work = c.restore_from, c.restore_work
        spec = build_spec(
            sandbox_id,
            args=list(c.args),
            env=dict(c.env),
            cpu=c.cpu,
            memory_mb=c.memory_mb,
            pids_max=c.pids_max,
            bind_mounts=c.bind_mounts,
            hostname=c.hostname,
            netns_path=c.netns_path,
            cwd=c.cwd,
            group=c.group,
            annotations=c.annotations,
            oom_score_adj=c.oom_score_adj,
            seccomp=c.seccomp,
            seccomp_profile=c.seccomp_profile,
            capabilities=c.capabilities,
            masked_paths=c.masked_paths,
            readonly_paths=c.readonly_paths,
            no_new_privileges=c.no_new_privileges,
            setup_capabilities=c.setup_capabilities,
        )
        containers, tasks = self._stubs()
        runtime = containers_pb2.Container.Runtime(name=RUNTIME)
        if self._runc_opts is not None:
            runtime.options.CopyFrom(self._runc_opts)
        container = containers_pb2.Container(
            id=sandbox_id,
            runtime=runtime,
            spec=any_pb2.Any(
                type_url=SPEC_TYPE_URL, value=json.dumps(spec, separators=(",", ":")).encode()
            ),
        )
        _set_map(container.labels, dict(labels))
        await self._call(
            containers.Create,
            containers_pb2.CreateContainerRequest(container=container),
            f"create container {sandbox_id}",
        )
        try:
            stdio = f"file://{stdout_path}" if stdout_path else ""
            req = tasks_pb2.CreateTaskRequest(
                container_id=sandbox_id,
                rootfs=[
                    mount_pb2.Mount(type=m.type, source=m.source, options=list(m.options))
                    for m in rootfs_mounts
                ],
                stdin="",
                stdout=stdio,
                stderr=stdio,
                terminal=False,
            )
            task_opts = _runc_options(self._runc_root, self._shim_cgroup, restore_from, restore_work) if restore_from else self._runc_opts
            if task_opts is not None:
                req.options.CopyFrom(task_opts)
            await self._call(tasks.Create, req, f"create task {sandbox_id}")
            resp = await self._call(
                tasks.Start, tasks_pb2.StartRequest(container_id=sandbox_id), f"start task {sandbox_id}"
            )
            return int(resp.pid)
        except BaseException:
            # Don't leave a half-made sandbox behind (shielded: also on cancellation).
            if restore_from:
                await asyncio.shield(self._delete_unstarted(sandbox_id))
            await asyncio.shield(self._cleanup_quietly(sandbox_id))
            raise

    async def checkpoint(self, sandbox_id: str, image_path: str, work_path: str, *, exit: bool = False) -> None:
        """CRIU-dump the task's processes into ``image_path`` (runc checkpoint through the shim); with
        ``exit`` the task ends after the dump, else it runs on."""
        _, tasks = self._stubs()
        opts = _checkpoint_options(image_path, work_path, exit=exit, open_tcp=True, unix_sockets=True, file_locks=True)
        await self._call(tasks.Checkpoint, tasks_pb2.CheckpointTaskRequest(container_id=sandbox_id, options=opts), f"checkpoint task {sandbox_id}")

    async def _delete_unstarted(self, sandbox_id: str) -> None:
        """A task whose CRIU restore failed never ran: there is no exit to wait for (``delete`` would
        wait out its timeout); delete task and container outright."""
        containers, tasks = self._stubs()
        for call, req, what in (
            (tasks.Delete, tasks_pb2.DeleteTaskRequest(container_id=sandbox_id), "delete task"),
            (containers.Delete, containers_pb2.DeleteContainerRequest(id=sandbox_id), "delete container"),
        ):
            try:
                await self._call(call, req, f"{what} {sandbox_id}")
            except ContainerdError:
                pass

    async def _cleanup_quietly(self, sandbox_id: str) -> None:
        try:
            await self.delete(sandbox_id)
        except ContainerdError:
            pass

    async def kill(self, sandbox_id: str, signal: int = 9, all: bool = True) -> None:
        """Signal the task's init (all=True: every process of the container)."""
        _, tasks = self._stubs()
        await self._call(
            tasks.Kill,
            tasks_pb2.KillRequest(container_id=sandbox_id, signal=int(signal), all=all),
            f"kill {sandbox_id}",
        )

    async def wait(self, sandbox_id: str, timeout: float | None = None) -> int:
        """Wait for the task to exit; returns its exit status. Without a timeout it is a watch (no
        slot of ``max_calls`` held while the task runs)."""
        _, tasks = self._stubs()
        resp = await self._call(
            tasks.Wait,
            tasks_pb2.WaitRequest(container_id=sandbox_id),
            f"wait {sandbox_id}",
            timeout=timeout if timeout is not None else 365 * 86400.0,
            watch=timeout is None,
        )
        return int(resp.exit_status)

    async def delete(self, sandbox_id: str, *, stop_timeout: float = 10.0) -> int | None:
        """Kill (if running), wait, delete the task and the container. Idempotent.

        Returns the task's exit status if there was a task. The shim unmounts the rootfs and
        runc removes the cgroups as part of the task delete.
        """
        containers, tasks = self._stubs()
        exit_status: int | None = None
        has_task = True
        try:
            # The container has its own pid namespace: killing init kills everything.
            # (all=True would make runc freeze/thaw the cgroup first -- slower, same outcome.)
            await self.kill(sandbox_id, 9, all=False)
        except ContainerNotFound:
            pass  # no task, or its process already exited
        except ContainerdError as e:
            if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                raise
        try:
            exit_status = await self.wait(sandbox_id, timeout=stop_timeout)
        except ContainerNotFound:
            has_task = False
        if has_task:
            try:
                resp = await self._call(
                    tasks.Delete,
                    tasks_pb2.DeleteTaskRequest(container_id=sandbox_id),
                    f"delete task {sandbox_id}",
                )
                exit_status = int(resp.exit_status)
            except ContainerNotFound:
                pass
        try:
            await self._call(
                containers.Delete,
                containers_pb2.DeleteContainerRequest(id=sandbox_id),
                f"delete container {sandbox_id}",
            )
        except ContainerNotFound:
            pass
        return exit_status

    # ------------------------------------------------------------------ queries
    async def list(self) -> list[ContainerInfo]:
        """All containers in our namespace with their task state (two concurrent calls)."""
        containers, tasks = self._stubs()
        cresp, tresp = await asyncio.gather(
            self._call(containers.List, containers_pb2.ListContainersRequest(), "list containers"),
            self._call(tasks.List, tasks_pb2.ListTasksRequest(), "list tasks"),
        )
        by_id = {t.id or t.container_id: t for t in tresp.tasks}
        out = []
        for c in cresp.containers:
            t = by_id.get(c.id)
            if t is None:
                out.append(ContainerInfo(id=c.id, labels=_get_map(c.labels)))
            else:
                out.append(
                    ContainerInfo(
                        id=c.id,
                        labels=_get_map(c.labels),
                        pid=int(t.pid) or None,
                        status=_STATUS.get(t.status, "unknown"),
                        exit_status=int(t.exit_status) if t.status == task_pb2.STOPPED else None,
                    )
                )
        return out

    async def exists(self, sandbox_id: str) -> bool:
        """Whether the container is there (with or without a task)."""
        containers, _ = self._stubs()
        try:
            await self._call(containers.Get, containers_pb2.GetContainerRequest(id=sandbox_id), f"get container {sandbox_id}")
            return True
        except ContainerNotFound:
            return False

    async def task_pid(self, sandbox_id: str) -> int | None:
        """Host pid of the task's init while it is alive, else None."""
        _, tasks = self._stubs()
        try:
            resp = await self._call(
                tasks.Get, tasks_pb2.GetRequest(container_id=sandbox_id), f"get task {sandbox_id}"
            )
        except ContainerNotFound:
            return None
        p = resp.process
        return int(p.pid) if p.status in _LIVE and p.pid else None

    async def set_labels(self, sandbox_id: str, labels: dict[str, str]) -> None:
        """Set (add or replace) the given labels of a container, leaving the others."""
        containers, _ = self._stubs()
        c = containers_pb2.Container(id=sandbox_id)
        _set_map(c.labels, labels)
        await self._call(
            containers.Update,
            containers_pb2.UpdateContainerRequest(
                container=c, update_mask=field_mask_pb2.FieldMask(paths=[f"labels.{k}" for k in labels])
            ),
            f"label {sandbox_id}",
        )

    async def update_resources(
        self, sandbox_id: str, cpu: float | None = None, memory_mb: int | None = None,
        pids_max: int | None = None,
    ) -> None:
        """Change cgroup limits of a running sandbox (only the given ones)."""
        res = _resources(cpu, memory_mb, pids_max)
        if not res:
            return
        _, tasks = self._stubs()
        await self._call(
            tasks.Update,
            tasks_pb2.UpdateTaskRequest(
                container_id=sandbox_id,
                resources=any_pb2.Any(type_url=RESOURCES_TYPE_URL, value=json.dumps(res).encode()),
            ),
            f"update {sandbox_id}",
        )
