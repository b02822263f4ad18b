"""A private containerd daemon for the host agent.

`ContainerdDaemon(data_dir)` writes a minimal config under `<data_dir>/containerd/`, starts
`containerd` with its root/state dirs there and its gRPC socket at
`<data_dir>/containerd/containerd.sock` -- unless a containerd already answers on that socket
(e.g. one left running by a previous host-agent process: sandboxes outlive the agent), in which
case it is adopted. Readiness is a deadline-bounded poll of the gRPC Version service.

The daemon runs in its own session so it (and the shims it spawns, hence the sandboxes) survive
a restart of the host agent; `stop()` is explicit, by pid (SIGTERM, then SIGKILL after a grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import time
from typing import Any

os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")

import grpc  # noqa: E402

from containerd.services.version.v1 import version_pb2_grpc  # noqa: E402
from google.protobuf import empty_pb2  # noqa: E402

__all__ = ["ContainerdDaemon", "ContainerdStartError", "probe_version"]

# Plugins we never use. The CRI plugin alone costs ~half the startup time and a lot of memory;
# the exotic snapshotters probe the host at start; `opt` creates /opt/containerd on the host.
# (runtime.v1.linux must stay: the tasks service refuses to load without it.)
DISABLED_PLUGINS: tuple[str, ...] = (
    "io.containerd.grpc.v1.cri",
    "io.containerd.snapshotter.v1.aufs",
    "io.containerd.snapshotter.v1.btrfs",
    "io.containerd.snapshotter.v1.devmapper",
    "io.containerd.snapshotter.v1.zfs",
    "io.containerd.snapshotter.v1.native",
    "io.containerd.internal.v1.opt",
    "io.containerd.internal.v1.tracing",
    "io.containerd.tracing.processor.v1.otlp",
)

_MAX_UNIX_PATH = 107  # sun_path is 108 bytes including the NUL


class ContainerdStartError(RuntimeError):
    """containerd could not be started (or did not become ready in time)."""


def _toml_str(s: str) -> str:
    # JSON string escaping is valid TOML basic-string escaping for everything we emit.
    return json.dumps(s)


async def probe_version(address: str, timeout: float = 1.0) -> str | None:
    """Return containerd's version if something answers the Version service on `address`."""
    if not os.path.exists(address):
        return None
    # Cheap pre-check: a plain connect() tells us quickly whether anybody listens at all,
    # without paying gRPC's reconnect backoff on a dead socket.
    try:
        _r, w = await asyncio.wait_for(asyncio.open_unix_connection(address), timeout)
        w.close()
        with contextlib.suppress(Exception):
            await w.wait_closed()
    except (OSError, asyncio.TimeoutError):
        return None
    try:
        async with grpc.aio.insecure_channel(
            "unix://" + address, options=[("grpc.enable_http_proxy", 0)]
        ) as ch:
            stub = version_pb2_grpc.VersionStub(ch)
            resp = await stub.Version(empty_pb2.Empty(), timeout=timeout)
            return str(resp.version)
    except (grpc.aio.AioRpcError, asyncio.TimeoutError):
        return None


