"""envd as the unmodified e2b SDK uses it, through the gateway under ``dsec up`` (the ``gw`` stack of
test_gateway): entry owners, symlink targets and file metadata, batch writes, signed file URLs,
inotify watches (entry info, recursive ones seeing new directories), ``list(depth=N)`` in envd's
order, removing a missing path, per-command envs, a sandbox killed under a running command, and
pause making ``is_running()`` false until ``connect()``, and PTY sessions (create, input, resize, kill);
a microVM (the backend named in the create's metadata) served by the same routes.

Scenarios use a busybox template with E2B's ``user`` account (uid 1000, home /home/user) and a
``staff`` group, built by ``dsec image build`` at the start.
"""

# ruff: noqa: F811 - the parameters named gw are the stack fixture imported from test_gateway
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.js.errors import KeyNotFoundError

from bus import codec
from bus import subjects as S
from bus.auth import AuthConfig
from bus.sign import ENV_CONTROL_KEY
from bus.streams import ensure_kv
from tests.conftest import cannot_run, eventually
from tests.netclaim import claim_net

from .conftest import PY, Child, processes_mentioning, run_process, subprocess_env
from .test_microvm import KERNEL_CACHE, NO_QEMU
from .test_gateway import DSEC, UPLOAD_BOUND, Gw, gw, http  # noqa: F401 - gw is the module's stack fixture

TEMPLATE = "e2b-busybox"


@pytest.fixture(scope="module", autouse=True)
async def e2b_template(gw: Gw, tmp_path_factory: pytest.TempPathFactory) -> None:
    from bus.auth import AuthConfig
    from imaged._busybox import build_busybox_rootfs
    from imaged._debootstrap import ensure_e2b_user

    root = tmp_path_factory.mktemp("e2b-rootfs") / "root"
    await asyncio.to_thread(build_busybox_rootfs, str(root))
    ensure_e2b_user(root)
    with open(root / "etc" / "group", "a") as f:
        f.write("staff:x:50:\n")
    admin = AuthConfig.load_or_create(gw.data / "auth.json").url_for("admin", gw.nats_url)
    rc, out, err = await run_process(*DSEC, "image", "build", TEMPLATE, "--base", str(root), "--data-dir", str(gw.data), "--json",
                                     env=subprocess_env(admin), timeout=600)
    assert rc == 0, (out, err)


def _sandbox(gw: Gw, key: str | None = None) -> Any:
    from e2b import Sandbox

    return Sandbox.create(TEMPLATE, timeout=180, **gw.sdk(key))


