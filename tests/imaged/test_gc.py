"""Garbage collection against the real NATS object store: what nothing references goes, what a
template references stays, and a collection racing a pack that reuses the very same chunks never
leaves that pack's layer with a chunk missing (the pin / tombstone protocol of ``imaged._gc``)."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from bus import codec
from bus import subjects as S
from bus.messages import LayerRef, TemplateManifest
from bus.streams import ensure_kv
from imaged import ImageBuilder
from imaged._gc import _kv, _tomb, collect, collect_local, guard_reuse, pinned, release, sweep, tombstoned
from imaged._store import chunk_key, layer_key

from .conftest import await_for, make_tree, needs_erofs

pytestmark = needs_erofs
CHUNK = 64 * 1024


def _keys(ref: LayerRef) -> list[str]:
    return [layer_key(ref.digest), *(chunk_key(c) for c in ref.chunks)]


async def _present(builder: ImageBuilder, ref: LayerRef) -> list[bool]:
    return [await builder.store.exists(k) for k in _keys(ref)]


async def _whole(builder: ImageBuilder, ref: LayerRef, tmp: Path) -> bool:
    """The layer assembles from the store, every chunk verified (a fresh data dir: no local blob)."""
    fresh = ImageBuilder(builder.js, tmp / f"fresh-{time.monotonic_ns()}", store=builder.store, chunk_size=CHUNK)
    path = await fresh.materialize(ref)
    return path.stat().st_size == ref.size


def _tree(tmp: Path, name: str) -> Path:
    return make_tree(tmp / name, {"a.bin": os.urandom(5 * CHUNK + 100), "sub/b.bin": os.urandom(3 * CHUNK), "c.txt": "small\n"})


async def test_collection_racing_a_pack_that_reuses_every_chunk_keeps_them(js: Any, tmp_path: Path) -> None:
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    src = _tree(tmp_path, "src")
    first = (await builder.pack_dir(src)).ref
    await release(js, first.digest)  # as the host agent once the record is written; then the record goes: garbage
    assert all(await _present(builder, first))
    packs: list[asyncio.Task[Any]] = []

    async def pack_meanwhile(tombstoned_keys: list[str]) -> None:
        # The collection holds its tombstones; a pack of the same tree (the same chunks) starts now,
        # pins what it reuses and waits on the tombstones. The collection reads the pins after this.
        assert set(tombstoned_keys) == set(_keys(first))
        packs.append(asyncio.ensure_future(builder.pack_dir(src)))
        await await_for(lambda: _pinned_all(js, _keys(first)), 10, "the pack to pin its chunks")

    deleted = await sweep(js, builder.store, _keys(first), on_tombstoned=pack_meanwhile)
    assert deleted == []  # all pinned
    again = (await asyncio.wait_for(packs[0], 30)).ref
    assert again.digest == first.digest and again.chunks == first.chunks
    assert all(await _present(builder, again)) and await _whole(builder, again, tmp_path)
    assert not set(_keys(first)) & set(await tombstoned(js))


async def _pinned_all(js: Any, keys: list[str]) -> bool:
    return set(keys) <= await pinned(js)


async def test_collection_deletes_what_no_pack_pinned_and_a_later_pack_uploads_it_again(js: Any, tmp_path: Path) -> None:
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    src = _tree(tmp_path, "src")
    ref = (await builder.pack_dir(src)).ref
    assert await sweep(js, builder.store, _keys(ref)) == []  # pinned until a record references it
    await release(js, ref.digest)
    deleted = await sweep(js, builder.store, _keys(ref))
    assert set(deleted) == set(_keys(ref)) and not any(await _present(builder, ref))
    # Every interleaving of a pack with a collection ends with the whole layer in the store.
    for _ in range(4):
        pack = asyncio.ensure_future(builder.pack_dir(src))
        await sweep(js, builder.store, _keys(ref))
        again = (await asyncio.wait_for(pack, 30)).ref
        assert again.chunks == ref.chunks
        assert all(await _present(builder, ref)) and await _whole(builder, ref, tmp_path)
        await release(js, ref.digest)
        await sweep(js, builder.store, _keys(ref))  # garbage again for the next round


async def test_collect_keeps_what_a_template_references(js: Any, tmp_path: Path, uid: str) -> None:
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    kept = (await builder.pack_dir(_tree(tmp_path, "kept"), role="base")).ref
    gone = (await builder.pack_dir(_tree(tmp_path, "gone"))).ref
    kv = await ensure_kv(js, S.KV_IMAGES)
    name = f"gc-{uid}"
    await kv.put(name, codec.encode(TemplateManifest(name=name, created_at=time.time(), layers=[kept])))
    try:
        for ref in (kept, gone):
            await release(js, ref.digest)
        out = await collect(js, builder.store, data_dir=tmp_path / "data", local_grace_s=0.0)
        assert out["layers"] >= 1 and out["chunks"] >= len(gone.chunks)
        assert not any(await _present(builder, gone))
        assert all(await _present(builder, kept)) and await _whole(builder, kept, tmp_path)
        blobs = tmp_path / "data" / "images" / "blobs"
        assert (blobs / gone.digest[7:]).exists() is False and (blobs / kept.digest[7:]).exists()
    finally:
        await kv.delete(name)


async def test_a_crashed_collections_tombstone_holds_a_writer_only_until_its_deadline(js: Any) -> None:
    key = chunk_key("sha256:" + os.urandom(32).hex())
    kv = await _kv(js)
    deadline = time.time() + 0.5
    await kv.create(_tomb(key), str(deadline).encode())  # as a collection that died after tombstoning
    t0 = time.time()
    await asyncio.wait_for(guard_reuse(js, key.replace('chunks/', 'sha256:'), [key]), 5)
    assert time.time() >= deadline and time.time() - t0 < 3
    from imaged._gc import clear_stale_tombstones

    assert await clear_stale_tombstones(js) >= 1 and key not in await tombstoned(js)


def test_collect_local_takes_old_leftovers_only(tmp_path: Path) -> None:
    d = tmp_path / "data"
    old, new = time.time() - 7200, time.time()
    made = {
        "images/tmp/pack-dead/layer.erofs": old, "criu/snap-dead/img/pages-1.img": old, "images/blobs/" + "a" * 64: old,
        "images/tmp/pack-live/layer.erofs": new, "criu/snap-live/img/pages-1.img": new, "images/blobs/" + "b" * 64: old,
    }
    for rel, t in made.items():
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"x" * 5000)
        for q in (p, p.parent, p.parent.parent) if "blobs" not in rel else (p,):
            os.utime(q, (t, t))
    # An old dir with something new deep inside: a long build still writing.
    deep = d / "images/tmp/build-long/rootfs/usr/lib/new.so"
    deep.parent.mkdir(parents=True)
    deep.write_bytes(b"y")
    for q in (d / "images/tmp/build-long", d / "images/tmp/build-long/rootfs", d / "images/tmp/build-long/rootfs/usr"):
        os.utime(q, (old, old))
    n, freed = collect_local(d, keep_layers={"b" * 64}, grace_s=3600)
    assert deep.exists()
    assert n == 3 and freed >= 3 * 5000
    assert not (d / "images/tmp/pack-dead").exists() and not (d / "criu/snap-dead").exists() and not (d / "images/blobs" / ("a" * 64)).exists()
    assert (d / "images/tmp/pack-live").exists() and (d / "criu/snap-live").exists() and (d / "images/blobs" / ("b" * 64)).exists()


async def test_dsec_gc_command(js: Any, nats_server: Any, tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from .conftest import REPO

    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    ref = (await builder.pack_dir(_tree(tmp_path, "src"))).ref
    await release(js, ref.digest)  # a snapshot's layer whose record was removed
    dead = tmp_path / "data" / "criu" / "snap-died" / "img"
    dead.mkdir(parents=True)
    (dead / "pages-1.img").write_bytes(b"p" * 10000)
    for q in (dead / "pages-1.img", dead, dead.parent):
        os.utime(q, (time.time() - 7200, time.time() - 7200))
    p = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "imaged.cli", "--nats-url", nats_server.url, "gc", "--json", "--data-dir", str(tmp_path / "data")],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["layers"] >= 1 and out["chunks"] >= len(ref.chunks) and out["local_files"] >= 1
    assert not any(await _present(builder, ref)) and not dead.parent.exists()
