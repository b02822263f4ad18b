"""Layer sources: a directory, a tarball, an OCI image layout, or an existing layer / template.

Tarballs and OCI layers are applied into a staging directory with a scoped, symlink-safe extractor
(paths never escape the staging root). OCI whiteouts are honoured: ``.wh.<name>`` deletes ``<name>``
from what lower layers put there, ``.wh..wh..opq`` hides every lower sibling. A whiteout whose target
is not in the staging tree (it lives in a lower dsec layer) becomes an overlayfs whiteout (a 0:0 char
device; an opaque directory gets ``trusted.overlay.opaque=y``), so the deletion still applies when
the host agent stacks the layers with overlayfs.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.errors import ImageError, InvalidArgument

WH_PREFIX = ".wh."
WH_OPAQUE = ".wh..wh..opq"


@dataclass(frozen=True)
class Source:
    kind: str  # dir, tar, oci, layer, template
    spec: str  # path, digest or template name
    ref: str = ""  # OCI: the ref.name annotation to pick (path:ref)

    def describe(self) -> str:
        return f"{self.kind}:{self.spec}" + (f":{self.ref}" if self.ref else "")


def is_oci_layout(path: Path) -> bool:
    return path.is_dir() and (path / "oci-layout").is_file() and (path / "index.json").is_file()


def parse_source(spec: str) -> Source:
    """Classify a SRC argument: ``layer:<digest>``, ``template:<name>``, an OCI layout dir
    (optionally ``DIR:ref``), a directory, or a tarball (.tar, .tar.gz, .tgz, .tar.xz, .tar.bz2)."""
    if not spec:
        raise InvalidArgument("empty source")
    if spec.startswith("layer:"):
        from ._util import full_digest

        try:
            return Source("layer", full_digest(spec[6:]))
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
    if spec.startswith("template:"):
        return Source("template", spec[9:])
    p = Path(spec)
    if not p.exists() and ":" in spec:
        base, _, ref = spec.rpartition(":")
        if is_oci_layout(Path(base)):
            return Source("oci", str(Path(base).resolve()), ref)
    if not p.exists():
        raise InvalidArgument(f"source not found: {spec}")
    if is_oci_layout(p):
        return Source("oci", str(p.resolve()))
    if p.is_dir():
        return Source("dir", str(p.resolve()))
    if p.is_file():
        if not tarfile.is_tarfile(p):
            raise InvalidArgument(f"not a tarball (or an unsupported compression): {spec}")
        return Source("tar", str(p.resolve()))
    raise InvalidArgument(f"unsupported source: {spec}")


# --- fingerprints (to skip rebuilding an unchanged source) ---------------------------------------
def dir_fingerprint(root: str | os.PathLike[str]) -> str:
    """A hash of the tree's metadata (names, types, modes, owners, sizes, mtimes, ctimes, link targets)."""
    h = hashlib.sha256()
    rootp = os.fspath(root)

    def walk(d: str, rel: str) -> None:
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError as exc:
            raise ImageError(f"cannot read {d}: {exc}") from exc
        for e in entries:
            st = e.stat(follow_symlinks=False)
            r = f"{rel}/{e.name}"
            link = os.readlink(e.path) if stat.S_ISLNK(st.st_mode) else ""
            h.update(
                f"{r}\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}"
                f"\0{st.st_rdev}\0{st.st_nlink}\0{link}\n".encode("utf-8", "surrogateescape")
            )
            if stat.S_ISDIR(st.st_mode):
                walk(e.path, r)

    st = os.stat(rootp)
    h.update(f".\0{st.st_mode}\0{st.st_uid}\0{st.st_gid}\n".encode())
    walk(rootp, "")
    return h.hexdigest()


def file_fingerprint(path: str | os.PathLike[str]) -> str:
    st = os.stat(path)
    return hashlib.sha256(f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}".encode()).hexdigest()


def oci_fingerprint(layout: str | os.PathLike[str], ref: str = "") -> str:
    manifest_digest, _ = _oci_manifest(Path(layout), ref)
    return hashlib.sha256(f"oci\0{manifest_digest}".encode()).hexdigest()


def source_fingerprint(src: Source) -> str:
    if src.kind == "dir":
        return "dir:" + dir_fingerprint(src.spec)
    if src.kind == "tar":
        return "tar:" + file_fingerprint(src.spec)
    if src.kind == "oci":
        return "oci:" + oci_fingerprint(src.spec, src.ref)
    raise ValueError(f"no fingerprint for {src.kind}")


# --- OCI image layout ---------------------------------------------------------------------------
_INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")


def _blob_path(layout: Path, digest: str) -> Path:
    alg, _, hexd = digest.partition(":")
    if not alg or not hexd or "/" in hexd or "/" in alg or hexd.startswith("."):
        raise ImageError(f"bad OCI digest {digest!r}")
    p = layout / "blobs" / alg / hexd
    if not p.is_file():
        raise ImageError(f"OCI blob missing: {p}")
    return p


