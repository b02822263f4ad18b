"""The guest's kernel and initramfs: Debian's ``linux-image-cloud-amd64`` fetched with apt and
extracted (never installed) into a cache dir, and an initramfs (newc cpio, written here) holding the
static dsec agent as ``/init`` plus the modules the cloud kernel builds as such (virtio-mmio, -blk,
-console, -net, EROFS, overlay)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bus.errors import CreateFailed

PACKAGE = "linux-image-cloud-amd64"
# what vm_boot (dsec-agent.c) needs that this kernel builds as modules; dependencies are added
# (virtio_net: the NIC of a VM with a network)
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "erofs", "overlay")


@dataclass(frozen=True)
class Kernel:
    vmlinuz: str
    modules_dir: str  # .../lib/modules/<release>
    release: str


def _run(argv: list[str], cwd: str) -> str:
    r = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        raise CreateFailed(f"{' '.join(argv)} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


def ensure_kernel(cache_dir: str) -> Kernel:
    """The cached kernel, fetched on first use: the meta package names the versioned image package
    (``Depends: linux-image-<release> (= ...)``) whose files are extracted into ``<cache>/<release>``."""
    cache = Path(cache_dir)
    for d in sorted(cache.glob("*/boot"), reverse=True) if cache.exists() else []:
        found = _kernel_in(d.parent)
        if found is not None:
            return found
    cache.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".fetch-", dir=cache)
    try:
        _run(["apt-get", "download", PACKAGE], work)
        meta = next(Path(work).glob("*.deb"))
        depends = _run(["dpkg-deb", "-f", str(meta), "Depends"], work)
        m = re.search(r"(linux-image-[0-9][^\s,(]*)", depends)
        if m is None:
            raise CreateFailed(f"{PACKAGE} names no kernel image package: {depends!r}")
        _run(["apt-get", "download", m.group(1)], work)
        image = next(p for p in Path(work).glob("*.deb") if p.name.startswith(m.group(1) + "_"))
        release = m.group(1).removeprefix("linux-image-")
        tmp = Path(work) / "x"
        _run(["dpkg-deb", "-x", str(image), str(tmp)], work)
        final = cache / release
        if not final.exists():
            os.rename(tmp, final)
        found = _kernel_in(final)
        if found is None:
            raise CreateFailed(f"{image.name} holds no vmlinuz")
        return found
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kernel_in(root: Path) -> Kernel | None:
    vmlinuz = next(iter(sorted((root / "boot").glob("vmlinuz-*"))), None)
    if vmlinuz is None:
        return None
    release = vmlinuz.name.removeprefix("vmlinuz-")
    return Kernel(str(vmlinuz), str(root / "lib" / "modules" / release), release)


def module_order(modules_dir: str, wanted: tuple[str, ...] = GUEST_MODULES) -> list[str]:
    """Paths of ``wanted`` and what they depend on (from each module's ``depends=``), dependencies
    first: the order ``finit_module`` needs them in."""
    by_name = {p.name[:-3].replace("-", "_"): p for p in Path(modules_dir).rglob("*.ko")}
    out: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = by_name.get(name)
        if path is None:
            raise CreateFailed(f"kernel module {name} is not in {modules_dir}")
        m = re.search(rb"depends=([A-Za-z0-9_,-]*)\0", path.read_bytes())
        for dep in (m.group(1).decode().split(",") if m and m.group(1) else []):
            add(dep.replace("-", "_"))
        out.append(str(path))

    for name in wanted:
        add(name)
    return out


def _cpio_entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0), ino: int = 0) -> bytes:
    raw = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(raw), 0]
    head = b"070701" + b"".join(f"{v:08x}".encode() for v in fields)
    pad = lambda n: b"\0" * (-n % 4)  # noqa: E731 - newc pads header+name and data to 4 bytes
    return head + raw + pad(len(head) + len(raw)) + data + pad(len(data))


def build_initramfs(agent_bin: str, kernel: Kernel, out_dir: str, wanted: tuple[str, ...] = GUEST_MODULES) -> str:
    """``<out_dir>/initrd-<hash>.cpio`` for this agent, kernel and modules (built once, atomically)."""
    modules = module_order(kernel.modules_dir, wanted)
    agent = Path(agent_bin).read_bytes()
    digest = hashlib.sha256(agent + "\n".join(modules).encode()).hexdigest()[:12]
    path = Path(out_dir) / f"initrd-{digest}.cpio"
    if path.exists():
        return str(path)
    entries = [_cpio_entry(d, 0o40755) for d in ("dev", "proc", "sys", "mnt", "lib", "lib/dsec", "lib/dsec/mod")]
    entries.append(_cpio_entry("dev/console", 0o20600, rdev=(5, 1)))
    entries.append(_cpio_entry("init", 0o100755, agent))
    listed = []
    for i, m in enumerate(modules):
        name = f"lib/dsec/mod/{i:02d}-{os.path.basename(m)}"
        entries.append(_cpio_entry(name, 0o100644, Path(m).read_bytes()))
        listed.append("/" + name)
    entries.append(_cpio_entry("lib/dsec/modules", 0o100644, ("\n".join(listed) + "\n").encode()))
    entries = [e[:6] + f"{i + 1:08x}".encode() + e[14:] for i, e in enumerate(entries)]  # distinct inode numbers
    entries.append(_cpio_entry("TRAILER!!!", 0))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".initrd-")
    with os.fdopen(fd, "wb") as f:
        f.write(b"".join(entries))
    os.rename(tmp, path)
    return str(path)


__all__ = ["GUEST_MODULES", "Kernel", "build_initramfs", "ensure_kernel", "module_order"]
