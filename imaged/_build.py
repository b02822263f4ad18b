"""Build layers and templates: source -> deterministic EROFS blob -> chunks in the blob store -> manifest."""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from msgspec import structs
from nats.js import JetStreamContext

from bus.errors import ImageError, InvalidArgument, UnknownTemplate
from bus.messages import LayerRef, TemplateManifest

from ._erofs import EROFS_UUID, mkfs_erofs, mkfs_version
from ._erofs_write import write_erofs
from ._manifests import (
    ROLES,
    check_name,
    delete_manifest,
    find_layer,
    get_manifest,
    list_manifests,
    publish_event,
    put_manifest,
    require_manifest,
)
from ._progress import ProgressFn, null_progress
from ._sources import Source, parse_source, source_fingerprint, stage_source
from ._gc import collect, guard_reuse, release
from ._store import BlobNotFound, BlobStore, chunk_key, layer_key, open_blob_store
from ._util import (
    DEFAULT_CHUNK_SIZE,
    atomic_write_json,
    chunk_digests,
    data_dir as _data_dir,
    digest_hex,
    read_json,
    sha256_bytes,
)

FORMAT_VERSION = 1


@dataclass
class LayerBuild:
    """What building (or reusing) one layer did."""

    ref: LayerRef
    uploaded_bytes: int = 0
    uploaded_chunks: int = 0
    built: bool = False  # mkfs.erofs ran (False: cache hit or an existing layer/template reference)
    source: str = ""

    def as_json(self) -> dict[str, Any]:
        return {
            "role": self.ref.role,
            "digest": self.ref.digest,
            "size": self.ref.size,
            "chunks": len(self.ref.chunks),
            "built": self.built,
            "uploaded_bytes": self.uploaded_bytes,
            "source": self.source,
        }


@dataclass
class BuildResult:
    manifest: TemplateManifest
    layers: list[LayerBuild] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def uploaded_bytes(self) -> int:
        return sum(lb.uploaded_bytes for lb in self.layers)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.manifest.name,
            "layers": [lb.as_json() for lb in self.layers],
            "total_bytes": sum(lb.ref.size for lb in self.layers),
            "uploaded_bytes": self.uploaded_bytes,
            "seconds": round(self.seconds, 3),
        }


async def _maybe_await(value: Any) -> Any:
    if inspect.isawaitable(value):
        return await value
    return value


