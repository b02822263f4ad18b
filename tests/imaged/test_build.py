"""Templates: build, upload only what changed, manifests in KV, the base template, the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import nats.errors
import pytest

from bus import codec
from bus import subjects as S
from bus.errors import UnknownTemplate
from imaged import (
    ImageBuilder,
    ensure_base_template,
    get_template,
    list_templates,
    prune_unreferenced,
    remove_template,
)
from imaged._store import chunk_key
from imaged._util import sha256_bytes

from .conftest import REPO, make_tree, mount_erofs, needs_erofs

pytestmark = needs_erofs
CHUNK = 64 * 1024


def _tarball(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, data in files.items():
            ti = tarfile.TarInfo(name)
            ti.size = len(data)
            ti.mode = 0o644
            tf.addfile(ti, io.BytesIO(data))
    return path


async def test_build_template_three_sources(js, tmp_path: Path, uid: str, mounts: list) -> None:
    base = make_tree(tmp_path / "base", {"bin/tool": os.urandom(300_000), "etc/os-release": "ID=test\n"})
    ws = _tarball(tmp_path / "ws.tar.gz", {"workspace/main.py": b"print('hi')\n", "workspace/data.bin": os.urandom(200_000)})
    tk = make_tree(tmp_path / "tk", {"opt/toolkit/run.sh": "#!/bin/sh\necho tool\n"})
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    res = await builder.build_template(f"t-{uid}", str(base), str(ws), str(tk))
    m = await get_template(js, f"t-{uid}")
    assert m == res.manifest
    assert [lay.role for lay in m.layers] == ["base", "workspace", "toolkit"]
    store = builder.store
    for lay in m.layers:
        assert lay.kind == "erofs" and lay.digest.startswith("sha256:") and lay.chunk_size == CHUNK
        assert len(lay.chunks) == -(-lay.size // CHUNK)
        blob = Path(lay.path)
        assert blob.is_file() and blob.stat().st_size == lay.size
        assert lay.digest == "sha256:" + sha256_bytes(blob.read_bytes())
        for c in set(lay.chunks):
            assert await store.exists(chunk_key(c))
        assert (await store.get_layer(lay.digest)).chunks == lay.chunks
    assert res.uploaded_bytes > 0
    out = res.as_json()
    assert {"role", "digest", "size"} <= set(out["layers"][0]) and out["uploaded_bytes"] == res.uploaded_bytes
    # the blobs are real EROFS images of the sources
    mnt = tmp_path / "mnt"
    mount_erofs(m.layers[1].path, mnt)
    mounts.append(mnt)
    assert (mnt / "workspace/main.py").read_bytes() == b"print('hi')\n"


async def test_changing_one_layer_uploads_only_that_layer(js, tmp_path: Path, uid: str) -> None:
    base = make_tree(tmp_path / "base", {f"lib/f{i}": os.urandom(100_000) for i in range(8)})
    ws = make_tree(tmp_path / "ws", {"workspace/a.txt": "v1\n", "workspace/blob": os.urandom(150_000)})
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    r1 = await builder.build_template(f"c-{uid}", str(base), str(ws))
    assert all(lb.built for lb in r1.layers)
    assert r1.uploaded_bytes >= sum(lb.ref.size for lb in r1.layers) - 2 * CHUNK  # (tiny shared zero chunks)

    r2 = await builder.build_template(f"c-{uid}", str(base), str(ws))  # nothing changed
    assert [lb.built for lb in r2.layers] == [False, False]
    assert r2.uploaded_bytes == 0
    assert r2.manifest.layers == r1.manifest.layers

    (ws / "workspace/a.txt").write_text("v2\n")  # change the workspace only
    r3 = await builder.build_template(f"c-{uid}", str(base), str(ws))
    assert [lb.built for lb in r3.layers] == [False, True]
    assert r3.layers[0].uploaded_bytes == 0 and r3.layers[0].ref == r1.layers[0].ref
    assert r3.layers[1].ref.digest != r1.layers[1].ref.digest
    # the new workspace layer shares most chunks with the old one: only the changed ones go up
    assert 0 < r3.uploaded_bytes < r3.layers[1].ref.size
    assert (await get_template(js, f"c-{uid}")).layers[1].digest == r3.layers[1].ref.digest


async def test_layer_and_template_references(js, tmp_path: Path, uid: str) -> None:
    base = make_tree(tmp_path / "base", {"x": os.urandom(70_000)})
    ws = make_tree(tmp_path / "ws", {"w": "w"})
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    r1 = await builder.build_template(f"r1-{uid}", str(base), str(ws))
    digest = r1.manifest.layers[0].digest
    r2 = await builder.build_template(f"r2-{uid}", f"template:r1-{uid}", f"layer:{r1.manifest.layers[1].digest}")
    assert [lay.digest for lay in r2.manifest.layers] == [digest, r1.manifest.layers[1].digest]
    assert [lay.role for lay in r2.manifest.layers] == ["base", "workspace"]
    assert r2.uploaded_bytes == 0 and not any(lb.built for lb in r2.layers)
    # a fresh builder (another machine, no local blobs) resolves the layer from the store's record
    other = ImageBuilder(js, tmp_path / "other", chunk_size=CHUNK)
    r3 = await other.build_template(f"r3-{uid}", f"layer:{digest}")
    assert r3.manifest.layers[0].chunks == r1.manifest.layers[0].chunks and r3.manifest.layers[0].path == ""
    with pytest.raises(UnknownTemplate):
        await builder.build_template(f"r4-{uid}", f"template:nope-{uid}")


async def test_chunks_are_shared_across_templates(js, tmp_path: Path, uid: str) -> None:
    common = {f"big{i}": os.urandom(CHUNK * 2) for i in range(4)}
    a = make_tree(tmp_path / "a", common)
    b = make_tree(tmp_path / "b", {**common, "extra": "x"})
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    ra = await builder.build_template(f"sa-{uid}", str(a))
    rb = await builder.build_template(f"sb-{uid}", str(b))
    la, lb = ra.manifest.layers[0], rb.manifest.layers[0]
    assert la.digest != lb.digest
    shared = set(la.chunks) & set(lb.chunks)
    assert len(shared) >= 4
    assert rb.uploaded_bytes <= (len(set(lb.chunks)) - len(shared)) * CHUNK  # only chunks a lacked
    assert rb.uploaded_bytes < lb.size / 4


async def test_remove_and_prune(js, tmp_path: Path, uid: str) -> None:
    builder = ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)
    r = await builder.build_template(f"rm-{uid}", str(make_tree(tmp_path / "d", {"only-here": os.urandom(90_000)})))
    lay = r.manifest.layers[0]
    sub = await js._nc.subscribe(S.evt_image(f"rm-{uid}", "removed"))
    await remove_template(js, f"rm-{uid}")
    ev = codec.EVENT.decode((await sub.next_msg(timeout=5)).data)
    assert ev.kind == "removed" and ev.name == f"rm-{uid}"
    await sub.unsubscribe()
    assert f"rm-{uid}" not in [m.name for m in await list_templates(js)]
    with pytest.raises(UnknownTemplate):
        await remove_template(js, f"rm-{uid}")
    removed = await prune_unreferenced(js, store=builder.store, data_dir=tmp_path / "data")
    assert removed["layers"] >= 1 and removed["chunks"] >= 1
    assert not await builder.store.exists(chunk_key(lay.chunks[0]))
    assert not Path(lay.path).exists()


async def test_ensure_base_template_is_idempotent(js, tmp_path: Path, uid: str, mounts: list) -> None:
    data = tmp_path / "data"
    name = f"base-{uid}"  # not "base": other tests share this NATS server
    m = await ensure_base_template(js, data, name=name)
    assert m.name == name and len(m.layers) == 1
    lay = m.layers[0]
    assert lay.kind == "erofs" and lay.role == "base" and Path(lay.path).is_file()
    assert Path(lay.path).parent == data / "images" / "blobs"
    before = Path(lay.path).stat()
    m2 = await ensure_base_template(js, data, name=name)
    assert m2 == m
    after = Path(lay.path).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # not built again
    # another data dir (another machine): the blob is assembled from the store, the path follows
    m3 = await ensure_base_template(js, tmp_path / "data2", name=name)
    assert m3.layers[0].digest == lay.digest and Path(m3.layers[0].path).is_file()
    assert Path(m3.layers[0].path).read_bytes() == Path(lay.path).read_bytes()
    assert (await get_template(js, name)).layers[0].path == m3.layers[0].path
    # the busybox rootfs really is in the layer
    mnt = tmp_path / "mnt"
    mount_erofs(lay.path, mnt)
    mounts.append(mnt)
    assert (mnt / "bin/busybox").is_file() and os.readlink(mnt / "bin/sh") == "/bin/busybox"


def _cli(nats_url: str, *args: str, data_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "imaged.cli", "--nats-url", nats_url, "image", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO), "DSEC_DATA_DIR": str(data_dir)},
    )


async def test_cli_build_ls_show_rm(nats_server, tmp_path: Path, uid: str) -> None:
    base = make_tree(tmp_path / "base", {"hello": "world\n"})
    ws = _tarball(tmp_path / "ws.tgz", {"workspace/x": b"x"})
    name = f"cli-{uid}"
    r = await asyncio.to_thread(_cli, nats_server.url, "build", name, "--base", str(base), "--workspace", str(ws), "--json", data_dir=tmp_path / "d")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert [lay["role"] for lay in out["layers"]] == ["base", "workspace"]
    assert all(lay["digest"].startswith("sha256:") and lay["size"] > 0 for lay in out["layers"])
    assert out["uploaded_bytes"] > 0
    r = await asyncio.to_thread(_cli, nats_server.url, "build", name, "--base", str(base), "--workspace", str(ws), "--json", data_dir=tmp_path / "d")
    assert json.loads(r.stdout)["uploaded_bytes"] == 0
    r = await asyncio.to_thread(_cli, nats_server.url, "ls", "--json", data_dir=tmp_path / "d")
    assert name in [t["name"] for t in json.loads(r.stdout)]
    r = await asyncio.to_thread(_cli, nats_server.url, "show", name, data_dir=tmp_path / "d")
    assert json.loads(r.stdout)["name"] == name
    r = await asyncio.to_thread(_cli, nats_server.url, "ls", data_dir=tmp_path / "d")
    assert name in r.stdout
    r = await asyncio.to_thread(_cli, nats_server.url, "rm", name, data_dir=tmp_path / "d")
    assert r.returncode == 0 and f"removed {name}" in r.stdout
    r = await asyncio.to_thread(_cli, nats_server.url, "rm", name, data_dir=tmp_path / "d")
    assert r.returncode == 1 and "unknown_template" in r.stderr


async def test_image_service_answers_requests(nats_server, js, tmp_path: Path, uid: str) -> None:
    from imaged._messages import BuildImage, ImageBuilt, ImageList, ImageStats, ImageStatsRequest, ListImages
    from imaged._service import ImagedService

    svc = ImagedService(nats_server.url, data_dir=tmp_path / "svc", ensure_base=False)
    await svc.start()
    try:
        nc = js._nc
        base = make_tree(tmp_path / "b", {"f": "svc"})
        # start() flushes its subscriptions, yet in about one full-suite run in three the first request
        # still met "no responders" (never reproduced alone); wait, bounded, for the responder to show.
        deadline = time.monotonic() + 10
        while True:
            try:
                r = await nc.request(S.IMG_BUILD, codec.encode(BuildImage(name=f"svc-{uid}", base=str(base))), timeout=30)
                break
            except nats.errors.NoRespondersError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.05)  # poll interval
        built = codec.decode_reply(r.data, ImageBuilt)
        assert built.manifest.name == f"svc-{uid}"
        r = await nc.request(S.IMG_LIST, codec.encode(ListImages()), timeout=5)
        assert f"svc-{uid}" in [m.name for m in codec.decode_reply(r.data, ImageList).templates]
        r = await nc.request(S.IMG_STATS, codec.encode(ImageStatsRequest(name=f"svc-{uid}")), timeout=5)
        assert codec.decode_reply(r.data, ImageStats).total_bytes == built.manifest.layers[0].size
        r = await nc.request(S.IMG_STATS, codec.encode(ImageStatsRequest(name=f"nope-{uid}")), timeout=5)
        with pytest.raises(UnknownTemplate):
            codec.decode_reply(r.data, ImageStats)
    finally:
        await svc.shutdown()
