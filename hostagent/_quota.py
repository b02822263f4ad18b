"""Per-sandbox disk limit (`disk_mb`) for container sandboxes.

Every sandbox gets its own small ext4 filesystem: a *sparse* image file
`<data_dir>/scratch/<sandbox_id>.img` (sized so that ~`disk_mb` MiB are usable), attached to a
loop device (direct I/O, autoclear) and mounted at `<data_dir>/scratch/<sandbox_id>/`. The
sandbox's overlay upper/work dirs and its agent run dir live there (see `hostagent._rootfs`).
A write past the limit fails with ENOSPC inside the sandbox, and the host filesystem only ever
holds the blocks the sandbox actually uses (the fs is mounted with `discard`, so deleted files
give their blocks back to the host by punching holes in the image).

Why not one shared ext4 with project quotas (the originally recommended design)? The target
kernel is built with CONFIG_QUOTA but without CONFIG_QFMT_V2, so ext4's `quota` feature cannot
be mounted at all, and XFS is built without CONFIG_XFS_QUOTA. The per-sandbox filesystem is also
strictly stronger isolation: real ENOSPC (not EDQUOT), a per-sandbox inode budget, and no way for
root in the sandbox to escape the limit by changing a file's project id / PROJINHERIT flag
(FS_IOC_FSSETXATTR through overlayfs). Costs, measured: mkfs ~5 ms + loop/mount ~5 ms per
sandbox, one loop device per sandbox, ~3% of disk_mb in (lazily allocated) inode tables.

`ScratchFS(data_dir, size_gb)`: `size_gb` bounds the total *provisioned* scratch space (sum of
image sizes; images are sparse so real usage is normally far lower); None = no bound.
State survives a host-agent restart: mounts stay in the kernel and are rediscovered from
/proc/self/mountinfo; unmounted images are re-attached by `allocate()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import os
import re
import shutil
import stat
import subprocess
import threading
from dataclasses import dataclass

__all__ = ["ScratchFS", "ScratchInfo", "ScratchError", "ScratchFull", "image_bytes_for"]

_MiB = 1 << 20

# ---------------------------------------------------------------------------- kernel interfaces
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]

MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOATIME = 0x400
MNT_DETACH = 0x2

LOOP_SET_FD = 0x4C00
LOOP_CLR_FD = 0x4C01
LOOP_SET_STATUS64 = 0x4C04
LOOP_SET_DIRECT_IO = 0x4C08
LOOP_SET_BLOCK_SIZE = 0x4C09
LOOP_CONFIGURE = 0x4C0A
LOOP_CTL_GET_FREE = 0x4C82
LO_FLAGS_AUTOCLEAR = 4
LO_FLAGS_DIRECT_IO = 16
LOOP_MAJOR = 7


class _LoopInfo64(ctypes.Structure):
    _fields_ = [
        ("lo_device", ctypes.c_uint64),
        ("lo_inode", ctypes.c_uint64),
        ("lo_rdevice", ctypes.c_uint64),
        ("lo_offset", ctypes.c_uint64),
        ("lo_sizelimit", ctypes.c_uint64),
        ("lo_number", ctypes.c_uint32),
        ("lo_encrypt_type", ctypes.c_uint32),
        ("lo_encrypt_key_size", ctypes.c_uint32),
        ("lo_flags", ctypes.c_uint32),
        ("lo_file_name", ctypes.c_uint8 * 64),
        ("lo_crypt_name", ctypes.c_uint8 * 64),
        ("lo_encrypt_key", ctypes.c_uint8 * 32),
        ("lo_init", ctypes.c_uint64 * 2),
    ]


class _LoopConfig(ctypes.Structure):
    _fields_ = [
        ("fd", ctypes.c_uint32),
        ("block_size", ctypes.c_uint32),
        ("info", _LoopInfo64),
        ("reserved", ctypes.c_uint64 * 8),
    ]


def _os_error(what: str, path: str | None = None) -> OSError:
    e = ctypes.get_errno()
    return OSError(e, f"{what}: {os.strerror(e)}", path)


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), target.encode(), fstype.encode(), flags, data.encode()) != 0:
        raise _os_error(f"mount {source} on {target}", target)


def _umount(target: str, flags: int = 0) -> None:
    if _libc.umount2(target.encode(), flags) != 0:
        raise _os_error(f"umount {target}", target)


class _LoopDevice:
    """A loop device configured on an image; the fd stays open until `close()`."""

    def __init__(self, image: str, *, direct_io: bool = True) -> None:
        self.path = ""
        self.fd = -1
        backing = os.open(image, os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if direct_io else 0))
        try:
            for _attempt in range(64):
                ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
                try:
                    n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                finally:
                    os.close(ctl)
                path = f"/dev/loop{n}"
                if not os.path.exists(path):
                    # No devtmpfs auto-node (e.g. a container with a static /dev).
                    with contextlib.suppress(FileExistsError):
                        os.mknod(path, 0o660 | stat.S_IFBLK, os.makedev(LOOP_MAJOR, n))
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                try:
                    self._configure(fd, backing, image, direct_io)
                except OSError as e:
                    os.close(fd)
                    if e.errno == errno.EBUSY:  # raced with another user of loop-control
                        continue
                    raise
                self.path, self.fd = path, fd
                return
            raise OSError(errno.EBUSY, "no free loop device after 64 attempts")
        finally:
            os.close(backing)

    @staticmethod
    def _configure(fd: int, backing: int, image: str, direct_io: bool) -> None:
        flags = LO_FLAGS_AUTOCLEAR | (LO_FLAGS_DIRECT_IO if direct_io else 0)
        cfg = _LoopConfig()
        cfg.fd = backing
        cfg.block_size = 4096 if direct_io else 0
        cfg.info.lo_flags = flags
        name = os.path.basename(image).encode()[:63]
        ctypes.memmove(cfg.info.lo_file_name, name, len(name))
        try:
            fcntl.ioctl(fd, LOOP_CONFIGURE, bytes(cfg))
            return
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOTTY):
                raise
        # Pre-5.8 kernels: the old three-step dance.
        fcntl.ioctl(fd, LOOP_SET_FD, backing)
        try:
            info = _LoopInfo64()
            info.lo_flags = LO_FLAGS_AUTOCLEAR
            ctypes.memmove(info.lo_file_name, name, len(name))
            fcntl.ioctl(fd, LOOP_SET_STATUS64, bytes(info))
            if direct_io:
                with contextlib.suppress(OSError):
                    fcntl.ioctl(fd, LOOP_SET_BLOCK_SIZE, 4096)
                    fcntl.ioctl(fd, LOOP_SET_DIRECT_IO, 1)
        except OSError:
            with contextlib.suppress(OSError):
                fcntl.ioctl(fd, LOOP_CLR_FD, 0)
            raise

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1



# ---------------------------------------------------------------------------- sizing
# mkfs.ext4 parameters: 4 KiB blocks, one inode per 8 KiB (many small files: node_modules,
# site-packages), no reserved blocks, no journal (ephemeral scratch: a crash loses the sandbox
# anyway, and no journal = less write amplification and memory), no resize inode.
_BYTES_PER_INODE = 8192
_INODE_SIZE = 256


def image_bytes_for(disk_mb: int, bytes_per_inode: int = _BYTES_PER_INODE) -> int:
    """Size of a sparse image whose ext4 offers about `disk_mb` MiB to files."""
    usable = disk_mb * _MiB
    # inode tables (inode_size / bytes_per_inode of the fs), bitmaps + group descriptors (~0.1%),
    # root dir / lost+found (a few blocks), and ext4's reserved clusters for delalloc metadata
    # (min(2% of the fs, 4096 blocks)), which statfs does not report as available.
    overhead_ratio = _INODE_SIZE / bytes_per_inode + 0.0015
    base = usable / (1 - overhead_ratio)
    resv = min(0.02 * base, 4096 * 4096)
    total = int((usable + resv) / (1 - overhead_ratio)) + 2 * _MiB
    return (total + _MiB - 1) // _MiB * _MiB


_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")


class ScratchError(RuntimeError):
    pass


class ScratchFull(ScratchError):
    """Provisioning this sandbox would exceed the scratch budget (`size_gb`)."""


@dataclass(frozen=True)
class ScratchInfo:
    sandbox_id: str
    path: str  # mount point (the sandbox dir)
    image: str
    image_bytes: int  # provisioned (apparent) size
    mounted: bool


def _unescape_mountinfo(s: str) -> str:
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), s)


def _mountpoints() -> dict[str, str]:
    """mount point -> source device, from /proc/self/mountinfo."""
    out: dict[str, str] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            parts = line.split()
            try:
                sep = parts.index("-")
            except ValueError:
                continue
            out[_unescape_mountinfo(parts[4])] = _unescape_mountinfo(parts[sep + 2])
    return out


class ScratchFS:
    """Per-sandbox size-limited scratch filesystems under `<data_dir>/scratch`."""

    def __init__(
        self,
        data_dir: str,
        size_gb: float | None = 64,
        *,
        bytes_per_inode: int = _BYTES_PER_INODE,
        direct_io: bool = True,
        mkfs: str = "mkfs.ext4",
    ) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.root = os.path.join(self.data_dir, "scratch")
        self.size_gb = size_gb
        self.bytes_per_inode = bytes_per_inode
        self.direct_io = direct_io
        self.mkfs = mkfs
        self._lock = threading.Lock()
        self._id_locks: dict[str, threading.Lock] = {}
        self._reserved: dict[str, int] = {}  # in-flight allocations (bytes)
        self._ready = False
        self._mkfs_bin: str | None = None
        self._fsck_bin: str | None = None

    # ------------------------------------------------------------------ paths
    def path(self, sandbox_id: str) -> str:
        _check_id(sandbox_id)
        return os.path.join(self.root, sandbox_id)

    def image_path(self, sandbox_id: str) -> str:
        _check_id(sandbox_id)
        return os.path.join(self.root, sandbox_id + ".img")

    # ------------------------------------------------------------------ setup
    def ensure(self) -> None:
        """Prepare the scratch root (idempotent, cheap). Checks the tools we need."""
        os.makedirs(self.root, mode=0o711, exist_ok=True)
        self._mkfs_bin = _which(self.mkfs)
        self._fsck_bin = _which("e2fsck")
        if self._mkfs_bin is None:
            raise ScratchError(f"{self.mkfs} not found (apt install e2fsprogs)")
        if not os.path.exists("/dev/loop-control"):
            raise ScratchError("/dev/loop-control missing: loop devices unavailable")
        # Clean up debris of interrupted allocations (temp images).
        for name in os.listdir(self.root):
            if name.endswith(".img.tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.root, name))
        self._ready = True

    async def ensure_async(self) -> None:
        await asyncio.to_thread(self.ensure)

    # ------------------------------------------------------------------ queries
    def list(self) -> dict[str, ScratchInfo]:
        mounts = _mountpoints()
        out: dict[str, ScratchInfo] = {}
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return out
        for name in names:
            if not name.endswith(".img"):
                continue
            sid = name[:-4]
            if not _ID_RE.match(sid):
                continue
            img = os.path.join(self.root, name)
            try:
                size = os.stat(img).st_size
            except FileNotFoundError:
                continue
            p = os.path.join(self.root, sid)
            out[sid] = ScratchInfo(sid, p, img, size, p in mounts)
        return out

    def provisioned_bytes(self) -> int:
        return sum(i.image_bytes for i in self.list().values())

    def usage(self, sandbox_id: str) -> tuple[int, int]:
        """(used_bytes, usable_bytes) of a mounted sandbox scratch fs."""
        st = os.statvfs(self.path(sandbox_id))
        total = st.f_blocks * st.f_frsize
        return total - st.f_bfree * st.f_frsize, st.f_bavail * st.f_frsize + (
            total - st.f_bfree * st.f_frsize
        )

    # ------------------------------------------------------------------ allocate / release
    def _id_lock(self, sandbox_id: str) -> threading.Lock:
        with self._lock:
            lk = self._id_locks.get(sandbox_id)
            if lk is None:
                lk = self._id_locks[sandbox_id] = threading.Lock()
            return lk

    def allocate(self, sandbox_id: str, disk_mb: int) -> str:
        """Create (or re-attach) the sandbox's scratch fs; return its mounted dir.

        Idempotent: an already mounted scratch is returned as is (its size is not changed).
        """
        _check_id(sandbox_id)
        if disk_mb <= 0:
            raise ValueError("disk_mb must be positive")
        if not self._ready:
            self.ensure()
        mnt = self.path(sandbox_id)
        img = self.image_path(sandbox_id)
        with self._id_lock(sandbox_id):
            if mnt in _mountpoints():
                return mnt
            if not os.path.exists(img):
                size = image_bytes_for(disk_mb, self.bytes_per_inode)
                self._reserve(sandbox_id, size)
                try:
                    self._make_image(img, size)
                finally:
                    with self._lock:
                        self._reserved.pop(sandbox_id, None)
            else:
                self._fsck(img)
            os.makedirs(mnt, mode=0o711, exist_ok=True)
            self._attach_and_mount(img, mnt)
            # The fs root is the sandbox dir: keep it private to root on the host.
            os.chmod(mnt, 0o711)
            return mnt

    async def allocate_async(self, sandbox_id: str, disk_mb: int) -> str:
        return await asyncio.to_thread(self.allocate, sandbox_id, disk_mb)

    def _reserve(self, sandbox_id: str, size: int) -> None:
        if self.size_gb is None:
            return
        budget = int(self.size_gb * 1024 * _MiB)
        with self._lock:
            used = self.provisioned_bytes() + sum(self._reserved.values())
            if used + size > budget:
                raise ScratchFull(
                    f"scratch budget exceeded: {used // _MiB} MiB provisioned + {size // _MiB} MiB "
                    f"requested > {budget // _MiB} MiB"
                )
            self._reserved[sandbox_id] = size

    def _make_image(self, img: str, size: int) -> None:
        tmp = img + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.truncate(size)
            subprocess.run(
                [
                    self._mkfs_bin or self.mkfs, "-q", "-F",
                    "-b", "4096",
                    "-i", str(self.bytes_per_inode),
                    "-I", str(_INODE_SIZE),
                    "-m", "0",
                    "-O", "^has_journal,^resize_inode",
                    "-E", "lazy_itable_init=1,nodiscard,root_owner=0:0",
                    tmp,
                ],
                check=True,
                capture_output=True,
            )
            os.rename(tmp, img)
        except subprocess.CalledProcessError as e:
            raise ScratchError(f"mkfs failed: {e.stderr.decode(errors='replace')}") from e
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)

    def _fsck(self, img: str) -> None:
        # Image left over from before a reboot / crash: make it mountable again.
        subprocess.run([self._fsck_bin or "e2fsck", "-p", img], capture_output=True)

    def _attach_and_mount(self, img: str, mnt: str) -> None:
        try:
            loop = _LoopDevice(img, direct_io=self.direct_io)
        except OSError as e:
            if not self.direct_io or e.errno != errno.EINVAL:
                raise
            loop = _LoopDevice(img, direct_io=False)  # backing fs without O_DIRECT support
        try:
            # noinit_itable: don't let a kernel thread zero the (lazy) inode tables, which would
            # write ~3% of disk_mb to the host disk for nothing.
            _mount(loop.path, mnt, "ext4", MS_NOATIME | MS_NODEV, "discard,noinit_itable")
        except OSError:
            with contextlib.suppress(OSError):
                fcntl.ioctl(loop.fd, LOOP_CLR_FD, 0)
            raise
        finally:
            loop.close()  # autoclear: the device goes away with the mount

    def release(self, sandbox_id: str) -> None:
        """Unmount and delete the sandbox's scratch fs (idempotent).

        The container must be deleted first; if the fs is still busy it is detached lazily
        (and its space is freed when the last user goes away).
        """
        _check_id(sandbox_id)
        mnt = self.path(sandbox_id)
        img = self.image_path(sandbox_id)
        with self._id_lock(sandbox_id):
            self._umount_all_at(mnt)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(img)
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(mnt)
        with self._lock:
            self._id_locks.pop(sandbox_id, None)

    async def release_async(self, sandbox_id: str) -> None:
        await asyncio.to_thread(self.release, sandbox_id)

    @staticmethod
    def _umount_all_at(mnt: str) -> None:
        # Loop in case something got mounted on top more than once.
        for _ in range(16):
            if mnt not in _mountpoints():
                return
            try:
                _umount(mnt)
            except OSError as e:
                if e.errno == errno.EBUSY:
                    _umount(mnt, MNT_DETACH)
                elif e.errno not in (errno.EINVAL, errno.ENOENT):
                    raise

    def unmount(self) -> None:
        """Unmount every sandbox scratch fs, keeping the images (host-agent shutdown)."""
        for info in self.list().values():
            if info.mounted:
                with self._id_lock(info.sandbox_id):
                    self._umount_all_at(info.path)

    def release_all(self) -> None:
        """Unmount and delete every sandbox scratch fs (tests / full teardown)."""
        for sid in self.list():
            self.release(sid)
        # Mount points without an image (interrupted allocations).
        with contextlib.suppress(FileNotFoundError):
            for name in os.listdir(self.root):
                p = os.path.join(self.root, name)
                if _ID_RE.match(name) and os.path.isdir(p) and not os.path.islink(p):
                    self._umount_all_at(p)
                    with contextlib.suppress(OSError):
                        os.rmdir(p)


def _which(tool: str) -> str | None:
    if os.path.isabs(tool):
        return tool if os.access(tool, os.X_OK) else None
    # e2fsprogs live in /usr/sbin, which a service's PATH may lack.
    return shutil.which(tool) or shutil.which(tool, path="/usr/sbin:/sbin:/usr/local/sbin")


def _check_id(sandbox_id: str) -> None:
    if not _ID_RE.match(sandbox_id) or sandbox_id.endswith((".img", ".tmp")):
        raise ValueError(f"invalid sandbox id: {sandbox_id!r}")