class ImageBuilder:
    """Builds layers into ``<data_dir>/images/blobs/<hex>`` and uploads their chunks to the blob store.

    Unchanged sources are not rebuilt (a fingerprint of the source -> digest cache), and layers whose
    record is already in the store are not uploaded again; new chunks of a changed layer are uploaded
    only when the store does not have them (chunks are shared across layers and templates).
    """

    def __init__(
        self,
        js: JetStreamContext | None,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        store: BlobStore | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        compress: str | None = None,
        all_root: bool = False,
        progress: ProgressFn | None = None,
        upload_concurrency: int = 4,
    ) -> None:
        if chunk_size < 4096 or chunk_size % 4096:
            raise InvalidArgument("chunk_size must be a multiple of 4096")
        self.js = js
        self.data_dir = _data_dir(data_dir)
        self.images_dir = self.data_dir / "images"
        self.blobs_dir = self.images_dir / "blobs"
        self.tmp_dir = self.images_dir / "tmp"
        self.cache_file = self.images_dir / "build-cache.json"
        self.store = store if store is not None else open_blob_store(js)
        self.chunk_size = chunk_size
        self.compress = compress
        self.all_root = all_root
        self.progress = progress or null_progress
        self.upload_concurrency = max(1, upload_concurrency)
        for d in (self.blobs_dir, self.tmp_dir):
            d.mkdir(parents=True, exist_ok=True)

    # --- paths -----------------------------------------------------------------------------
    def blob_path(self, digest: str) -> Path:
        return self.blobs_dir / digest_hex(digest)

    def _chunks_path(self, hexd: str) -> Path:
        return self.blobs_dir / f"{hexd}.chunks.json"

    def _options_key(self) -> str:
        return json.dumps(
            {
                "v": FORMAT_VERSION,
                "chunk": self.chunk_size,
                "z": self.compress or "",
                "root": self.all_root,
                "uuid": EROFS_UUID,
                "mkfs": mkfs_version(),
            },
            sort_keys=True,
        )

    # --- layers ----------------------------------------------------------------------------
    async def build_layer(self, role: str, source: str | Source | os.PathLike[str]) -> LayerBuild:
        if role not in ROLES:
            raise InvalidArgument(f"bad layer role {role!r} (one of {', '.join(ROLES)})")
        src = source if isinstance(source, Source) else parse_source(os.fspath(source))
        if src.kind == "layer":
            ref, _ = await find_layer(self.js, self.store, src.spec)
            if ref is None:
                raise ImageError(f"unknown layer {src.spec}", layer=src.spec)
            return LayerBuild(ref=self._with_local(structs.replace(ref, role=role)), source=src.describe())
        if src.kind == "template":
            return LayerBuild(ref=await self._layer_of_template(src.spec, role), source=src.describe())

        stage = f"{role}: build"
        self.progress(stage, 0, 0)
        fp = await asyncio.to_thread(source_fingerprint, src)
        cache_key = hashlib.sha256(f"{fp}\0{self._options_key()}".encode()).hexdigest()
        cache = read_json(self.cache_file, {}) or {}
        hexd = cache.get(cache_key)
        built = False
        chunks: list[str] | None = None
        if hexd and self.blob_path(hexd).is_file():
            chunks = self._load_chunks(hexd)
        if not chunks:
            hexd, chunks = await self._mkfs(src)
            built = True
            cache = read_json(self.cache_file, {}) or {}
            cache[cache_key] = hexd
            atomic_write_json(self.cache_file, cache)
        assert hexd is not None
        blob = self.blob_path(hexd)
        ref = LayerRef(
            role=role,
            digest=f"sha256:{hexd}",
            size=blob.stat().st_size,
            kind="erofs",
            path=str(blob),
            chunks=[f"sha256:{c}" for c in chunks],
            chunk_size=self.chunk_size,
        )
        self.progress(stage, ref.size, ref.size)
        up_bytes, up_chunks = await self.upload_layer(ref, blob)
        return LayerBuild(ref=ref, uploaded_bytes=up_bytes, uploaded_chunks=up_chunks, built=built, source=src.describe())

    def _load_chunks(self, hexd: str) -> list[str] | None:
        rec = read_json(self._chunks_path(hexd))
        if isinstance(rec, dict) and rec.get("chunk_size") == self.chunk_size and isinstance(rec.get("chunks"), list):
            chunks: list[str] = rec["chunks"]
            return chunks
        return None

    async def _mkfs(self, src: Source) -> tuple[str, list[str]]:
        work = Path(tempfile.mkdtemp(prefix="build-", dir=self.tmp_dir))
        try:
            tree = await asyncio.to_thread(stage_source, src, work / "rootfs")
            out = work / "layer.erofs"
            await mkfs_erofs(tree, out, compress=self.compress, all_root=self.all_root)
            hexd, chunks = await asyncio.to_thread(chunk_digests, out, self.chunk_size)
            dest = self.blob_path(hexd)
            if dest.exists():
                out.unlink()
            else:
                os.chmod(out, 0o444)
                os.replace(out, dest)
            atomic_write_json(self._chunks_path(hexd), {"chunk_size": self.chunk_size, "chunks": chunks})
            return hexd, chunks
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)

    async def pack_dir(self, path: str | os.PathLike[str], role: str = "snapshot") -> LayerBuild:
        """Pack directory ``path`` as it is into a layer (no staging copy, no source cache): whiteouts
        (0/0 character devices), opaque dirs (``trusted.overlay.opaque``), xattrs, owners, modes, hard
        links and per-file times are kept, so an overlay upper dir packed here stacks as a lower layer
        with the very same view. The blob stays in ``blobs/`` for this host to mount directly.

        Packed by ``write_erofs``, not mkfs.erofs: holes stay holes and repeated chunks are stored
        once, so a sparse file costs what its data costs (mkfs.erofs 1.5 writes every hole out)."""
        work = Path(tempfile.mkdtemp(prefix="pack-", dir=self.tmp_dir))
        try:
            out = work / "layer.erofs"
            await asyncio.to_thread(write_erofs, path, out)
            hexd, chunks = await asyncio.to_thread(chunk_digests, out, self.chunk_size)
            dest = self.blob_path(hexd)
            if dest.exists():
                out.unlink()
            else:
                os.chmod(out, 0o444)
                os.replace(out, dest)
        finally:
            await asyncio.to_thread(shutil.rmtree, work, True)
        ref = LayerRef(
            role=role, digest=f"sha256:{hexd}", size=dest.stat().st_size, kind="erofs", path=str(dest),
            chunks=[f"sha256:{c}" for c in chunks], chunk_size=self.chunk_size,
        )
        up_bytes, up_chunks = await self.upload_layer(ref, dest)
        return LayerBuild(ref=ref, uploaded_bytes=up_bytes, uploaded_chunks=up_chunks, built=True, source=str(path))

    async def upload_layer(self, ref: LayerRef, blob: str | os.PathLike[str]) -> tuple[int, int]:
        """Upload the chunks the store lacks, then the layer record. Returns (bytes, chunks) uploaded.
        The keys are pinned first, so a collection running meanwhile cannot take one this reuses."""
        if self.js is not None:
            await guard_reuse(self.js, ref.digest, [layer_key(ref.digest), *(chunk_key(c) for c in ref.chunks)])
        existing = await self.store.get_layer(ref.digest)
        if existing is not None and existing.chunks == ref.chunks and existing.chunk_size == ref.chunk_size:
            return 0, 0
        stage = f"{ref.role}: upload"
        total = ref.size
        done = 0
        uploaded = [0, 0]
        sem = asyncio.Semaphore(self.upload_concurrency)
        seen: set[str] = set()
        fd = os.open(blob, os.O_RDONLY)

        async def one(idx: int, cdig: str) -> None:
            nonlocal done
            async with sem:
                key = chunk_key(cdig)
                length = min(ref.chunk_size, ref.size - idx * ref.chunk_size)
                if not await self.store.exists(key):
                    data = os.pread(fd, length, idx * ref.chunk_size)
                    if sha256_bytes(data) != digest_hex(cdig):
                        raise ImageError(f"blob {blob} changed while uploading (chunk {idx})")
                    await self.store.put(key, data)
                    uploaded[0] += len(data)
                    uploaded[1] += 1
                done += length
                self.progress(stage, done, total)

        try:
            tasks = []
            for idx, cdig in enumerate(ref.chunks):
                if cdig in seen:
                    done += min(ref.chunk_size, ref.size - idx * ref.chunk_size)
                    continue
                seen.add(cdig)
                tasks.append(one(idx, cdig))
            await asyncio.gather(*tasks)
        finally:
            os.close(fd)
        await self.store.put_layer(ref)
        self.progress(stage, total, total)
        return uploaded[0], uploaded[1]

    def _with_local(self, ref: LayerRef) -> LayerRef:
        local = self.blob_path(ref.digest)
        if local.is_file():
            return structs.replace(ref, path=str(local))
        return structs.replace(ref, path="") if ref.path and not Path(ref.path).is_file() else ref

    async def _layer_of_template(self, name: str, role: str) -> LayerRef:
        if self.js is None:
            raise ImageError("template references need NATS")
        m = await require_manifest(self.js, name)
        same = [lay for lay in m.layers if lay.role == role]
        if same:
            return self._with_local(same[0])
        if len(m.layers) == 1:
            return self._with_local(structs.replace(m.layers[0], role=role))
        raise InvalidArgument(f"template {name!r} has no {role} layer (it has {[lay.role for lay in m.layers]})")

    # --- templates --------------------------------------------------------------------------
    async def build_template(
        self,
        name: str,
        base: str | Source | os.PathLike[str],
        workspace: str | Source | os.PathLike[str] | None = None,
        toolkit: str | Source | os.PathLike[str] | None = None,
        *,
        description: str = "",
        owner: str = "",
    ) -> BuildResult:
        """Build (or reuse) each layer, upload what is missing, write the manifest (layers lowest first)."""
        check_name(name)
        if self.js is None:
            raise ImageError("building a template needs NATS (the manifest lives in KV)")
        t0 = time.monotonic()
        builds: list[LayerBuild] = []
        for role, src in (("base", base), ("workspace", workspace), ("toolkit", toolkit)):
            if src is None:
                continue
            builds.append(await self.build_layer(role, src))
        manifest = TemplateManifest(
            name=name, layers=[b.ref for b in builds], created_at=time.time(), description=description, owner=owner,
        )
        await put_manifest(self.js, manifest)
        for b in builds:
            await release(self.js, b.ref.digest)  # the manifest references them now
        result = BuildResult(manifest=manifest, layers=builds, seconds=time.monotonic() - t0)
        await publish_event(
            self.js,
            name,
            "built",
            layers=",".join(f"{b.ref.role}={b.ref.digest}" for b in builds),
            uploaded_bytes=str(result.uploaded_bytes),
        )
        return result

    # --- fetch a whole layer back -------------------------------------------------------------
    async def materialize(self, ref: LayerRef) -> Path:
        """Make sure ``blobs/<hex>`` exists locally, assembling it from the store's chunks (verified)."""
        dest = self.blob_path(ref.digest)
        if dest.is_file() and dest.stat().st_size == ref.size:
            return dest
        if not ref.chunks:
            raise ImageError(f"layer {ref.digest} has no chunk list")
        fd, tmp = tempfile.mkstemp(dir=self.blobs_dir, prefix=".fetch-")
        try:
            for idx, cdig in enumerate(ref.chunks):
                data = await self.store.get(chunk_key(cdig))
                if sha256_bytes(data) != digest_hex(cdig):
                    raise ImageError(f"chunk {cdig} of layer {ref.digest} is corrupt in the store")
                os.pwrite(fd, data, idx * ref.chunk_size)
            os.close(fd)
            fd = -1
            if sha256_file_hex(tmp) != digest_hex(ref.digest):
                raise ImageError(f"layer {ref.digest} does not match its digest after assembly")
            os.chmod(tmp, 0o444)
            os.replace(tmp, dest)
            return dest
        finally:
            if fd >= 0:
                os.close(fd)
            if os.path.exists(tmp):
                os.unlink(tmp)