def _pick(descs: list[dict[str, Any]], ref: str) -> dict[str, Any]:
    if not descs:
        raise ImageError("OCI index lists no manifests")
    if ref:
        for d in descs:
            if (d.get("annotations") or {}).get("org.opencontainers.image.ref.name") == ref:
                return d
        raise ImageError(f"no manifest with ref {ref!r} in the OCI layout")
    if len(descs) == 1:
        return descs[0]
    for d in descs:
        plat = d.get("platform") or {}
        if plat.get("os", "linux") == "linux" and plat.get("architecture") in ("amd64", None):
            return d
    return descs[0]


def _oci_manifest(layout: Path, ref: str = "") -> tuple[str, dict[str, Any]]:
    """(manifest digest, manifest json) of the image the layout's index.json points at."""
    index = json.loads((layout / "index.json").read_text())
    desc = _pick(index.get("manifests") or [], ref)
    for _ in range(4):  # nested indexes
        doc = json.loads(_blob_path(layout, desc["digest"]).read_text())
        if desc.get("mediaType") in _INDEX_TYPES or doc.get("mediaType") in _INDEX_TYPES or "manifests" in doc:
            desc = _pick(doc.get("manifests") or [], "")
            continue
        return desc["digest"], doc
    raise ImageError("OCI index nesting too deep")


def oci_layer_paths(layout: str | os.PathLike[str], ref: str = "") -> list[Path]:
    lp = Path(layout)
    _, manifest = _oci_manifest(lp, ref)
    out = []
    for layer in manifest.get("layers") or []:
        mt = layer.get("mediaType", "")
        if "zstd" in mt:
            raise ImageError(f"zstd-compressed OCI layers are not supported: {layer.get('digest')}")
        if "nondistributable" in mt and not (lp / "blobs").exists():
            raise ImageError("foreign layer not present")
        out.append(_blob_path(lp, layer["digest"]))
    return out


# --- scoped extraction ---------------------------------------------------------------------------
def _norm(name: str) -> str:
    """Archive member name -> a clean relative path ('' for the root); refuses '..'."""
    n = name.replace("\\", "/")
    n = posixpath.normpath("/" + n).lstrip("/")
    if n in ("", "."):
        return ""
    if any(part == ".." for part in n.split("/")):
        raise ImageError(f"unsafe path in archive: {name!r}")
    return n


def _resolve_parent(root: Path, rel: str) -> Path:
    """The real on-disk directory of ``dirname(rel)``, following symlinks *inside* the root only
    (like a chroot would), creating missing directories."""
    parts = [p for p in posixpath.dirname(rel).split("/") if p]
    cur: list[str] = []
    budget = 40
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if cur:
                cur.pop()
            continue
        candidate = root.joinpath(*cur, part)
        try:
            st = os.lstat(candidate)
        except FileNotFoundError:
            os.mkdir(candidate, 0o755)
            cur.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            budget -= 1
            if budget <= 0:
                raise ImageError(f"too many symlinks resolving {rel!r}")
            target = os.readlink(candidate)
            tparts = [p for p in target.split("/") if p]
            if target.startswith("/"):
                cur = []
            parts = tparts + parts
            continue
        if not stat.S_ISDIR(st.st_mode):
            _remove(candidate)
            os.mkdir(candidate, 0o755)
        cur.append(part)
    return root.joinpath(*cur)


def _remove(p: Path) -> None:
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p)
    else:
        os.unlink(p)


def _set_meta(path: Path, ti: tarfile.TarInfo, *, is_link: bool) -> None:
    try:
        os.lchown(path, ti.uid, ti.gid)
    except OSError:
        pass
    if not is_link:
        os.chmod(path, ti.mode & 0o7777)
    for k, v in (ti.pax_headers or {}).items():
        if k.startswith("SCHILY.xattr."):
            try:
                os.setxattr(path, k[len("SCHILY.xattr.") :], v.encode("utf-8", "surrogateescape"), follow_symlinks=False)
            except OSError:
                pass
    try:
        os.utime(path, (ti.mtime, ti.mtime), follow_symlinks=False)
    except (OSError, NotImplementedError):
        pass


def _overlay_whiteout(path: Path) -> None:
    try:
        os.mknod(path, stat.S_IFCHR | 0o000, os.makedev(0, 0))
    except OSError as exc:
        raise ImageError(f"cannot create overlay whiteout {path}: {exc}") from exc


