"""Snapshots in the blob store: their records (KV ``dsec_snapshots``, written by host agents), removal,
and which layers and chunks they keep alive (so pruning never takes a snapshot's chunks)."""

from __future__ import annotations

import os
import time
from pathlib import Path

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, SnapshotInUse
from bus.messages import LayerRef, SnapshotEvent, SnapshotRecord
from bus.runtime import kv_keys
from bus.streams import ensure_kv

from ._gc import sweep
from ._manifests import list_manifests
from ._store import BlobStore, chunk_key, layer_key
from ._tenancy import check_snapshot
from ._util import digest_hex


async def list_snapshots(js: JetStreamContext) -> list[SnapshotRecord]:
    kv = await ensure_kv(js, S.KV_SNAPSHOTS)
    out: list[SnapshotRecord] = []
    for key in await kv_keys(js, S.KV_SNAPSHOTS):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            continue
        if not entry.value:
            continue
        try:
            out.append(codec.SNAPSHOT.decode(entry.value))
        except BadRequest:
            continue
    return out


def _layers_of(rec: SnapshotRecord) -> list[LayerRef]:
    return [*rec.layers, *([rec.memory_layer] if rec.memory_layer is not None else [])]


async def referenced(js: JetStreamContext, *, skip_snapshot: str = "") -> tuple[set[str], set[str]]:
    """(layer hexes, chunk hexes) that templates and snapshots (but ``skip_snapshot``) reference."""
    layers: set[str] = set()
    chunks: set[str] = set()
    refs = [lay for m in await list_manifests(js) for lay in m.layers]
    refs += [lay for rec in await list_snapshots(js) if rec.snapshot_id != skip_snapshot for lay in _layers_of(rec)]
    for lay in refs:
        layers.add(digest_hex(lay.digest))
        chunks.update(digest_hex(c) for c in lay.chunks)
    return layers, chunks


async def remove_snapshot(
    js: JetStreamContext, store: BlobStore, snapshot_id: str, *, data_dir: str | os.PathLike[str] | None = None, tenant: str = S.OPERATOR_TENANT,
) -> dict[str, int]:
    """Delete a snapshot no other snapshot builds on and no paused sandbox needs, then the layers and
    chunks only it referenced. A chunk another layer shares stays. Only its owner (and the operator)
    may: another ``tenant``'s removal is ``unknown_snapshot`` (_tenancy)."""
    kv = await ensure_kv(js, S.KV_SNAPSHOTS)
    try:
        found: SnapshotRecord | None = codec.SNAPSHOT.decode((await kv.get(snapshot_id)).value or b"")
    except (KeyNotFoundError, BadRequest):
        found = None
    rec = check_snapshot(found, snapshot_id, tenant, "remove")
    children = sorted(r.snapshot_id for r in await list_snapshots(js) if r.parent_id == snapshot_id)
    if children:
        raise SnapshotInUse(
            f"snapshot {snapshot_id} is the parent of {len(children)} snapshot(s) ({', '.join(children[:5])}): remove those first",
            snapshot_id=snapshot_id,
        )
    kv_sbx = await ensure_kv(js, S.KV_SANDBOXES)
    for key in await kv_keys(js, S.KV_SANDBOXES):
        try:
            sr = codec.SANDBOX_RECORD.decode((await kv_sbx.get(key)).value or b"")
        except (KeyNotFoundError, BadRequest):
            continue
        if sr.state == "paused" and sr.snapshot_id == snapshot_id:
            raise SnapshotInUse(f"paused sandbox {key} resumes from snapshot {snapshot_id}", snapshot_id=snapshot_id)
    await kv.delete(snapshot_id)
    keep_layers, keep_chunks = await referenced(js, skip_snapshot=snapshot_id)
    sizes: dict[str, int] = {}  # candidate key -> bytes
    for lay in _layers_of(rec):
        hexd = digest_hex(lay.digest)
        if hexd in keep_layers:
            continue
        sizes[layer_key(hexd)] = 0
        for idx, c in enumerate(lay.chunks):
            if digest_hex(c) not in keep_chunks:
                sizes[chunk_key(c)] = min(lay.chunk_size, lay.size - idx * lay.chunk_size)
    # Through the collector's protocol: a pack reusing one of these chunks right now keeps it.
    gone = await sweep(js, store, sizes)
    removed = {"layers": 0, "chunks": 0, "bytes": sum(sizes[k] for k in gone)}
    for k in gone:
        kind, _, hexd = k.partition("/")
        removed[kind] += 1
        if kind == "layers" and data_dir is not None:
            (Path(data_dir) / "images" / "blobs" / hexd).unlink(missing_ok=True)
    ev = SnapshotEvent(snapshot_id=snapshot_id, kind="removed", at=time.time(), sandbox_id=rec.sandbox_id, parent_id=rec.parent_id,
                       detail={k: str(v) for k, v in removed.items()})
    await js.publish(S.evt_snapshot(snapshot_id, "removed"), codec.encode(ev))
    return removed