def sha256_file_hex(path: str) -> str:
    from ._util import sha256_file

    return sha256_file(path)


# --- module-level conveniences --------------------------------------------------------------------
async def build_template(
    js: JetStreamContext,
    name: str,
    base: str | os.PathLike[str],
    workspace: str | os.PathLike[str] | None = None,
    toolkit: str | os.PathLike[str] | None = None,
    *,
    data_dir: str | os.PathLike[str] | None = None,
    store: BlobStore | None = None,
    **opts: Any,
) -> BuildResult:
    """Build template ``name`` from up to three sources (see ``parse_source`` for what a source is)."""
    builder = ImageBuilder(js, data_dir, store=store, **opts)
    return await builder.build_template(name, base, workspace, toolkit)


async def ensure_base_template(
    js: JetStreamContext,
    data_dir: str | os.PathLike[str] | None = None,
    *,
    store: BlobStore | None = None,
    name: str = "base",
    progress: ProgressFn | None = None,
) -> TemplateManifest:
    """The ``base`` template (a busybox rootfs). Idempotent: when the manifest exists and its blob is on
    this machine it returns at once; a missing local blob is assembled from the store. Each layer's
    ``path`` is the local blob file (``<data_dir>/images/blobs/<hex>``) so a host agent on the same
    machine can mount it without the lazy loader."""
    builder = ImageBuilder(js, data_dir, store=store, progress=progress)
    m = await get_manifest(js, name)
    if m is not None and m.layers and all(lay.chunks for lay in m.layers):
        layers = []
        changed = False
        try:
            for lay in m.layers:
                local = await builder.materialize(lay)
                if lay.path != str(local):
                    lay = structs.replace(lay, path=str(local))
                    changed = True
                layers.append(lay)
        except (ImageError, BlobNotFound):
            layers = []
        if layers:
            if changed:
                m = structs.replace(m, layers=layers)
                await put_manifest(js, m)
            return m
    from . import _busybox  # written by another engineer; provides build_busybox_rootfs(dest)

    work = Path(tempfile.mkdtemp(prefix="busybox-", dir=builder.tmp_dir))
    try:
        rootfs = work / "rootfs"
        rootfs.mkdir()
        fn = _busybox.build_busybox_rootfs
        if inspect.iscoroutinefunction(fn):
            await fn(str(rootfs))
        else:
            await _maybe_await(await asyncio.to_thread(fn, str(rootfs)))
        result = await builder.build_template(name, base=str(rootfs), description="busybox base")
        return result.manifest
    finally:
        await asyncio.to_thread(shutil.rmtree, work, True)


