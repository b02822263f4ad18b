"""The Python template: Debian bookworm + python3, pip and git via debootstrap, cached under the data dir."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
from pathlib import Path

from nats.js import JetStreamContext

from bus.errors import ImageError

from ._build import BuildResult, ImageBuilder
from ._progress import ProgressFn
from ._util import data_dir as _data_dir

DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_SUITE = "bookworm"
DEFAULT_PACKAGES = ("python3", "python3-pip", "python3-venv", "git", "ca-certificates")
_DONE = ".dsec-debootstrap-done"


async def _run(*args: str, timeout: float = 3600.0) -> str:
    proc = await asyncio.create_subprocess_exec(
        *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise ImageError(f"{args[0]} timed out after {timeout}s") from None
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise ImageError(f"{' '.join(args[:3])} failed ({proc.returncode}): {text[-3000:]}")
    return text


async def ensure_debootstrap() -> str:
    """The debootstrap binary, apt-installed when missing."""
    found = shutil.which("debootstrap")
    if found:
        return found
    if os.geteuid() != 0:
        raise ImageError("debootstrap is missing and installing it needs root: apt-get install debootstrap")
    try:
        await _run("apt-get", "install", "-y", "--no-install-recommends", "debootstrap", timeout=600)
    except ImageError:
        await _run("apt-get", "update", timeout=600)
        await _run("apt-get", "install", "-y", "--no-install-recommends", "debootstrap", timeout=600)
    found = shutil.which("debootstrap") or ("/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None)
    if not found:
        raise ImageError("debootstrap not found after apt-get install")
    return found


async def python_rootfs(
    data_dir: str | os.PathLike[str] | None = None,
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    packages: tuple[str, ...] = DEFAULT_PACKAGES,
    progress: ProgressFn | None = None,
) -> Path:
    """A bookworm rootfs with python3, pip and git: ``<data_dir>/images/rootfs/debian-<suite>-<hash>``,
    built once with debootstrap (minbase) and reused afterwards."""
    key = hashlib.sha256(f"{suite}\0{mirror}\0{','.join(sorted(packages))}".encode()).hexdigest()[:12]
    root = _data_dir(data_dir) / "images" / "rootfs" / f"debian-{suite}-{key}"
    if (root.parent / f"{root.name}{_DONE}").exists() and root.is_dir():
        ensure_e2b_user(root)
        return root
    if os.geteuid() != 0:
        raise ImageError("building the Python rootfs needs root (debootstrap)")
    deb = await ensure_debootstrap()
    if root.exists():
        await asyncio.to_thread(shutil.rmtree, root)
    root.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        progress("debootstrap (network)", 0, 0)
    await _run(deb, "--variant=minbase", f"--include={','.join(packages)}", suite, str(root), mirror, timeout=3600)
    # Leave no package caches or logs in the image (smaller, and the same every time).
    for rel in ("var/cache/apt/archives", "var/lib/apt/lists", "var/cache/apt", "var/log"):
        d = root / rel
        if d.is_dir():
            for p in d.iterdir():
                if p.is_file() or p.is_symlink():
                    p.unlink()
    for rel in ("var/cache/debconf/templates.dat-old", "var/cache/debconf/config.dat-old"):
        (root / rel).unlink(missing_ok=True)
    for sub in ("workspace", ".dsec", ".dsec/bin", ".dsec/run"):
        (root / sub).mkdir(exist_ok=True)
    ensure_e2b_user(root)
    (root.parent / f"{root.name}{_DONE}").write_text("ok\n")
    return root


E2B_USER = ("user", 1000)  # E2B runs commands as `user` (home /home/user): the gateway's envd honours it


def ensure_e2b_user(root: Path) -> None:
    """Give the rootfs E2B's ``user`` account (uid/gid 1000, home /home/user, bash), idempotently
    (rootfs cached before this existed get it too)."""
    name, uid = E2B_USER
    etc = root / "etc"
    for fname, line in (("passwd", f"{name}:x:{uid}:{uid}::/home/{name}:/bin/bash"), ("group", f"{name}:x:{uid}:"), ("shadow", f"{name}:!:19000::::::")):
        f = etc / fname
        text = f.read_text() if f.exists() else ""
        if not any(ln.split(":", 1)[0] == name for ln in text.splitlines()):
            f.write_text(text + ("" if text.endswith("\n") or not text else "\n") + line + "\n")
    home = root / "home" / name
    home.mkdir(parents=True, exist_ok=True)
    os.chown(home, uid, uid)
    home.chmod(0o750)
    if (root / "usr" / "bin" / "sudo").exists():
        # As E2B's base image: `user` may sudo without a password (the e2b profile lets setuid work).
        d = root / "etc" / "sudoers.d"
        d.mkdir(mode=0o750, parents=True, exist_ok=True)
        rule = d / "90-e2b-user"
        rule.write_text(f"{name} ALL=(ALL:ALL) NOPASSWD: ALL\n")
        os.chown(rule, 0, 0)
        rule.chmod(0o440)


async def build_python_template(
    js: JetStreamContext,
    data_dir: str | os.PathLike[str] | None = None,
    name: str = "python",
    *,
    suite: str = DEFAULT_SUITE,
    mirror: str = DEFAULT_MIRROR,
    progress: ProgressFn | None = None,
    **builder_opts: object,
) -> BuildResult:
    """Build the ``python`` template (one base layer: debian bookworm + python3, pip, git)."""
    root = await python_rootfs(data_dir, suite=suite, mirror=mirror, progress=progress)
    builder = ImageBuilder(js, data_dir, progress=progress, **builder_opts)  # type: ignore[arg-type]
    return await builder.build_template(name, base=str(root), description=f"debian {suite} + python3, pip, git")
