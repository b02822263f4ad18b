"""A fork's frozen copy (hostagent._forks.copy_tree) keeps what an overlay lower dir needs, and a chain
with a layer twice stacks it once (hostagent._snapshots.dedup_layers). Real files on this host's disk."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from bus.messages import LayerRef
from hostagent._forks import copy_tree, is_fork_layer, owner_of
from hostagent._snapshots import dedup_layers

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="whiteouts (mknod) and trusted.* xattrs need root")


def _entries(root: Path) -> dict[str, tuple[int, int, int, int, int, bytes, str, dict[str, bytes]]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath, name)
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else b""
            link = os.readlink(p) if p.is_symlink() else ""
            xattrs = {n: os.getxattr(p, n, follow_symlinks=False) for n in os.listxattr(p, follow_symlinks=False)}
            out[str(p.relative_to(root))] = (st.st_mode, st.st_uid, st.st_gid, st.st_rdev, st.st_mtime_ns, data, link, xattrs)
    return out


@needs_root
def test_copy_keeps_whiteouts_opaque_dirs_owners_modes_links(tmp_path: Path) -> None:
    src = tmp_path / "stage"
    (src / "d" / "sub").mkdir(parents=True)
    (src / "d" / "f").write_text("content\n")
    os.chmod(src / "d" / "f", 0o4751)
    os.chown(src / "d" / "f", 1234, 567)
    os.symlink("f", src / "d" / "link")
    os.link(src / "d" / "f", src / "d" / "hard")
    os.mknod(src / "d" / "gone", stat.S_IFCHR | 0o000, os.makedev(0, 0))  # a whiteout
    os.setxattr(src / "d" / "sub", "trusted.overlay.opaque", b"y")
    os.setxattr(src / "d" / "f", "user.meta", b"v")
    with open(src / "d" / "sparse", "wb") as f:
        f.truncate(8 << 20)
        f.write(b"head")
    dest = tmp_path / "forks" / "snap-x"
    dest.parent.mkdir()
    copy_tree(str(src), str(dest))
    assert _entries(dest) == _entries(src)
    assert os.stat(dest / "d" / "f").st_ino == os.stat(dest / "d" / "hard").st_ino  # one file, two names, as in the upper
    assert os.stat(dest / "d" / "f").st_ino != os.stat(src / "d" / "f").st_ino  # a copy: the source's later writes stay its own
    assert os.stat(dest / "d" / "sparse").st_blocks * 512 < 1 << 20  # the hole stays a hole
    assert not (tmp_path / "forks" / "snap-x.part").exists()


def test_copy_failure_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "snap-y"
    with pytest.raises(OSError) as ei:
        copy_tree(str(tmp_path / "missing"), str(dest))
    assert "cannot copy the fork's files" in str(ei.value)
    assert sorted(os.listdir(tmp_path)) == []


def _lay(digest: str, role: str = "snapshot") -> LayerRef:
    return LayerRef(role=role, digest=digest, kind="erofs")


def test_dedup_keeps_the_topmost_copy() -> None:
    a, b, c = _lay("sha256:a"), _lay("sha256:b"), _lay("sha256:c")
    assert dedup_layers([a, b, a]) == [b, a]  # lowest first: the upper a hides all the lower a holds
    assert dedup_layers([a, b, c]) == [a, b, c]
    assert dedup_layers([a, a, b, a, c]) == [b, a, c]


def test_fork_layer_names_its_snapshot() -> None:
    ref = LayerRef(role="fork", digest="sha256:x", kind="dir", path="/data/forks/snap-abc")
    assert is_fork_layer(ref) and owner_of(ref) == "snap-abc"
    assert not is_fork_layer(_lay("sha256:x")) and not is_fork_layer(LayerRef(role="base", digest="sha256:y", kind="dir", path="/r"))
