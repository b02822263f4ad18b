"""Snapshots of a container sandbox's files: what changed in its overlay upper dir since its last
snapshot, packed as one more EROFS layer in the blob store (by this host's lazy loader, over
``dsec.imaged.<host>.pack``), so a chain of snapshots is a chain of layers and a restore is an
ordinary create over the template's layers plus the chain.

The upper dir itself keeps growing while the sandbox lives (a running container's root cannot be
swapped), so each snapshot packs only the difference against an index of the upper dir taken at the
previous one (inode, ctime and kind of every path; ctime moves on any change of data or metadata and
cannot be set from inside): new or changed entries go in as hard links (same inode: data, owner,
mode, xattrs, times exact; no copy), entries gone since then become whiteouts, and a directory
replaced since then becomes opaque. The sandbox is frozen (cgroup freezer) from the diff until the
layer is in the store (``_freezer``), so the files are exactly one moment's.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

import msgspec

from bus.errors import SnapshotUnsupported

OPAQUE = "trusted.overlay.opaque"
INDEX_NAME = "snapshot.idx"  # beside upper/ in the sandbox's scratch dir: it goes when the sandbox goes
STAGE_NAME = "snapshot-stage"

# path (relative to the upper dir) -> (inode, ctime ns, is a directory)
Index = dict[str, tuple[int, int, bool]]
_idx_enc = msgspec.msgpack.Encoder()
_idx_dec = msgspec.msgpack.Decoder(dict[str, tuple[int, int, bool]])


def walk(root: str) -> Index:
    """Every entry under ``root`` (not ``root`` itself), not following symlinks."""
    out: Index = {}
    stack = [""]
    while stack:
        rel = stack.pop()
        with os.scandir(os.path.join(root, rel) if rel else root) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                p = f"{rel}/{e.name}" if rel else e.name
                isdir = stat.S_ISDIR(st.st_mode)
                out[p] = (st.st_ino, st.st_ctime_ns, isdir)
                if isdir:
                    stack.append(p)
    return out


def load_index(sandbox_dir: str) -> Index:
    try:
        return _idx_dec.decode(Path(sandbox_dir, INDEX_NAME).read_bytes())
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return {}


def save_index(sandbox_dir: str, index: Index) -> None:
    p = Path(sandbox_dir, INDEX_NAME)
    tmp = p.with_suffix(".tmp")
    tmp.write_bytes(_idx_enc.encode(index))
    os.replace(tmp, p)


def _copy_dir_meta(src: str, dst: str, *, opaque: bool) -> None:
    st = os.lstat(src)
    os.chown(dst, st.st_uid, st.st_gid)
    os.chmod(dst, stat.S_IMODE(st.st_mode))
    for name in os.listxattr(src, follow_symlinks=False):
        if name != OPAQUE:
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False), follow_symlinks=False)
    if opaque:
        os.setxattr(dst, OPAQUE, b"y")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
        return
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK):
            raise
    # An immutable or append-only file cannot be linked: copy it, owner, mode, xattrs and times too.
    st = os.lstat(src)
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode):
        shutil.copyfile(src, dst, follow_symlinks=False)
        os.chmod(dst, stat.S_IMODE(st.st_mode))
        for name in os.listxattr(src, follow_symlinks=False):
            os.setxattr(dst, name, os.getxattr(src, name, follow_symlinks=False))
    else:
        raise SnapshotUnsupported(f"cannot capture {src!r} (mode {oct(st.st_mode)}): {os.strerror(errno.EPERM)}")
    os.lchown(dst, st.st_uid, st.st_gid)
    os.utime(dst, ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)


@dataclass
class Diff:
    entries: int = 0  # files, links and whiteouts staged (directories not counted)
    whiteouts: int = 0


def stage_diff(upper: str, stage: str, prev: Index) -> Diff:
    """Fill ``stage`` (a new directory on the upper dir's file system) with what changed in ``upper``
    since the index ``prev`` was taken (empty ``prev``: everything)."""
    cur = walk(upper)
    diff = Diff()
    os.mkdir(stage, 0o700)
    _copy_dir_meta(upper, stage, opaque=False)
    replaced: set[str] = set()  # directories recreated since prev: staged whole and opaque
    dirs: list[str] = []
    for rel in sorted(cur):  # parents sort before their children
        ino, ctime, isdir = cur[rel]
        src, dst = os.path.join(upper, rel), os.path.join(stage, rel)
        parent = rel.rpartition("/")[0]
        inside_replaced = parent in replaced
        old = prev.get(rel)
        if isdir:
            new_dir = old is None or old[0] != ino or not old[2]
            if new_dir and old is not None or inside_replaced:
                replaced.add(rel)
            os.mkdir(dst)
            # Unchanged dirs are scaffolding for what changed below; their opaque flag (if any) is in
            # an earlier snapshot's layer already. A replaced one must hide that earlier layer's content.
            _copy_dir_meta(src, dst, opaque=rel in replaced or (new_dir and bool(_opaque(src))))
            dirs.append(rel)
            continue
        if inside_replaced or old is None or old[0] != ino or old[1] != ctime or old[2]:
            _link_or_copy(src, dst)
            diff.entries += 1
    for rel in sorted(prev):
        if rel in cur:
            continue
        parent = rel.rpartition("/")[0]
        if parent and (parent not in cur or parent in replaced or not cur[parent][2]):
            continue  # the parent went too (its own whiteout hides this) or is opaque now
        os.mknod(os.path.join(stage, rel), stat.S_IFCHR | 0o000, os.makedev(0, 0))
        diff.entries += 1
        diff.whiteouts += 1
    # Directory times last: staging their children moved them.
    for rel in reversed(dirs):
        st = os.lstat(os.path.join(upper, rel))
        os.utime(os.path.join(stage, rel), ns=(st.st_atime_ns, st.st_mtime_ns), follow_symlinks=False)
    st = os.lstat(upper)
    os.utime(stage, ns=(st.st_atime_ns, st.st_mtime_ns))
    if diff.entries == 0 and any(os.scandir(stage)):
        diff.entries = len(dirs)  # only directories changed (a mode, say): still worth a layer
    return diff


def _opaque(path: str) -> bytes:
    try:
        return os.getxattr(path, OPAQUE, follow_symlinks=False)
    except OSError:
        return b""


def remove_stage(stage: str) -> None:
    shutil.rmtree(stage, ignore_errors=True)


__all__ = ["Diff", "Index", "load_index", "remove_stage", "save_index", "stage_diff", "walk"]
