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
GENERIC_PACKAGE = "linux-image-amd64"  # the full VM's: it has DRM (bochs, virtio-gpu) and fbdev drivers for a display
# what vm_boot (dsec-agent.c) needs that this kernel builds as modules; dependencies are added
# (virtio_net: the NIC of a VM with a network; virtio_balloon: free page reporting, the guest hands
# the pages it frees back to the host)
GUEST_MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "virtio_net", "virtio_balloon", "erofs", "overlay")
# the template's layers as virtio-pmem regions (PCI devices; nd_pmem makes their block devices)
PMEM_MODULES = ("virtio_pci", "virtio_pmem", "nd_pmem")
# what a guest needs to read a layer in place over virtio-pmem (EROFS's DAX support is under FS_DAX)
PMEM_OPTIONS = ("CONFIG_VIRTIO_PMEM", "CONFIG_LIBNVDIMM", "CONFIG_BLK_DEV_PMEM", "CONFIG_ZONE_DEVICE", "CONFIG_FS_DAX", "CONFIG_EROFS_FS")


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


def ensure_kernel(cache_dir: str, package: str = PACKAGE) -> Kernel:
    """The cached kernel, fetched on first use: the meta package (``linux-image-<flavour>``) names
    the versioned image package (``Depends: linux-image-<release> (= ...)``) whose files are
    extracted into ``<cache>/<release>``; releases of other flavours in the cache are not taken."""
    cache = Path(cache_dir)
    flavour = package.removeprefix("linux-image-")
    for d in sorted(cache.glob("*/boot"), reverse=True) if cache.exists() else []:
        if d.parent.name.split("-", 2)[-1] != flavour:  # 6.1.0-57-cloud-amd64: cloud-amd64
            continue
        found = _kernel_in(d.parent)
        if found is not None:
            return found
    cache.mkdir(parents=True, exist_ok=True)
    work = tempfile.mkdtemp(prefix=".fetch-", dir=cache)
    try:
        _run(["apt-get", "download", package], work)
        meta = next(Path(work).glob("*.deb"))
        depends = _run(["dpkg-deb", "-f", str(meta), "Depends"], work)
        m = re.search(r"(linux-image-[0-9][^\s,(]*)", depends)
        if m is None:
            raise CreateFailed(f"{package} names no kernel image package: {depends!r}")
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


def config(kernel: Kernel) -> dict[str, str]:
    """The kernel's build options (``boot/config-<release>`` of the extracted package)."""
    path = Path(kernel.vmlinuz).parent / f"config-{kernel.release}"
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return dict(ln.split("=", 1) for ln in lines if "=" in ln and not ln.startswith("#"))


def has_pmem_dax(kernel: Kernel) -> bool:
    opts = config(kernel)
    return all(opts.get(o) in ("y", "m") for o in PMEM_OPTIONS)


def module_order(modules_dir: str, wanted: tuple[str, ...] = GUEST_MODULES) -> list[str]:
    """Paths of ``wanted`` and what they depend on (from each module's ``depends=``), dependencies
    first: the order ``finit_module`` needs them in."""
    by_name = {p.name[:-3].replace("-", "_"): p for p in Path(modules_dir).rglob("*.ko")}
    try:  # what this kernel has built in (the generic kernel builds in some the cloud one has as modules)
        builtin = {ln.rsplit("/", 1)[-1].removesuffix(".ko").replace("-", "_") for ln in Path(modules_dir, "modules.builtin").read_text().split()}
    except OSError:
        builtin = set()
    out: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name in seen:
            return
        seen.add(name)
        path = by_name.get(name)
        if path is None and name in builtin:
            return
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


__all__ = ["GENERIC_PACKAGE", "GUEST_MODULES", "PMEM_MODULES", "Kernel", "config", "has_pmem_dax", "build_initramfs", "ensure_kernel", "module_order"]