async def get_template(js: JetStreamContext, name: str) -> TemplateManifest:
    return await require_manifest(js, name)


async def list_templates(js: JetStreamContext) -> list[TemplateManifest]:
    return await list_manifests(js)


async def remove_template(
    js: JetStreamContext,
    name: str,
    *,
    prune: bool = False,
    store: BlobStore | None = None,
    data_dir: str | os.PathLike[str] | None = None,
) -> dict[str, int]:
    """Delete the manifest; with ``prune`` also delete layers/chunks no other template references."""
    if not await delete_manifest(js, name):
        raise UnknownTemplate(f"no template named {name!r}", template=name)
    await publish_event(js, name, "removed")
    if prune:
        return await prune_unreferenced(js, store=store, data_dir=data_dir)
    return {"layers": 0, "chunks": 0, "blobs": 0}


async def prune_unreferenced(
    js: JetStreamContext, *, store: BlobStore | None = None, data_dir: str | os.PathLike[str] | None = None
) -> dict[str, int]:
    """Garbage-collect layer records, chunks and local blobs that no manifest or snapshot references
    (``_gc.collect``: safe against builds and packs running meanwhile, which pin what they reuse)."""
    store = store if store is not None else open_blob_store(js)
    out = await collect(js, store, data_dir=_data_dir(data_dir), blob_grace_s=0.0)
    return {"layers": out["layers"], "chunks": out["chunks"], "blobs": out["local_files"]}