def apply_tar(tar_path: str | os.PathLike[str], root: str | os.PathLike[str], *, overlay_whiteouts: bool = True) -> int:
    """Apply one tar layer onto the staging dir ``root``; returns the number of entries applied."""
    rootp = Path(root)
    seen: set[str] = set()
    opaque_done: set[str] = set()
    count = 0
    dir_meta: list[tuple[Path, tarfile.TarInfo]] = []
    try:
        tf = tarfile.open(tar_path, mode="r|*")  # noqa: SIM115 - closed by the `with` below; open errors get their own message
    except tarfile.TarError as exc:
        raise ImageError(f"cannot read tarball {tar_path}: {exc}") from exc
    with tf:
        for ti in tf:
            rel = _norm(ti.name)
            base = posixpath.basename(rel)
            if rel == "":
                if ti.isdir():
                    dir_meta.append((rootp, ti))
                continue
            if base == WH_OPAQUE:
                _apply_opaque(rootp, rel, seen, opaque_done, overlay_whiteouts)
                continue
            if base.startswith(WH_PREFIX):
                _apply_whiteout(rootp, rel, base[len(WH_PREFIX) :], overlay_whiteouts)
                continue
            path = _resolve_parent(rootp, rel) / base
            seen.add(rel)
            count += 1
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                st = None
            if st is not None and not (ti.isdir() and stat.S_ISDIR(st.st_mode)):
                _remove(path)
            if ti.isdir():
                if st is None or not stat.S_ISDIR(st.st_mode):
                    os.mkdir(path, 0o755)
                dir_meta.append((path, ti))
                continue
            _extract_entry(tf, ti, path, rootp)
    # directory metadata last (deepest first) so children do not bump it again
    for path, ti in reversed(dir_meta):
        _set_meta(path, ti, is_link=False)
    return count


def _apply_opaque(rootp: Path, rel: str, seen: set[str], opaque_done: set[str], overlay_whiteouts: bool) -> None:
    """An opaque-dir marker: what lower layers put in the directory goes (not what this layer added)."""
    parent_rel = posixpath.dirname(rel)
    parent = _resolve_parent(rootp, rel)
    if parent_rel in opaque_done:
        return
    opaque_done.add(parent_rel)
    for child in list(parent.iterdir()):
        crel = posixpath.join(parent_rel, child.name) if parent_rel else child.name
        if crel not in seen:
            _remove(child)
    if overlay_whiteouts:
        try:
            os.setxattr(parent, "trusted.overlay.opaque", b"y")
        except OSError:
            pass


def _apply_whiteout(rootp: Path, rel: str, target_name: str, overlay_whiteouts: bool) -> None:
    """A whiteout: the named entry of a lower layer goes (and stays gone under overlayfs)."""
    if not target_name or target_name in (".", ".."):
        return
    target = _resolve_parent(rootp, rel) / target_name
    if os.path.lexists(target):
        _remove(target)
    elif overlay_whiteouts:
        _overlay_whiteout(target)


def _extract_entry(tf: tarfile.TarFile, ti: tarfile.TarInfo, path: Path, rootp: Path) -> None:
    """One non-directory entry at ``path`` (whatever was there is gone already); unknown kinds are skipped."""
    if ti.isreg():
        src = tf.extractfile(ti)
        with open(path, "wb") as out:
            if src is not None:
                shutil.copyfileobj(src, out, 1 << 20)
        _set_meta(path, ti, is_link=False)
    elif ti.issym():
        os.symlink(ti.linkname, path)
        _set_meta(path, ti, is_link=True)
    elif ti.islnk():
        lrel = _norm(ti.linkname)
        if not lrel:
            raise ImageError(f"bad hard link {ti.name} -> {ti.linkname}")
        lpath = _resolve_parent(rootp, lrel) / posixpath.basename(lrel)
        if not os.path.lexists(lpath):
            raise ImageError(f"hard link target missing: {ti.name} -> {ti.linkname}")
        os.link(lpath, path, follow_symlinks=False)
    elif ti.ischr() or ti.isblk():
        kind = stat.S_IFCHR if ti.ischr() else stat.S_IFBLK
        os.mknod(path, kind | (ti.mode & 0o7777), os.makedev(ti.devmajor, ti.devminor))
        _set_meta(path, ti, is_link=False)
    elif ti.isfifo():
        os.mkfifo(path, ti.mode & 0o7777)
        _set_meta(path, ti, is_link=False)


def stage_source(src: Source, staging: str | os.PathLike[str]) -> Path:
    """Materialise a tar / OCI source into ``staging`` (created); a dir source is used in place."""
    if src.kind == "dir":
        return Path(src.spec)
    st = Path(staging)
    st.mkdir(parents=True, exist_ok=True)
    os.chmod(st, 0o755)
    if src.kind == "tar":
        apply_tar(src.spec, st)
    elif src.kind == "oci":
        for layer in oci_layer_paths(src.spec, src.ref):
            apply_tar(layer, st)
    else:
        raise ValueError(f"cannot stage a {src.kind} source")
    return st