def _get(url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=data, method="POST" if data is not None else "GET", headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _at(sid: str, url: str, data: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """A file URL the SDK made (pointing at the gateway, as E2B_SANDBOX_URL says), fetched with no key:
    the sandbox named the way a proxy in front of the gateway names it (E2b-Sandbox-Id)."""
    return _get(url, data, {"E2b-Sandbox-Id": sid, **(headers or {})})


# --------------------------------------------------------------------------------------------- entries
def _entries(gw: Gw) -> None:
    from e2b import FileType
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    sb = _sandbox(gw)
    try:
        info = sb.files.write("notes.txt", "hello", metadata={"Author": "ann", "purpose": "t"})
        assert (info.path, info.metadata) == ("/home/user/notes.txt", {"author": "ann", "purpose": "t"})
        e = sb.files.get_info("notes.txt")
        assert (e.name, e.type, e.size, e.mode, e.permissions) == ("notes.txt", FileType.FILE, 5, 0o644, "-rw-r--r--")
        assert (e.owner, e.group, e.symlink_target, e.metadata) == ("user", "user", None, {"author": "ann", "purpose": "t"})
        # Listing shows the same; a directory too, owned by the user that made it.
        assert sb.files.make_dir("d") is True
        listed = {x.name: x for x in sb.files.list("/home/user")}
        assert listed["notes.txt"].metadata == {"author": "ann", "purpose": "t"} and listed["notes.txt"].owner == "user"
        assert (listed["d"].type, listed["d"].owner, listed["d"].group, listed["d"].permissions) == (FileType.DIR, "user", "user", "drwxr-xr-x")
        # Rewriting without metadata clears it; a renamed file keeps its own.
        assert sb.files.write("notes.txt", "again").metadata is None
        assert sb.files.get_info("notes.txt").metadata is None
        sb.files.write("tagged.txt", "t", metadata={"stage": "renamed"})
        moved = sb.files.rename("tagged.txt", "d/moved.txt")
        assert (moved.path, moved.metadata, moved.owner) == ("/home/user/d/moved.txt", {"stage": "renamed"}, "user")
        # A symlink: its target as stored; the link itself is reported, not what it points at.
        sb.commands.run("ln -s /home/user/notes.txt /home/user/link && ln -s missing /home/user/dangling")
        link = sb.files.get_info("link")
        assert (link.type, link.symlink_target, link.name) == (FileType.SYMLINK, "/home/user/notes.txt", "link")
        listed = {x.name: x for x in sb.files.list("/home/user")}
        assert (listed["dangling"].type, listed["dangling"].symlink_target) == (FileType.SYMLINK, "missing")
        assert listed["notes.txt"].symlink_target is None
        # Root's file, and a group only the group file names.
        sb.files.write("/tmp/r.txt", "r", user="root")
        sb.commands.run("chgrp 50 /tmp/r.txt", user="root")
        r_info = sb.files.get_info("/tmp/r.txt")
        assert (r_info.owner, r_info.group) == ("root", "staff")
        # write_files: several files in one multipart request, each owned by the user, each with the metadata.
        infos = sb.files.write_files([WriteEntry(path="b/1.txt", data="one"), WriteEntry(path="/home/user/b/2.txt", data=b"two")], metadata={"batch": "1"})
        assert [(i.path, i.metadata) for i in infos] == [("/home/user/b/1.txt", {"batch": "1"}), ("/home/user/b/2.txt", {"batch": "1"})]
        want = [("1.txt", "user", 3, {"batch": "1"}), ("2.txt", "user", 3, {"batch": "1"})]
        assert [(x.name, x.owner, x.size, x.metadata) for x in sb.files.list("b")] == want
        assert sb.files.read("b/2.txt") == "two"
    finally:
        sb.kill()


async def test_entries_owner_symlink_metadata(gw: Gw) -> None:
    await asyncio.to_thread(_entries, gw)


# --------------------------------------------------------------------------------------------- listing
def _listing(gw: Gw) -> None:
    from e2b import FileType

    sb = _sandbox(gw)
    try:
        for d in ("t/subdir2/subdir2_2", "t/subdir1/subdir1_2", "t/subdir2/subdir2_1", "t/subdir1/subdir1_1"):
            sb.files.make_dir(d)
        sb.files.write("t/file1.txt", "Hello, world!")
        want2 = ["file1.txt", "subdir1", "subdir1_1", "subdir1_2", "subdir2", "subdir2_1", "subdir2_2"]
        for depth, names in ((None, ["file1.txt", "subdir1", "subdir2"]), (1, ["file1.txt", "subdir1", "subdir2"]), (2, want2), (3, want2)):
            got = sb.files.list("t", depth=depth)
            assert [x.name for x in got] == names, (depth, got)
        got = sb.files.list("t", depth=2)
        assert [x.path for x in got][1:4] == ["/home/user/t/subdir1", "/home/user/t/subdir1/subdir1_1", "/home/user/t/subdir1/subdir1_2"]
        assert [x.type for x in got] == [FileType.FILE] + [FileType.DIR] * 6
        # Removing a path that is not there is not an error (envd removes with RemoveAll); a real one goes.
        sb.files.remove("never-was")
        sb.files.remove("t")
        assert not sb.files.exists("t")
    finally:
        sb.kill()


async def test_list_depth_order_and_remove_missing(gw: Gw) -> None:
    await asyncio.to_thread(_listing, gw)


# --------------------------------------------------------------------------------------------- signed URLs
def _signed(gw: Gw) -> None:
    sb, other = _sandbox(gw), _sandbox(gw)
    sid = sb.sandbox_id
    try:
        sb.files.write("s.txt", "signed content")
        other.files.write("s.txt", "other's content")
        url = sb.download_url("s.txt", "user")
        assert "signature=v1_" in url and "signature_expiration" not in url
        assert _at(sid, url) == (200, b"signed content")
        assert _at(sid, sb.download_url("s.txt", "user", 120)) == (200, b"signed content")
        # The host-name route (<port>-<id>.<domain>) takes the same URL.
        host = f"49983-{sid}.{urllib.parse.urlsplit(gw.url).netloc}"
        assert _get(url, None, {"Host": host}) == (200, b"signed content")
        # Expired: E2B's answer, word for word.
        st, body = _at(sid, sb.download_url("s.txt", "user", use_signature_expiration=-120))
        assert (st, json.loads(body)) == (401, {"code": 401, "message": "signature is already expired"})
        # Tampered: another path under the same signature, or the signature sent to another sandbox of the key.
        st, body = _at(sid, url.replace("path=s.txt", "path=%2Fetc%2Fpasswd"))
        assert (st, json.loads(body)["message"]) == (401, "invalid signature")
        st, body = _at(other.sandbox_id, url)
        assert (st, json.loads(body)["message"]) == (401, "invalid signature")
        assert _at(other.sandbox_id, other.download_url("s.txt", "user")) == (200, b"other's content")  # its own signature does
        # No signature and no key: refused.
        st, body = _at(sid, url.split("&signature=")[0])
        assert st == 401, body
        # Upload through a signed URL: multipart, as the SDK documents; the file belongs to the user.
        boundary = "dsecboundary"
        form = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"u.txt\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\nuploaded\r\n--{boundary}--\r\n").encode()
        ctype = {"Content-Type": f"multipart/form-data; boundary={boundary}"}
        st, resp = _at(sid, sb.upload_url("up/u.txt", "user", 60), form, ctype)
        assert st == 200 and json.loads(resp)[0]["path"] == "/home/user/up/u.txt", (st, resp)
        assert (sb.files.read("up/u.txt"), sb.files.get_info("up/u.txt").owner) == ("uploaded", "user")
        # A read signature does not write.
        st, body = _at(sid, sb.download_url("up/u2.txt", "user"), form, ctype)
        assert (st, json.loads(body)["message"]) == (401, "invalid signature")
        assert not sb.files.exists("up/u2.txt")
    finally:
        sb.kill()
        other.kill()


async def test_signed_urls(gw: Gw) -> None:
    await asyncio.to_thread(_signed, gw)


# --------------------------------------------------------------------------------------------- upload bound
def _upload_bound(gw: Gw) -> None:
    """The host's per-tenant bound on uploads (``--upload-max-bytes-per-tenant``, set to UPLOAD_BOUND for
    this stack) through envd: the e2b SDK gets E2B's 429 (``RateLimitException``) with the limit named,
    and no half file is left; another key's sandbox is not bound by this one's uploads."""
    from e2b import RateLimitException
    from e2b.sandbox.filesystem.filesystem import WriteEntry

    sb, other = _sandbox(gw, gw.key_b), _sandbox(gw, gw.key_a)
    try:
        big = UPLOAD_BOUND // 2
        sb.files.write("big1.bin", b"x" * big)  # positive control: half the bound
        with pytest.raises(RateLimitException, match=f"per-tenant upload limit of {UPLOAD_BOUND} bytes"):
            sb.files.write("big2.bin", b"y" * (big + 1_000_000))
        assert not sb.files.exists("big2.bin")
        # write_files (one multipart request; a part's size is not known): the part that passes is refused and removed.
        quarter = UPLOAD_BOUND // 4
        with pytest.raises(RateLimitException):
            sb.files.write_files([WriteEntry(path="w1.bin", data=b"1" * quarter), WriteEntry(path="w2.bin", data=b"2" * (quarter + 1_000_000))])
        assert sb.files.get_info("w1.bin").size == quarter and not sb.files.exists("w2.bin")
        other.files.write("a.bin", b"a" * big)  # another tenant: its own bound
        # Room again once a file is removed.
        sb.files.remove("big1.bin")
        assert sb.files.write("big2.bin", b"y" * (big + 1_000_000)).path.endswith("big2.bin")
    finally:
        sb.kill()
        other.kill()


async def test_uploads_are_bounded_per_tenant(gw: Gw) -> None:
    await asyncio.to_thread(_upload_bound, gw)


# --------------------------------------------------------------------------------------------- watches
def _watches(gw: Gw) -> None:
    from e2b import FilesystemEventType as T

    sb = _sandbox(gw)
    try:
        sb.files.make_dir("w")
        h = sb.files.watch_dir("w")
        sb.files.write("w/f.txt", "watched")
        events = h.get_new_events()
        assert [(e.name, e.type) for e in events] == [("f.txt", T.CREATE), ("f.txt", T.CHMOD), ("f.txt", T.WRITE)], events
        sb.files.remove("w/f.txt")
        assert [(e.name, e.type) for e in h.get_new_events()] == [("f.txt", T.REMOVE)]
        h.stop()
        # Recursive: a directory made after the watch started is watched too.
        sb.files.make_dir("r")
        h = sb.files.watch_dir("r", recursive=True, include_entry=True)
        sb.files.make_dir("r/nested")
        sb.files.write("r/nested/f.txt", "deep")
        events = h.get_new_events()
        writes = [e for e in events if (e.name, e.type) == ("nested/f.txt", T.WRITE)]
        assert writes and writes[0].entry is not None, events
        assert (writes[0].entry.path, writes[0].entry.size, writes[0].entry.owner) == ("/home/user/r/nested/f.txt", 4, "user")
        assert [(e.name, e.type) for e in events][0] == ("nested", T.CREATE)
        h.stop()
    finally:
        sb.kill()


async def test_watch_events(gw: Gw) -> None:
    await asyncio.to_thread(_watches, gw)


async def test_watch_stream_async(gw: Gw) -> None:
    """The async SDK's WatchDir stream: events pushed as they happen, with entry info."""
    from e2b import AsyncSandbox
    from e2b import FilesystemEventType as T

    sb = await AsyncSandbox.create(TEMPLATE, timeout=180, **gw.sdk())
    try:
        seen: list[Any] = []
        h = await sb.files.watch_dir("/tmp", seen.append, recursive=True, include_entry=True)
        await sb.files.make_dir("/tmp/later")
        await sb.files.write("/tmp/later/x.txt", "x")
        await eventually(lambda: any((e.name, e.type) == ("later/x.txt", T.WRITE) for e in seen), timeout=20, what="the write event")
        w = next(e for e in seen if (e.name, e.type) == ("later/x.txt", T.WRITE))
        assert w.entry is not None and (w.entry.path, w.entry.size) == ("/tmp/later/x.txt", 1)
        assert seen[0].name == "later" and seen[0].type == T.CREATE
        await h.stop()
    finally:
        await sb.kill()


# --------------------------------------------------------------------------------------------- commands
def _commands(gw: Gw) -> None:
    from e2b import SandboxException, SandboxNotRunningException, TimeoutException

    sb = _sandbox(gw)
    try:
        assert sb.commands.run("echo $FOO", envs={"FOO": "bar"}).stdout == "bar\n"
        assert sb.commands.run("echo ${FOO:-unset}").stdout == "unset\n"
        h = sb.commands.run("echo ${FOO:-unset}; sleep 1; echo ${FOO:-unset}", envs={"FOO": "bg"}, background=True)
        assert sb.commands.run("echo ${FOO:-unset}").stdout == "unset\n"  # while the other one runs
        assert h.wait().stdout == "bg\nbg\n"
        # The sandbox killed under a running command: E2B's error for it.
        cmd = sb.commands.run("sleep 60", background=True)
        sb.kill()
        with pytest.raises(SandboxException) as ei:
            cmd.wait()
        assert isinstance(ei.value, SandboxNotRunningException) and isinstance(ei.value, TimeoutException)
        assert "sandbox was killed or reached its end of life" in str(ei.value)
    finally:
        sb.kill()


async def test_envs_and_killed_sandbox(gw: Gw) -> None:
    await asyncio.to_thread(_commands, gw)


def _pause(gw: Gw) -> None:
    from e2b import Sandbox

    sb = _sandbox(gw)
    try:
        assert sb.is_running() is True
        sb.pause()
        assert sb.is_running() is False
        assert Sandbox.connect(sb.sandbox_id, **gw.sdk()).is_running() is True
        assert sb.is_running() is True
        assert sb.commands.run("echo back").stdout == "back\n"
    finally:
        sb.kill()


async def test_pause_is_not_running(gw: Gw) -> None:
    await asyncio.to_thread(_pause, gw)


# --------------------------------------------------------------------------------------------- PTY
def _pty(gw: Gw) -> None:
    from e2b import CommandExitException, PtySize

    sb = _sandbox(gw)
    try:
        out: list[bytes] = []
        t = sb.pty.create(PtySize(rows=24, cols=80), envs={"ABC": "123"}, cwd="/")
        sb.pty.send_stdin(t.pid, b"echo v=$ABC; stty size; pwd; tty\nexit 7\n")
        with pytest.raises(CommandExitException) as ei:
            t.wait(on_pty=out.append)
        assert ei.value.exit_code == 7, ei.value
        text = b"".join(out).decode()
        assert "v=123" in text and "24 80" in text and "/dev/pts/" in text, text
        # Resized while it runs: the shell sees the new size.
        out.clear()
        t = sb.pty.create(PtySize(rows=24, cols=80))
        sb.pty.resize(t.pid, PtySize(rows=30, cols=100))
        sb.pty.send_stdin(t.pid, b"stty size\nexit\n")
        assert t.wait(on_pty=out.append).exit_code == 0
        assert "30 100" in b"".join(out).decode()
        # Killed: the session ends; a pid that is no session is not killed.
        t = sb.pty.create(PtySize(rows=24, cols=80))
        assert sb.pty.kill(t.pid) is True
        assert sb.commands.run(f"for i in $(seq 1 50); do kill -0 {t.pid} 2>/dev/null || exit 0; sleep 0.1; done; exit 1").exit_code == 0
        assert sb.pty.kill(999999) is False
    finally:
        sb.kill()


async def test_pty(gw: Gw) -> None:
    await asyncio.to_thread(_pty, gw)


# --------------------------------------------------------------------------------------------- bad input
def _bad_input(gw: Gw) -> None:
    from e2b import InvalidArgumentException, NotFoundException, PtySize

    sb = _sandbox(gw)
    envd = {"E2b-Sandbox-Id": sb.sandbox_id, "X-API-Key": gw.key_a, "Content-Type": "application/octet-stream"}
    try:
        # Upload metadata: within the bounds it is stored; 65 keys, or a key too long for an xattr, are 400.
        st, doc, _ = http(gw, "POST", "/files?path=/tmp/m.txt", b"m", {**envd, "X-Metadata-A": "1", "X-Metadata-B": "2"}, key=None)
        assert (st, doc[0]["metadata"]) == (200, {"a": "1", "b": "2"})
        many = {f"X-Metadata-K{i}": "v" for i in range(65)}
        for extra in (many, {"X-Metadata-" + "k" * 247: "v"}):
            st, doc, _ = http(gw, "POST", "/files?path=/tmp/bad.txt", b"x", {**envd, **extra}, key=None)
            assert (st, doc["message"]) == (400, "metadata: at most 64 keys of 1..246 characters"), (st, doc)
        assert not sb.files.exists("/tmp/bad.txt")
        # A PTY of an impossible size; a resize of a command that is no PTY session.
        with pytest.raises(InvalidArgumentException) as ei:
            sb.pty.create(PtySize(rows=70000, cols=80))
        assert "pty.size rows and cols must be 1..65535" in str(ei.value)
        h = sb.commands.run("sleep 30", background=True)
        with pytest.raises(NotFoundException) as nf:
            sb.pty.resize(h.pid, PtySize(rows=30, cols=100))
        assert f"process {h.pid} is not a PTY session of this gateway" in str(nf.value)
        assert h.kill() is True
    finally:
        sb.kill()


async def test_bad_input(gw: Gw) -> None:
    await asyncio.to_thread(_bad_input, gw)


# --------------------------------------------------------------------------------------------- microVMs
@contextlib.asynccontextmanager
async def _vm_host(gw: Gw, backend: str) -> AsyncIterator[Path]:
    """A host agent of ``backend`` (microvm or vm) in the gateway's pool, on the stack's NATS as the
    stack's own host agent connects (its NATS user, placement's control key): creates asking for
    that backend go to it. Yields its data dir."""
    if NO_QEMU:
        cannot_run(NO_QEMU)
    auth = AuthConfig.load_or_create(gw.data / "auth.json")
    claim = await asyncio.to_thread(claim_net)
    data = Path(tempfile.mkdtemp(prefix=f"dsec-{backend}-e2b-", dir="/tmp"))
    host_id = f"{backend}-{uuid.uuid4().hex[:8]}"
    env = subprocess_env(auth.url_for("hostagent", gw.nats_url), DSEC_MICROVM_KERNEL_CACHE=KERNEL_CACHE, **claim.env(),
                         **{ENV_CONTROL_KEY: auth.control_key})
    argv = [PY, "-m", "hostagent", "--backend", backend, "--data-dir", str(data), "--host-id", host_id, "--pool", "default", "--concurrency", "2"]
    child = Child(argv, env, data.parent / f"{data.name}.log").start()
    nc = await nats.connect(auth.url_for("admin", gw.nats_url))
    try:
        kv = await ensure_kv(nc.jetstream(), S.KV_HOSTS)

        async def ready() -> bool:
            assert child.alive(), child.log()
            try:
                raw = (await kv.get(host_id)).value
            except KeyNotFoundError:
                return False
            return bool(raw) and codec.HOST_STATUS.decode(raw).state == "ready"

        await eventually(ready, timeout=240, interval=0.5, what=f"the {backend} host agent")
        yield data
    finally:
        await nc.close()
        if child.alive():
            child.signal(signal.SIGTERM)
            await child.wait(60)
        for pid in processes_mentioning(str(data)):  # only what names this test's data dir
            os.kill(pid, signal.SIGKILL)
        shutil.rmtree(data, ignore_errors=True)
        (data.parent / f"{data.name}.log").unlink(missing_ok=True)
        await claim.purge()
        claim.release()


@pytest.fixture(scope="module")
async def microvm_host(gw: Gw) -> AsyncIterator[Path]:
    async with _vm_host(gw, "microvm") as data:
        yield data


@pytest.fixture(scope="module")
async def vm_host(gw: Gw) -> AsyncIterator[Path]:
    async with _vm_host(gw, "vm") as data:
        yield data


def _microvm_scenario(gw: Gw, vms: Path) -> str:
    """The unmodified e2b SDK on a microVM: create (the backend in the metadata), commands, files."""
    from e2b import CommandExitException, Sandbox, SandboxException

    with pytest.raises(SandboxException) as e:  # an unknown backend: the gateway's 400, with its reason
        Sandbox.create(TEMPLATE, timeout=60, metadata={"dsec.backend": "vmware"}, **gw.sdk())
    assert e.value.status_code == 400 and "backend must be one of" in str(e.value), e.value
    sb = Sandbox.create(TEMPLATE, timeout=900, metadata={"dsec.backend": "microvm"}, **{**gw.sdk(), "request_timeout": 400})
    try:
        assert (vms / sb.sandbox_id / "qemu.pid").exists()  # it is a VM on the microvm host
        r = sb.commands.run("uname -r; id -un; pwd", request_timeout=120)
        release, user, cwd = r.stdout.split()
        assert release.endswith("-cloud-amd64") and release != os.uname().release  # its own kernel
        assert (user, cwd) == ("user", "/home/user") and r.exit_code == 0
        got: list[str] = []
        with pytest.raises(CommandExitException) as ce:
            sb.commands.run("echo out; echo err >&2; exit 3", on_stdout=got.append, request_timeout=120)
        assert (ce.value.exit_code, ce.value.stdout, ce.value.stderr) == (3, "out\n", "err\n") and "".join(got) == "out\n"
        sb.files.write("/home/user/hello.txt", "from e2b")
        assert sb.files.read("/home/user/hello.txt") == "from e2b"
        assert sb.commands.run("cat /home/user/hello.txt; stat -c %U /home/user/hello.txt").stdout == "from e2buser\n"
        assert "hello.txt" in {e.name for e in sb.files.list("/home/user")}
        assert sb.get_info().metadata["dsec.backend"] == "microvm"
        return sb.sandbox_id
    finally:
        sb.kill()


async def test_microvm_through_e2b(gw: Gw, microvm_host: Path) -> None:
    vms = microvm_host / "mvm" / "vms"
    sid = await asyncio.to_thread(_microvm_scenario, gw, vms)
    await eventually(lambda: not (vms / sid).exists(), timeout=60, what="the killed microVM to be gone")


def _rest(gw: Gw, method: str, path: str, doc: dict[str, Any] | None = None, timeout: float = 120) -> tuple[int, Any]:
    """(status, JSON or bytes) of a request to dsec's REST API with key a (a VM's create takes minutes under TCG)."""
    body = json.dumps(doc).encode() if doc is not None else None
    req = urllib.request.Request(gw.url + path, data=body, method=method, headers={"X-API-Key": gw.key_a, "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw


def _screen_scenario(gw: Gw) -> None:
    """A full VM's screen over the gateway: a screenshot, typed text and a key reach the shell on
    its console (the command runs) and the next frame differs."""
    st, info = _rest(gw, "POST", "/v1/sandboxes", {"template": TEMPLATE, "backend": "vm", "memory_mb": 256, "disk_mb": 256, "create_timeout": 900},
                     timeout=1000)
    assert st == 201, info
    sid = info["sandbox_id"]
    try:
        st, first = _rest(gw, "GET", f"/v1/sandboxes/{sid}/screenshot")
        assert st == 200 and first.startswith(b"\x89PNG\r\n\x1a\n"), (st, first[:80])
        assert _rest(gw, "POST", f"/v1/sandboxes/{sid}/input", {"action": "type", "text": "echo typed-Text > /tmp/typed"}) == (204, b"")
        assert _rest(gw, "POST", f"/v1/sandboxes/{sid}/input", {"action": "key", "key": "enter"}) == (204, b"")

        def typed() -> bool:
            st, r = _rest(gw, "POST", f"/v1/sandboxes/{sid}/exec", {"cmd": "cat /tmp/typed 2>/dev/null || true"})
            assert st == 200, r
            return r["stdout"] == "typed-Text\n"

        deadline = time.monotonic() + 120
        while not typed():  # the console's shell reads the keys at its own pace
            assert time.monotonic() < deadline, "the typed command did not run in the screen's shell"
            time.sleep(0.5)  # poll interval (a sync HTTP client; eventually() is async)
        st, after = _rest(gw, "GET", f"/v1/sandboxes/{sid}/screenshot")
        assert st == 200 and after.startswith(b"\x89PNG") and after != first  # the frame shows it
        assert _rest(gw, "POST", f"/v1/sandboxes/{sid}/input", {"action": "click", "x": 10, "y": 10}) == (204, b"")  # control for:
        st, err = _rest(gw, "POST", f"/v1/sandboxes/{sid}/input", {"action": "click", "x": 5000, "y": 10})
        assert (st, err["code"]) == (400, "invalid_argument") and "off the" in err["message"], err
        st, err = _rest(gw, "POST", f"/v1/sandboxes/{sid}/input", {"action": "key", "key": "hyper+q"})
        assert (st, err["code"]) == (400, "invalid_argument") and "unknown key 'hyper'" in err["message"], err
    finally:
        assert _rest(gw, "DELETE", f"/v1/sandboxes/{sid}")[0] == 204
    # A sandbox without a screen (a container) refuses, typed.
    st, info = _rest(gw, "POST", "/v1/sandboxes", {"template": TEMPLATE})
    assert st == 201, info
    try:
        st, err = _rest(gw, "GET", f"/v1/sandboxes/{info['sandbox_id']}/screenshot")
        assert err["code"] == "not_supported" and "backend 'vm'" in err["message"], (st, err)
    finally:
        _rest(gw, "DELETE", f"/v1/sandboxes/{info['sandbox_id']}")


async def test_vm_screen_over_the_gateway(gw: Gw, vm_host: Path) -> None:
    await asyncio.to_thread(_screen_scenario, gw)