class ContainerdDaemon:
    """Start (or adopt) a private containerd rooted at `<data_dir>/containerd`.

    Usage::

        async with ContainerdDaemon(data_dir) as d:
            rt = ContainerRuntime(d.address)
    """

    def __init__(
        self,
        data_dir: str,
        *,
        binary: str = "containerd",
        start_timeout: float = 30.0,
        stop_grace: float = 10.0,
        log_level: str = "warn",
        oom_score: int = 0,
        stop_on_exit: bool = True,
    ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.dir = os.path.join(self.data_dir, "containerd")
        self.root_dir = os.path.join(self.dir, "root")
        self.state_dir = os.path.join(self.dir, "state")
        self.config_path = os.path.join(self.dir, "config.toml")
        self.log_path = os.path.join(self.dir, "containerd.log")
        self.pid_path = os.path.join(self.dir, "containerd.pid")
        self._address = os.path.join(self.dir, "containerd.sock")
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.log_level = log_level
        self.oom_score = oom_score
        self.stop_on_exit = stop_on_exit
        self._proc: asyncio.subprocess.Process | None = None
        self._pid: int | None = None
        self.version: str | None = None
        self.started_by_us = False
        if len(self._address) + len(".ttrpc") > _MAX_UNIX_PATH:
            raise ValueError(
                f"containerd socket path too long for a unix socket ({len(self._address)} chars): "
                f"{self._address!r}; use a shorter data dir"
            )

    # ------------------------------------------------------------------ properties
    @property
    def address(self) -> str:
        """Path of the gRPC unix socket (pass to `ContainerRuntime`)."""
        return self._address

    @property
    def runc_root(self) -> str:
        """A runc state root inside our state dir (pass as `ContainerRuntime(runc_root=...)`
        to keep runc's per-container state apart from any system containerd's)."""
        return os.path.join(self.state_dir, "runc")

    @property
    def pid(self) -> int | None:
        """Pid of the daemon if we started or adopted one (None if unknown)."""
        return self._pid

    # ------------------------------------------------------------------ config
    def render_config(self) -> str:
        disabled = ", ".join(_toml_str(p) for p in DISABLED_PLUGINS)
        return (
            "# generated by dsec hostagent; do not edit\n"
            "version = 2\n"
            f"root = {_toml_str(self.root_dir)}\n"
            f"state = {_toml_str(self.state_dir)}\n"
            f"oom_score = {int(self.oom_score)}\n"
            f"disabled_plugins = [{disabled}]\n"
            "\n[grpc]\n"
            f"  address = {_toml_str(self._address)}\n"
            "  uid = 0\n  gid = 0\n"
            "\n[debug]\n"
            f"  level = {_toml_str(self.log_level)}\n"
            "\n[plugins]\n"
            '  [plugins."io.containerd.monitor.v1.cgroups"]\n'
            "    no_prometheus = true\n"
        )

    def write_config(self) -> None:
        os.makedirs(self.dir, mode=0o711, exist_ok=True)
        text = self.render_config()
        try:
            with open(self.config_path) as f:
                if f.read() == text:
                    return
        except FileNotFoundError:
            pass
        tmp = self.config_path + ".tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, self.config_path)

    # ------------------------------------------------------------------ lifecycle
    def _adoptable_pid(self) -> int | None:
        """Pid from our pid file if that process is a containerd using our config."""
        try:
            with open(self.pid_path) as f:
                pid = int(f.read().strip())
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except (OSError, ValueError):
            return None
        if self.config_path.encode() in argv:
            return pid
        return None

    async def start(self) -> None:
        """Ensure a containerd answers on `address`; start one if needed."""
        if self.started_by_us and self._proc is not None and self._proc.returncode is None:
            return
        version = await probe_version(self._address, timeout=2.0)
        if version is not None:
            self.version = version
            self._pid = self._adoptable_pid()
            self.started_by_us = False
            return

        self.write_config()
        self._reset_state_after_reboot()
        self.rotate_log()
        os.makedirs(self.root_dir, mode=0o711, exist_ok=True)
        os.makedirs(self.state_dir, mode=0o711, exist_ok=True)
        env = dict(os.environ)
        path = env.get("PATH", "")
        for p in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"):
            if p not in path.split(":"):
                path = f"{path}:{p}" if path else p
        env["PATH"] = path
        # Keep the python protobuf switch out of the daemon's environment (irrelevant to Go).
        env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)

        try:
            with open(self.log_path, "ab", buffering=0) as log:  # the child keeps its own copy of the descriptor
                self._proc = await asyncio.create_subprocess_exec(
                    self.binary,
                    "--config",
                    self.config_path,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
        except FileNotFoundError as e:
            raise ContainerdStartError(f"containerd binary not found: {self.binary}") from e
        self._pid = self._proc.pid
        self.started_by_us = True
        with open(self.pid_path + ".tmp", "w") as f:
            f.write(f"{self._pid}\n")
        os.replace(self.pid_path + ".tmp", self.pid_path)

        deadline = time.monotonic() + self.start_timeout
        delay = 0.005
        while True:
            if self._proc.returncode is not None:
                raise ContainerdStartError(
                    f"containerd exited with code {self._proc.returncode} during startup:\n"
                    + self._log_tail()
                )
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                await self.stop()
                raise ContainerdStartError(
                    f"containerd not ready after {self.start_timeout}s:\n" + self._log_tail()
                )
            version = await probe_version(self._address, timeout=min(1.0, max(remaining, 0.05)))
            if version is not None:
                self.version = version
                return
            await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
            delay = min(delay * 2, 0.05)

    def _reset_state_after_reboot(self) -> None:
        """containerd expects `state` on tmpfs; ours is on disk. After a reboot nothing in it can
        be alive (bundles, runc state), so start from an empty state dir -- unless something is
        still mounted below it, in which case we leave it alone (never rmtree through a mount)."""
        boot_id_path = os.path.join(self.dir, "boot_id")
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot_id = f.read().strip()
        except OSError:
            return
        try:
            with open(boot_id_path) as f:
                previous = f.read().strip()
        except FileNotFoundError:
            previous = None
        if previous is not None and previous != boot_id and os.path.isdir(self.state_dir):
            prefix = self.state_dir.rstrip("/") + "/"
            with open("/proc/self/mountinfo") as f:
                busy = any(
                    ln.split()[4].startswith(prefix) or ln.split()[4] == self.state_dir for ln in f
                )
            if not busy:
                shutil.rmtree(self.state_dir, ignore_errors=True)
        if previous != boot_id:
            with open(boot_id_path + ".tmp", "w") as f:
                f.write(boot_id + "\n")
            os.replace(boot_id_path + ".tmp", boot_id_path)

    def rotate_log(self, max_bytes: int = 64 << 20) -> bool:
        """Keep containerd.log bounded: if larger than `max_bytes`, copy it to `.1` and truncate.

        Safe while the daemon runs (it writes with O_APPEND). Returns True if rotated. The shims
        log a few info lines per sandbox through containerd, so call this periodically.
        """
        try:
            if os.path.getsize(self.log_path) <= max_bytes:
                return False
        except FileNotFoundError:
            return False
        shutil.copyfile(self.log_path, self.log_path + ".1")
        os.truncate(self.log_path, 0)
        return True

    def _log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - n))
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    async def stop(self) -> None:
        """Stop the daemon by pid: SIGTERM, then SIGKILL after `stop_grace` seconds.

        Stops only a daemon we started or one adopted through our pid file (verified by its
        command line). Running shims/containers are NOT touched (containerd leaves them running).
        """
        pid = self._pid
        if pid is None:
            return
        proc = self._proc
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if not await self._wait_exit(pid, proc, self.stop_grace):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            await self._wait_exit(pid, proc, 5.0)
        self._pid = None
        self._proc = None
        self.started_by_us = False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.pid_path)

    @staticmethod
    async def _wait_exit(pid: int, proc: asyncio.subprocess.Process | None, timeout: float) -> bool:
        if proc is not None:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
                return True
            except asyncio.TimeoutError:
                return False
        deadline = time.monotonic() + timeout
        delay = 0.005
        while time.monotonic() < deadline:
            if not _pid_alive(pid):
                return True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)
        return not _pid_alive(pid)

    async def __aenter__(self) -> "ContainerdDaemon":
        await self.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        # Only a daemon this object started; an adopted one is left alone (call stop()).
        if self.stop_on_exit and self.started_by_us:
            await self.stop()


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return False
    # A zombie is as good as dead for our purposes.
    state = stat.rsplit(")", 1)[1].split()[0]
    return state != "Z"

