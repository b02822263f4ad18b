"""The snapshot layer writer (``imaged._erofs_write``): its images mounted by the real kernel EROFS
driver read back exactly (modes, owners, ns mtimes, xattrs, hard links, devices, whiteouts), holes
stay holes (SEEK_DATA inside the mount; an overlay copy-up of the file stays sparse), and sparse or
repetitive data costs the image only what is distinct."""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imaged._erofs_write import MAX_MAP_ENTRIES, chunk_bits_for, write_erofs

from .conftest import needs_erofs

pytestmark = needs_erofs
GiB, TiB = 1 << 30, 1 << 40


@contextlib.contextmanager
def mounted_erofs(image: Path, at: Path) -> Iterator[Path]:
    at.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "erofs", "-o", "ro,loop", str(image), str(at)], check=True, capture_output=True)
    try:
        yield at
    finally:
        subprocess.run(["umount", "-d", str(at)], check=True, capture_output=True)


def _meta(p: Path) -> tuple[int, ...]:
    st = os.lstat(p)
    size = 0 if stat.S_ISDIR(st.st_mode) else st.st_size  # a directory's size is the file system's own
    return st.st_mode, st.st_uid, st.st_gid, size, st.st_mtime_ns, st.st_nlink, st.st_rdev


def _xattrs(p: Path) -> dict[str, bytes]:
    return {n: os.getxattr(p, n, follow_symlinks=False) for n in os.listxattr(p, follow_symlinks=False)}


def _first_data(p: Path) -> int | None:
    fd = os.open(p, os.O_RDONLY)
    try:
        return os.lseek(fd, 0, os.SEEK_DATA)
    except OSError:
        return None  # ENXIO: one hole
    finally:
        os.close(fd)


def test_tree_reads_back_exactly(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d" / "e").mkdir(parents=True)
    (src / "a").write_bytes(b"hello\n")
    os.chown(src / "a", 1234, 5678)
    os.chmod(src / "a", 0o4751)
    os.setxattr(src / "a", "user.note", b"kept")
    os.setxattr(src / "d", "trusted.overlay.opaque", b"y")
    os.link(src / "a", src / "d" / "a.hard")
    os.symlink("../a", src / "d" / "sym")
    os.mknod(src / "wh", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # an overlay whiteout
    os.mknod(src / "blk", stat.S_IFBLK | 0o600, os.makedev(8, 300))
    os.mkfifo(src / "fifo")
    (src / "big").write_bytes(os.urandom(3 * 4096 + 17))
    (src / "tail").write_bytes(os.urandom(3000))
    for i in range(400):  # a directory over several blocks: lookups binary-search across them
        (src / "d" / "e" / f"a-rather-long-file-name-{i:04d}").write_text(str(i))
    (src / "-before-dot").write_text("sorts before '.'")
    os.utime(src / "d" / "e", ns=(0, 981173106_123456789))
    (src / "old").write_text("before the epoch")
    os.utime(src / "old", ns=(0, -315619200_000000001))  # 1959-12-31, one ns before a whole second
    os.utime(src / "d" / "sym", ns=(0, 981173106_987654321), follow_symlinks=False)
    write_erofs(src, tmp_path / "img")
    with mounted_erofs(tmp_path / "img", tmp_path / "mnt") as mnt:
        want = sorted(p.relative_to(src) for p in src.rglob("*"))
        assert sorted(p.relative_to(mnt) for p in mnt.rglob("*")) == want
        for rel in [Path("."), *want]:
            a, b = src / rel, mnt / rel
            assert _meta(a) == _meta(b), rel
            assert _xattrs(a) == _xattrs(b), rel
            if a.is_symlink():
                assert os.readlink(a) == os.readlink(b)
            elif a.is_file():
                assert a.read_bytes() == b.read_bytes(), rel
        assert os.stat(mnt / "a").st_ino == os.stat(mnt / "d" / "a.hard").st_ino
        assert (mnt / "d" / "e" / "a-rather-long-file-name-0399").read_text() == "399"


def test_sparse_8g_and_1t_cost_nothing_and_stay_holes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "s8g", "wb") as f:
        f.truncate(8 * GiB)
    with open(src / "s1t", "wb") as f:
        f.truncate(TiB)
    with open(src / "mixed", "wb") as f:  # data amid holes: only its chunk is stored
        f.seek(GiB)
        f.write(b"middle")
        f.truncate(3 * GiB)
    t0 = time.perf_counter()
    stats = write_erofs(src, tmp_path / "img")
    took = time.perf_counter() - t0
    assert took < 1.0, took
    assert os.stat(tmp_path / "img").st_blocks * 512 < 512 * 1024  # kilobytes (the mixed file's map and chunk), not gigabytes
    assert stats.data_bytes == 1 << chunk_bits_for(3 * GiB)
    with mounted_erofs(tmp_path / "img", tmp_path / "mnt") as mnt:
        assert os.stat(mnt / "s8g").st_size == 8 * GiB and os.stat(mnt / "s1t").st_size == TiB
        assert _first_data(mnt / "s8g") is None and _first_data(mnt / "s1t") is None
        assert _first_data(mnt / "mixed") == GiB - GiB % (1 << chunk_bits_for(3 * GiB))
        fd = os.open(mnt / "mixed", os.O_RDONLY)
        try:
            assert os.pread(fd, 6, GiB) == b"middle" and os.pread(fd, 4096, 2 * GiB) == bytes(4096)
        finally:
            os.close(fd)
        # As an overlay lower layer (what a restored sandbox sees): a write copies the file up, and the
        # copy is sparse too.
        up, work, ov = tmp_path / "up", tmp_path / "work", tmp_path / "ov"
        for d in (up, work, ov):
            d.mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={mnt},upperdir={up},workdir={work}", str(ov)], check=True)
        try:
            with open(ov / "s1t", "ab") as f:
                f.write(b"x")
            assert os.stat(up / "s1t").st_size == TiB + 1 and os.stat(up / "s1t").st_blocks <= 64
        finally:
            subprocess.run(["umount", str(ov)], check=True)


def test_repeated_blocks_stored_once_and_zeros_never(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    block = os.urandom(4096)
    (src / "rep").write_bytes(block * 4096)  # 16 MiB of one block
    (src / "rep2").write_bytes(block * 1024)  # the same block again, in another file
    (src / "zeros").write_bytes(bytes(8 << 20))  # written out (not sparse) on the source: stored as holes
    stats = write_erofs(src, tmp_path / "img")
    assert stats.data_bytes == 4096 and os.path.getsize(tmp_path / "img") < 256 * 1024
    with mounted_erofs(tmp_path / "img", tmp_path / "mnt") as mnt:
        assert (mnt / "rep").read_bytes() == block * 4096 and (mnt / "rep2").read_bytes() == block * 1024
        assert (mnt / "zeros").read_bytes() == bytes(8 << 20) and _first_data(mnt / "zeros") is None


def test_same_tree_same_bytes_and_bounded_map(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_bytes(os.urandom(70000))
    write_erofs(src, tmp_path / "a")
    write_erofs(src, tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes()
    assert (TiB >> chunk_bits_for(TiB)) <= MAX_MAP_ENTRIES and chunk_bits_for(1) == 12


def test_not_a_directory_is_refused(tmp_path: Path) -> None:
    from bus.errors import ImageError

    (tmp_path / "f").write_text("x")
    with pytest.raises(ImageError, match="not a directory"):
        write_erofs(tmp_path / "f", tmp_path / "img")
    assert not (tmp_path / "img").exists()
