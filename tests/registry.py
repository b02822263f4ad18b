"""A real OCI registry for tests (Debian's ``docker-registry``, on 127.0.0.1 with a free port and a
temp storage dir) and images pushed to it with ``skopeo copy`` from OCI layouts built here (busybox
from busybox-static in a tar layer). Nothing here reaches a public registry."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BUSYBOX = "/bin/busybox"


def missing() -> str | None:
    for tool in ("docker-registry", "skopeo"):
        if not shutil.which(tool):
            return f"needs {tool} (apt-get install -y docker-registry skopeo)"
    if not os.path.exists(BUSYBOX):
        return "needs busybox-static"
    return None


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@dataclass
class LocalRegistry:
    """``docker-registry serve`` on 127.0.0.1:<free port>, storage in a temp dir; stopped by pid."""

    dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="dsec-registry-")))
    port: int = 0
    proc: subprocess.Popen | None = None
    auth: tuple[str, str] | None = None  # (user, password): htpasswd (Basic) auth on every request

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> LocalRegistry:
        self.port = free_port()
        cfg = self.dir / "config.yml"
        auth = ""
        if self.auth is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                import crypt  # bcrypt through libcrypt: what the registry's htpasswd wants

            (self.dir / "htpasswd").write_text(f"{self.auth[0]}:{crypt.crypt(self.auth[1], crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
            auth = f"auth:\n  htpasswd:\n    realm: dsec-test\n    path: {self.dir / 'htpasswd'}\n"
        cfg.write_text(
            "version: 0.1\nlog:\n  level: error\n"
            f"storage:\n  filesystem:\n    rootdirectory: {self.dir / 'data'}\n  delete:\n    enabled: true\n"
            f"http:\n  addr: {self.host}\n{auth}"
        )
        log = open(self.dir / "registry.log", "ab")  # noqa: SIM115 - the child holds it; closed below
        try:
            self.proc = subprocess.Popen(["docker-registry", "serve", str(cfg)], stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        finally:
            log.close()
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"docker-registry exited {self.proc.returncode}: {self.log()}")
            try:
                with urllib.request.urlopen(f"http://{self.host}/v2/", timeout=2) as r:
                    if r.status == 200:
                        return self
            except urllib.error.HTTPError as exc:
                if exc.code == 401 and self.auth is not None:
                    return self  # up, and asking for credentials
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"docker-registry did not answer within {timeout}s: {self.log()}")
            time.sleep(0.05)  # poll interval while it starts

    def log(self, tail: int = 3000) -> str:
        try:
            return (self.dir / "registry.log").read_text()[-tail:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def push(self, layout: Path, repo: str, tag: str, *, all_images: bool = False) -> str:
        """``skopeo copy oci:LAYOUT docker://HOST/REPO:TAG``; returns the pushed manifest's digest."""
        digest_file = self.dir / f"digest-{time.monotonic_ns()}"
        cmd = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false", "--digestfile", str(digest_file)]
        if all_images:
            cmd.append("--all")
        if self.auth is not None:
            cmd += ["--dest-creds", f"{self.auth[0]}:{self.auth[1]}"]
        cmd += [f"oci:{layout}", f"docker://{self.host}/{repo}:{tag}"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise AssertionError(f"skopeo copy failed: {r.stderr or r.stdout}")
        return digest_file.read_text().strip()

    def blob_gets(self, digest: str) -> int:
        """How many times the registry served blob ``digest`` (its access log, one line a request)."""
        return sum(1 for line in self.log(0).splitlines() if f"/blobs/{digest} " in line and '"GET ' in line)


def tar_layer(files: dict[str, Any]) -> bytes:
    """An uncompressed tar: name -> bytes (a file, 0644), ("x", bytes) (0755), ("sym", target), ("dir",), ("wh",)
    (an OCI whiteout ``.wh.<name>``)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, what in files.items():
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if isinstance(what, bytes):
                ti.size, ti.mode = len(what), 0o644
                tf.addfile(ti, io.BytesIO(what))
            elif what[0] == "x":
                ti.size, ti.mode = len(what[1]), 0o755
                tf.addfile(ti, io.BytesIO(what[1]))
            elif what[0] == "sym":
                ti.type, ti.linkname = tarfile.SYMTYPE, what[1]
                tf.addfile(ti)
            elif what[0] == "dir":
                ti.type, ti.mode = tarfile.DIRTYPE, 0o755
                ti.uid = ti.gid = what[1] if len(what) > 1 else 0
                tf.addfile(ti)
            elif what[0] == "wh":
                d, _, base = name.rpartition("/")
                ti.name = f"{d}/.wh.{base}" if d else f".wh.{base}"
                tf.addfile(ti)
    return buf.getvalue()


def busybox_layer() -> bytes:
    return tar_layer({
        "bin": ("dir",), "bin/busybox": ("x", Path(BUSYBOX).read_bytes()), "bin/sh": ("sym", "busybox"),
        "bin/cat": ("sym", "busybox"), "bin/ls": ("sym", "busybox"), "bin/env": ("sym", "busybox"),
        "bin/id": ("sym", "busybox"), "bin/pwd": ("sym", "busybox"), "bin/echo": ("sym", "busybox"),
        "etc": ("dir",), "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
        "etc/group": b"root:x:0:\nuser:x:1000:\n", "tmp": ("dir",), "root": ("dir",), "home": ("dir",), "home/user": ("dir", 1000),
    })


def _blob(blobs: Path, data: bytes) -> tuple[str, int]:
    h = hashlib.sha256(data).hexdigest()
    (blobs / h).write_bytes(data)
    return f"sha256:{h}", len(data)


def oci_layout(layout: Path, layers: list[bytes], config: dict[str, Any] | None = None, *, arch: str = "amd64",
               extra_platforms: list[tuple[list[bytes], str]] | None = None) -> Path:
    """An OCI image layout (gzip layers) tagged ``latest``; with ``extra_platforms`` its index lists one
    manifest per platform (an image index, as multi-arch images are)."""
    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)

    def manifest(tars: list[bytes], a: str) -> dict[str, Any]:
        descs, diff_ids = [], []
        for t in tars:
            gz = gzip.compress(t, mtime=0)
            d, n = _blob(blobs, gz)
            descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": d, "size": n})
            diff_ids.append("sha256:" + hashlib.sha256(t).hexdigest())
        cfg = {"architecture": a, "os": "linux", "config": config or {}, "rootfs": {"type": "layers", "diff_ids": diff_ids}}
        cd, cn = _blob(blobs, json.dumps(cfg, sort_keys=True).encode())
        m = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cd, "size": cn},
                        "layers": descs}).encode()
        md, mn = _blob(blobs, m)
        return {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": mn,
                "platform": {"os": "linux", "architecture": a}}

    top = manifest(layers, arch)
    if extra_platforms:
        entries = [top] + [manifest(t, a) for t, a in extra_platforms]
        idx = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": entries}).encode()
        d, n = _blob(blobs, idx)
        top = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": d, "size": n}
    top["annotations"] = {"org.opencontainers.image.ref.name": "latest"}
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [top]}))
    return layout
