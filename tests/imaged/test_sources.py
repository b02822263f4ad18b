"""Sources -> staging trees -> deterministic EROFS blobs (no NATS needed)."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from bus.errors import InvalidArgument
from imaged import apply_tar, mkfs_erofs, parse_source
from imaged._sources import dir_fingerprint, stage_source
from imaged._util import sha256_file

from .conftest import make_tree, mount_erofs, needs_erofs


def _tar(path: Path, entries: list[tuple[str, str, object]], gz: bool = False) -> Path:
    """entries: (name, kind, payload) with kind in file/dir/sym/link/chr; payload bytes, target or mode."""
    with tarfile.open(path, "w:gz" if gz else "w") as tf:
        for name, kind, payload in entries:
            ti = tarfile.TarInfo(name)
            ti.mtime = 1_700_000_000
            if kind == "file":
                data, mode = payload if isinstance(payload, tuple) else (payload, 0o644)
                ti.size = len(data)
                ti.mode = mode
                tf.addfile(ti, io.BytesIO(data))
                continue
            if kind == "dir":
                ti.type = tarfile.DIRTYPE
                ti.mode = 0o755
            elif kind == "sym":
                ti.type = tarfile.SYMTYPE
                ti.linkname = payload
            elif kind == "link":
                ti.type = tarfile.LNKTYPE
                ti.linkname = payload
            tf.addfile(ti)
    return path


def _oci(layout: Path, layers: list[Path]) -> Path:
    import hashlib

    blobs = layout / "blobs" / "sha256"
    blobs.mkdir(parents=True)
    descs = []
    for lp in layers:
        data = lp.read_bytes()
        h = hashlib.sha256(data).hexdigest()
        (blobs / h).write_bytes(data)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": f"sha256:{h}", "size": len(data)})
    cfg = b"{}"
    ch = hashlib.sha256(cfg).hexdigest()
    (blobs / ch).write_bytes(cfg)
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": f"sha256:{ch}", "size": 2},
                           "layers": descs}).encode()
    mh = hashlib.sha256(manifest).hexdigest()
    (blobs / mh).write_bytes(manifest)
    (layout / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": f"sha256:{mh}", "size": len(manifest),
         "annotations": {"org.opencontainers.image.ref.name": "latest"}}]}))
    return layout


def test_parse_source_kinds(tmp_path: Path) -> None:
    d = make_tree(tmp_path / "d", {"a": "1"})
    t = _tar(tmp_path / "t.tar.gz", [("a", "file", b"1")], gz=True)
    o = _oci(tmp_path / "oci", [t])
    assert parse_source(str(d)).kind == "dir"
    assert parse_source(str(t)).kind == "tar"
    assert parse_source(str(o)).kind == "oci"
    src = parse_source(f"{o}:latest")
    assert (src.kind, src.ref) == ("oci", "latest")
    assert parse_source("layer:sha256:" + "a" * 64).spec == "sha256:" + "a" * 64
    assert parse_source("template:python").spec == "python"
    with pytest.raises(InvalidArgument):
        parse_source(str(tmp_path / "nope"))
    with pytest.raises(InvalidArgument):
        parse_source("layer:xyz")
    (tmp_path / "plain.txt").write_text("not a tar")
    with pytest.raises(InvalidArgument):
        parse_source(str(tmp_path / "plain.txt"))


def test_tar_extraction_is_scoped_and_keeps_metadata(tmp_path: Path) -> None:
    t = _tar(tmp_path / "l.tar", [
        ("etc", "dir", None),
        ("etc/hostname", "file", b"box\n"),
        ("bin/su", "file", (b"\x7fELF", 0o4755)),
        ("escape", "sym", "/etc"),  # absolute symlink: must resolve inside the root
        ("escape/passwd", "file", b"root:x:0:0\n"),
        ("hard", "link", "etc/hostname"),
        ("dotdot", "sym", "../../../../tmp"),
        ("dotdot/x", "file", b"contained"),
    ])
    root = tmp_path / "root"
    root.mkdir()
    apply_tar(t, root)
    assert (root / "etc/passwd").read_bytes() == b"root:x:0:0\n"  # landed inside, through the symlink
    assert (root / "tmp/x").read_bytes() == b"contained"  # '..' clamped at the root
    assert not Path("/tmp/x").exists() or Path("/tmp/x").read_bytes() != b"contained"
    assert os.readlink(root / "escape") == "/etc"
    assert stat.S_IMODE(os.stat(root / "bin/su").st_mode) == 0o4755  # setuid kept
    assert os.stat(root / "hard").st_ino == os.stat(root / "etc/hostname").st_ino
    bad = _tar(tmp_path / "bad.tar", [("../evil", "file", b"x")])
    # '..' at the top of a member name is normalised away (it cannot leave the root)
    root2 = tmp_path / "root2"
    root2.mkdir()
    apply_tar(bad, root2)
    assert (root2 / "evil").read_bytes() == b"x"
    assert not (tmp_path / "evil").exists()


def test_oci_layers_apply_in_order_with_whiteouts(tmp_path: Path) -> None:
    l1 = _tar(tmp_path / "l1.tar.gz", [
        ("app/keep", "file", b"keep"),
        ("app/old", "file", b"old"),
        ("cfg/a", "file", b"a"),
        ("cfg/b", "file", b"b"),
        ("opq/lower", "file", b"lower"),
    ], gz=True)
    l2 = _tar(tmp_path / "l2.tar.gz", [
        ("app/.wh.old", "file", b""),
        ("cfg/b", "file", b"b2"),
        ("opq/new", "file", b"new"),
        ("opq/.wh..wh..opq", "file", b""),
        ("gone/.wh.elsewhere", "file", b""),  # target not in this image: becomes an overlay whiteout
    ], gz=True)
    layout = _oci(tmp_path / "oci", [l1, l2])
    root = stage_source(parse_source(str(layout)), tmp_path / "stage")
    assert (root / "app/keep").read_bytes() == b"keep"
    assert not (root / "app/old").exists()
    assert (root / "cfg/b").read_bytes() == b"b2"
    assert sorted(p.name for p in (root / "opq").iterdir()) == ["new"]
    assert os.getxattr(root / "opq", "trusted.overlay.opaque") == b"y"
    wh = os.lstat(root / "gone/elsewhere")
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0
    assert not any(p.name.startswith(".wh.") for p in root.rglob("*"))


@needs_erofs
async def test_mkfs_is_deterministic(tmp_path: Path, mounts: list) -> None:
    files = {f"d{i}/f{j}": os.urandom(3000 + i * j) for i in range(5) for j in range(6)}
    a = make_tree(tmp_path / "a", files, links={"l": "d1/f1"})
    os.link(a / "d0/f0", a / "hl")
    b = tmp_path / "b"
    subprocess.run(["cp", "-a", str(a), str(b)], check=True)  # new inodes (hard links kept), another readdir order
    os.utime(b / "d3/f2", (1, 1))
    await mkfs_erofs(a, tmp_path / "a1.erofs")
    await mkfs_erofs(a, tmp_path / "a2.erofs")
    await mkfs_erofs(b, tmp_path / "b.erofs")
    da, da2 = sha256_file(tmp_path / "a1.erofs"), sha256_file(tmp_path / "a2.erofs")
    assert da == da2
    assert sha256_file(tmp_path / "b.erofs") == da  # a copy of the tree gives the same blob
    os.utime(a / "d2/f2", (5, 5))
    await mkfs_erofs(a, tmp_path / "a3.erofs")
    assert sha256_file(tmp_path / "a3.erofs") == da
    assert dir_fingerprint(a) != dir_fingerprint(b)
    m = tmp_path / "m"
    mount_erofs(tmp_path / "a1.erofs", m)
    mounts.append(m)
    assert (m / "d4/f5").read_bytes() == files["d4/f5"]
    assert os.readlink(m / "l") == "d1/f1"
    assert os.stat(m / "hl").st_ino == os.stat(m / "d0/f0").st_ino
