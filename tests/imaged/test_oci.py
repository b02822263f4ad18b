"""Templates from images in a registry: a real registry (Debian's docker-registry) started here,
images pushed to it with skopeo, pulled by imaged's registry client, each layer converted to an EROFS
layer once (keyed by its OCI digest), the config kept as the template's defaults."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import nats.errors
import pytest

from bus import codec
from bus import subjects as S
from bus.errors import ImageError, ImageNotFound, InvalidArgument, RegistryUnavailable
from bus.messages import BuildImage, ImageBuilt
from imaged import ImageBuilder, get_template
from imaged._manifests import get_manifest
from imaged._oci import build_from_image, oci_key
from imaged._registry import Registry, parse_ref
from tests import registry as R
from tests.conftest import needs

from .conftest import REPO, mount_erofs, needs_erofs

pytestmark = [needs_erofs, needs(R.missing())]
CHUNK = 64 * 1024
CONFIG = {"Env": ["PATH=/usr/bin:/bin", "GREETING=hello world"], "WorkingDir": "/srv", "User": "1000:1000",
          "Entrypoint": ["/bin/sh", "-c"], "Cmd": ["echo $GREETING"]}


@pytest.fixture(scope="module")
def registry():
    reg = R.LocalRegistry().start()
    yield reg
    reg.close()


@pytest.fixture(scope="module")
def images(registry, tmp_path_factory):
    """Two images sharing their busybox layer; ``one`` also deletes a file of that layer (a whiteout)
    and ``multi`` is an index of two platforms."""
    d = tmp_path_factory.mktemp("oci")
    shared = R.busybox_layer()
    one_top = R.tar_layer({"etc/passwd": ("wh",), "srv": ("dir",), "srv/one.txt": b"one\n"})
    two_top = R.tar_layer({"srv": ("dir",), "srv/two.txt": b"two\n"})
    out = {"shared_tar": shared}
    out["one"] = registry.push(R.oci_layout(d / "one", [shared, one_top], CONFIG), "test/one", "v1")
    out["two"] = registry.push(R.oci_layout(d / "two", [shared, two_top], {"Env": ["A=b"]}), "test/two", "v1")
    arm_top = R.tar_layer({"arch.txt": b"arm64\n"})
    amd_top = R.tar_layer({"arch.txt": b"amd64\n"})
    out["multi"] = registry.push(R.oci_layout(d / "multi", [shared, amd_top], arch="amd64", extra_platforms=[([shared, arm_top], "arm64")]),
                                 "test/multi", "v1", all_images=True)
    return out


def _builder(js, tmp_path: Path) -> ImageBuilder:
    return ImageBuilder(js, tmp_path / "data", chunk_size=CHUNK)


def test_parse_ref() -> None:
    assert str(parse_ref("busybox")) == "docker.io/library/busybox:latest"
    assert str(parse_ref("ghcr.io/a/b:1.2")) == "ghcr.io/a/b:1.2"
    r = parse_ref("localhost:5000/x/y@sha256:" + "a" * 64)
    assert (r.registry, r.repository, r.tag, r.reference) == ("localhost:5000", "x/y", "", "sha256:" + "a" * 64)
    for bad in ("", "UPPER/case", "a b", "x@sha256:short", "x:bad tag"):
        with pytest.raises(InvalidArgument):
            parse_ref(bad)


async def test_build_from_tag_keeps_config_and_whiteouts(js, tmp_path: Path, uid: str, registry, images, mounts: list) -> None:
    b = _builder(js, tmp_path)
    res, pulled = await build_from_image(b, f"one-{uid}", f"{registry.host}/test/one:v1")
    m = await get_template(js, f"one-{uid}")
    assert m == res.manifest and len(m.layers) == 2 and all(lay.role == "base" and lay.kind == "erofs" for lay in m.layers)
    assert pulled.manifest.digest == images["one"]
    d = m.defaults
    assert d is not None
    assert d.env == {"PATH": "/usr/bin:/bin", "GREETING": "hello world"}
    assert (d.workdir, d.user, d.entrypoint, d.cmd) == ("/srv", "1000:1000", ["/bin/sh", "-c"], ["echo $GREETING"])
    assert d.source == f"{registry.host}/test/one@{images['one']}"
    # the layers, stacked as the host agent stacks them, show the image: busybox runs, the whiteout hides
    # /etc/passwd of the lower layer, the top layer's file is there
    dirs = []
    for i, lay in enumerate(m.layers):
        t = tmp_path / f"l{i}"
        mount_erofs(lay.path, t)
        mounts.append(t)
        dirs.append(str(t))
    merged = tmp_path / "merged"
    merged.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o", f"lowerdir={dirs[1]}:{dirs[0]}", str(merged)], check=True)
    mounts.append(merged)
    assert (merged / "srv/one.txt").read_text() == "one\n"
    assert (merged / "etc/group").is_file() and not (merged / "etc/passwd").exists()
    assert (Path(dirs[0]) / "etc/passwd").is_file()  # positive control: the lower layer has it
    out = subprocess.run(["chroot", str(merged), "/bin/sh", "-c", "echo $((6*7))"], capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "42"


async def test_shared_layer_fetched_and_stored_once(js, tmp_path: Path, uid: str, registry, images) -> None:
    b = _builder(js, tmp_path)
    r1, p1 = await build_from_image(b, f"a-{uid}", f"{registry.host}/test/one:v1")
    r2, p2 = await build_from_image(b, f"b-{uid}", f"{registry.host}/test/two:v1")
    shared_oci = p1.manifest.layers[0]["digest"]
    assert p2.manifest.layers[0]["digest"] == shared_oci
    # the same EROFS layer in both templates, one record of it, its OCI digest pointing at it
    assert r1.manifest.layers[0].digest == r2.manifest.layers[0].digest
    assert (await b.store.get(oci_key(shared_oci))).decode() == r1.manifest.layers[0].digest
    # fetched from the registry once (whichever test pulled it first in this store), never by the second image
    assert shared_oci not in p2.fetched and p2.layers[0].uploaded_bytes == 0
    assert p2.fetched == [p2.manifest.layers[1]["digest"]]
    gets = registry.blob_gets(shared_oci)
    assert gets == 1, registry.log()
    # a third pull of an image already converted fetches no blob at all
    before = registry.blob_gets(p2.fetched[0])
    _, p3 = await build_from_image(b, f"c-{uid}", f"{registry.host}/test/two:v1")
    assert p3.fetched == [] and registry.blob_gets(p2.fetched[0]) == before == 1
    assert [lay.digest for lay in (await get_template(js, f"c-{uid}")).layers] == [lay.digest for lay in r2.manifest.layers]


async def test_build_by_digest_and_platform(js, tmp_path: Path, uid: str, registry, images, mounts: list) -> None:
    b = _builder(js, tmp_path)
    res, pulled = await build_from_image(b, f"d-{uid}", f"{registry.host}/test/one@{images['one']}")
    assert pulled.manifest.digest == images["one"] and len(res.manifest.layers) == 2
    # an index: the platform picks the manifest; by tag and by the index's digest
    for plat, want in (("linux/amd64", "amd64\n"), ("linux/arm64", "arm64\n")):
        res, pulled = await build_from_image(b, f"m-{uid}-{plat[6:]}", f"{registry.host}/test/multi@{images['multi']}", platform=plat)
        assert pulled.manifest.index_digest == images["multi"]
        t = tmp_path / f"top-{plat[6:]}"
        mount_erofs(res.manifest.layers[-1].path, t)
        mounts.append(t)
        assert (t / "arch.txt").read_text() == want
    with pytest.raises(ImageNotFound) as ei:
        await build_from_image(b, f"m-{uid}-s390x", f"{registry.host}/test/multi:v1", platform="linux/s390x")
    assert "linux/amd64" in ei.value.description and "linux/arm64" in ei.value.description
    assert await get_manifest(js, f"m-{uid}-s390x") is None


async def test_mirror_maps_a_public_registry(js, tmp_path: Path, uid: str, registry, images) -> None:
    b = _builder(js, tmp_path)
    # docker.io/test/one is served by the local registry; without the mirror it would go to Docker Hub
    reg = Registry(mirrors={"docker.io": registry.host})
    res, pulled = await build_from_image(b, f"mir-{uid}", "test/one:v1", registry=reg)
    assert pulled.manifest.digest == images["one"] and res.manifest.defaults is not None
    assert Registry(mirrors={}).host_of(parse_ref("test/one:v1")) == "registry-1.docker.io"


async def test_missing_image_and_registry_down_are_typed_and_leave_nothing(js, tmp_path: Path, uid: str, registry, images) -> None:
    b = _builder(js, tmp_path)
    for ref in (f"{registry.host}/test/one:nope", f"{registry.host}/test/absent:v1", f"{registry.host}/test/one@sha256:{'0' * 64}"):
        with pytest.raises(ImageNotFound) as ei:
            await build_from_image(b, f"x-{uid}", ref)
        assert ei.value.code == "image_not_found"
    down = R.free_port()  # nothing listens there
    with pytest.raises(RegistryUnavailable) as eu:
        await build_from_image(b, f"x-{uid}", f"127.0.0.1:{down}/test/one:v1")
    assert eu.value.code == "registry_unavailable" and isinstance(eu.value, ImageError)
    assert await get_manifest(js, f"x-{uid}") is None
    assert list((tmp_path / "data" / "images" / "tmp").iterdir()) == []
    # positive control: the same builder, a good reference
    res, _ = await build_from_image(b, f"x-{uid}", f"{registry.host}/test/one:v1")
    assert (await get_manifest(js, f"x-{uid}")) == res.manifest


async def test_registry_dies_mid_pull(js, tmp_path: Path, uid: str, images) -> None:
    """A registry that goes away between the manifest and the blobs: typed error, no template, no temp files."""
    reg = R.LocalRegistry().start()
    try:
        layout = R.oci_layout(tmp_path / "solo", [R.tar_layer({"solo.txt": os.urandom(64).hex().encode()})])
        reg.push(layout, "test/solo", "v1")
        client = Registry()
        ref = parse_ref(f"{reg.host}/test/solo:v1")
        async with client:
            man = await client.manifest(ref)
        reg.stop()

        class Fixed(Registry):
            async def manifest(self, ref, platform=""):  # the manifest as read while the registry was up
                return man

        b = _builder(js, tmp_path)
        with pytest.raises(RegistryUnavailable):
            await build_from_image(b, f"solo-{uid}", f"{reg.host}/test/solo:v1", registry=Fixed())
        assert await get_manifest(js, f"solo-{uid}") is None
        assert list((tmp_path / "data" / "images" / "tmp").iterdir()) == []
    finally:
        reg.close()


async def test_service_and_cli_build_from(nc, js, tmp_path: Path, uid: str, registry, images, nats_server) -> None:
    from imaged._service import ImagedService

    svc = ImagedService(nats_server.url, data_dir=tmp_path / "svc", ensure_base=False)
    await svc.start()
    try:
        built = await _request_build(nc, BuildImage(name=f"svc-{uid}", base="", from_ref=f"{registry.host}/test/two:v1"))
        assert isinstance(built, ImageBuilt) and built.manifest.defaults is not None and built.manifest.defaults.env == {"A": "b"}
        with pytest.raises(ImageNotFound):
            await _request_build(nc, BuildImage(name=f"svc2-{uid}", base="", from_ref=f"{registry.host}/test/none:v1"))
        with pytest.raises(InvalidArgument):
            await _request_build(nc, BuildImage(name=f"svc2-{uid}", base="/x", from_ref=f"{registry.host}/test/two:v1"))
        # the service answers on after bad input
        built = await _request_build(nc, BuildImage(name=f"svc3-{uid}", base="", from_ref=f"{registry.host}/test/one@{images['one']}"))
        assert built.manifest.defaults is not None and built.manifest.defaults.workdir == "/srv"
    finally:
        await svc.shutdown()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        [sys.executable, "-m", "imaged.cli", "image", "build", f"cli-{uid}", "--from", f"{registry.host}/test/one:v1", "--json",
         "--data-dir", str(tmp_path / "cli"), "--nats-url", nats_server.url],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert r.returncode == 0, r.stderr
    assert (await get_template(js, f"cli-{uid}")).defaults.entrypoint == ["/bin/sh", "-c"]  # type: ignore[union-attr]
    r = subprocess.run(
        [sys.executable, "-m", "imaged.cli", "image", "build", f"cli2-{uid}", "--from", f"{registry.host}/test/one:missing",
         "--data-dir", str(tmp_path / "cli"), "--nats-url", nats_server.url],
        capture_output=True, text=True, timeout=120, env=env, cwd=REPO,
    )
    assert r.returncode == 1 and "[image_not_found]" in r.stderr


async def _request_build(nc, req: BuildImage) -> ImageBuilt:
    deadline = time.monotonic() + 10
    while True:  # start() flushes its subscriptions; still, wait (bounded) for the responder to show
        try:
            r = await nc.request(S.IMG_BUILD, codec.encode(req), timeout=120)
            break
        except nats.errors.NoRespondersError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)  # poll interval
    return codec.decode_reply(r.data, ImageBuilt)


async def test_registry_credentials_from_the_auth_file(js, tmp_path: Path, uid: str) -> None:
    """A registry that wants Basic credentials: the auth file's are sent; none or wrong ones are refused, typed."""
    import base64
    import json

    reg = R.LocalRegistry(auth=("alice", "s3cret")).start()
    try:
        digest = reg.push(R.oci_layout(tmp_path / "img", [R.tar_layer({"secret.txt": b"behind auth\n"})]), "test/private", "v1")
        ref = f"{reg.host}/test/private:v1"
        b = _builder(js, tmp_path)

        def auth_file(user: str, pw: str) -> str:
            p = tmp_path / f"auth-{user}-{pw}.json"
            p.write_text(json.dumps({"auths": {reg.host: {"auth": base64.b64encode(f"{user}:{pw}".encode()).decode()}}}))
            return str(p)

        with pytest.raises(ImageError) as e1:
            await build_from_image(b, f"priv-{uid}", ref, registry=Registry(auth_file=str(tmp_path / "none.json")))
        assert e1.value.code == "image_error" and e1.value.context["status"] == 401 and "wants credentials" in e1.value.description
        with pytest.raises(ImageError) as e2:
            await build_from_image(b, f"priv-{uid}", ref, registry=Registry(auth_file=auth_file("alice", "wrong")))
        assert e2.value.code == "image_error" and e2.value.context["status"] == 401 and "denied" in e2.value.description
        assert await get_manifest(js, f"priv-{uid}") is None
        res, pulled = await build_from_image(b, f"priv-{uid}", ref, registry=Registry(auth_file=auth_file("alice", "s3cret")))
        assert pulled.manifest.digest == digest and (await get_manifest(js, f"priv-{uid}")) == res.manifest
    finally:
        reg.close()


async def test_registry_that_never_answers_times_out_typed(js, tmp_path: Path, uid: str) -> None:
    """A registry that takes the connection and says nothing: registry_unavailable after the client's timeout."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel completes the handshakes; nobody ever reads or answers
    try:
        host = f"127.0.0.1:{silent.getsockname()[1]}"
        b = _builder(js, tmp_path)
        t0 = time.monotonic()
        with pytest.raises(RegistryUnavailable) as ei:
            await build_from_image(b, f"slow-{uid}", f"{host}/test/one:v1", registry=Registry(timeout_s=1.0))
        assert "timed out" in ei.value.description and time.monotonic() - t0 < 10
        assert await get_manifest(js, f"slow-{uid}") is None
    finally:
        silent.close()
