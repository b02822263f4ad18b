"""The HTTP gateway under ``dsec up`` (authentication on): the unmodified e2b SDK end to end, two API
keys that cannot see each other's sandboxes, sandbox ports, dsec's REST API, and bad input.

The e2b SDK is synchronous here: each scenario runs in a thread (``asyncio.to_thread``) while the
gateway, NATS and the rest of the stack are separate processes started by ``dsec up``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import os
import re
import shutil
import signal
import socket
import struct
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import e2b
import pytest

from bus.natsd import free_port
from tests.conftest import eventually
from tests.netclaim import claim_net

from .conftest import (
    PY,
    Child,
    data_dir_leftovers,
    force_cleanup,
    needs_stack,
    run_process,
    subprocess_env,
)

pytestmark = [pytest.mark.containerd, needs_stack]

DSEC = [PY, "-m", "sdk.cli"]


UPLOAD_BOUND = 64_000_000  # bytes of file uploads a tenant's sandboxes may hold on the stack's host


@dataclass
class Gw:
    url: str  # the gateway
    nats_url: str
    data: Path
    key_a: str
    key_b: str
    up: Child

    def sdk(self, key: str | None = None) -> dict[str, Any]:
        """Connection options of the e2b SDK for this gateway (what E2B_API_URL/E2B_SANDBOX_URL say)."""
        return {"api_key": key or self.key_a, "api_url": self.url, "sandbox_url": self.url, "request_timeout": 60}


@pytest.fixture(scope="module")
async def gw() -> Any:
    import sdk._async

    data = Path(tempfile.mkdtemp(prefix=f"dsec-gw-{uuid.uuid4().hex[:6]}-", dir="/tmp"))
    port, http_port = free_port(), free_port()
    nats_url = f"nats://127.0.0.1:{port}"
    context = data.parent / f"{data.name}.context.json"  # not the machine's default pointer: other stacks run too
    net = await asyncio.to_thread(claim_net)  # network names of its own: not the default ones other stacks share
    # DSEC_TEMPLATE_FILES_MAX_MB: a per-tenant bound on template build sources small enough to test (test_templates);
    # DSEC_UPLOAD_MAX_BYTES_PER_TENANT: the host's per-tenant bound on file uploads, likewise (test_envd);
    # DSEC_TEMPLATE_READY_TIMEOUT_S: a readyCmd that never succeeds fails in 30 s (test_e2b_start_cmd)
    env = subprocess_env(nats_url, DSEC_CONTEXT=str(context), DSEC_TEMPLATE_FILES_MAX_MB="8", DSEC_UPLOAD_MAX_BYTES_PER_TENANT=str(UPLOAD_BOUND),
                         DSEC_TEMPLATE_READY_TIMEOUT_S="30", **net.env())
    up = Child([*DSEC, "up", "--data-dir", str(data), "--port", str(port), "--http-port", str(http_port),
                "--host-id", f"gw-{uuid.uuid4().hex[:6]}", "--ready-timeout", "240", "--fn-pool", "base=2"], env, data.parent / f"{data.name}.log").start()
    try:
        await eventually(lambda: "dsec up: ready" in up.log() or not up.alive(), timeout=240, interval=0.2, what="dsec up to print ready")
        assert up.alive(), up.log()
        assert f"export E2B_API_URL=http://127.0.0.1:{http_port} E2B_SANDBOX_URL=http://127.0.0.1:{http_port}" in up.log()
        keys = []
        for name in ("alice", "bob"):
            rc, out, err = await run_process(*DSEC, "api-key", "create", "--name", name, "--data-dir", str(data), env=env)
            assert rc == 0 and re.fullmatch(r"e2b_[0-9a-f]{48}", out.strip()), (rc, out, err)  # what e2b SDKs accept
            assert "does not accept it" not in err, err
            keys.append(out.strip())
        gw_url = f"http://127.0.0.1:{http_port}"
        await eventually(lambda: _status(gw_url + "/health") == 200, timeout=30, what="the gateway to answer")
        yield Gw(gw_url, nats_url, data, keys[0], keys[1], up)
        await sdk._async.close_connections()
        up.signal(signal.SIGINT)
        assert await up.wait(120) == 0, up.log()
        left = data_dir_leftovers(data)
        assert not left, left
    finally:
        if up.alive():
            up.signal(signal.SIGKILL)
            await up.wait(10)
        if data_dir_leftovers(data):
            await force_cleanup(data)
        if not data_dir_leftovers(data):
            shutil.rmtree(data, ignore_errors=True)
            for f in (data.parent / f"{data.name}.log", context):
                if f.exists():
                    os.unlink(f)
        net.release()


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def http(
    gw: Gw, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None, key: str | None = "a",
) -> tuple[int, Any, dict[str, str]]:
    """(status, decoded JSON or bytes, headers) of one request to the gateway."""
    h = dict(headers or {})
    if key is not None:
        h.setdefault("X-API-Key", {"a": gw.key_a, "b": gw.key_b}.get(key, key))
    req = urllib.request.Request(gw.url + path, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status, rh = r.read(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, rh = e.read(), e.code, dict(e.headers)
    try:
        return status, json.loads(raw), rh
    except ValueError:
        return status, raw, rh


# --------------------------------------------------------------------------------------------- e2b SDK
def _e2b_flow(gw: Gw) -> None:
    from e2b import CommandExitException, NotFoundException, Sandbox, SandboxNotRunningException

    sb = Sandbox.create("base", timeout=120, metadata={"suite": "gateway"}, **gw.sdk())
    try:
        assert sb.sandbox_id and sb.get_info().state.value == "running"
        # Streamed output: the command waits for a file that the test writes only once it has seen
        # the first line, so the line can only have come while the command was still running.
        seen: list[str] = []

        def on_stdout(s: str) -> None:
            seen.append(s)
            if "first" in s:
                sb.files.write("/tmp/go", "1")

        r = sb.commands.run("echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second; echo oops >&2", on_stdout=on_stdout, timeout=60)
        assert r.exit_code == 0 and r.stdout == "first\nsecond\n" and r.stderr == "oops\n", r
        assert seen[0] == "first\n" and "".join(seen) == "first\nsecond\n", seen
        with pytest.raises(CommandExitException) as ei:
            sb.commands.run("echo out; exit 3")
        assert ei.value.exit_code == 3 and ei.value.stdout == "out\n"
        # A background command, then its kill (the whole process group).
        h = sb.commands.run("sleep 300", background=True)
        assert h.pid > 1
        assert any(p.pid == h.pid for p in sb.commands.list())
        assert sb.commands.run(f"kill -0 {h.pid} && echo alive").stdout == "alive\n"
        assert h.kill() is True
        with pytest.raises(CommandExitException):
            h.wait()
        assert sb.commands.run(f"kill -0 {h.pid} 2>/dev/null || echo gone").stdout == "gone\n"
        # stdin: a command reading it, fed and closed through envd.
        h = sb.commands.run("cat; echo done", background=True, stdin=True)
        h.send_stdin("to stdin\n")
        h.close_stdin()
        assert h.wait().stdout == "to stdin\ndone\n"
        # Leave a background command and connect to it again: its output from then on, and its end.
        h = sb.commands.run("while [ ! -e /tmp/go2 ]; do sleep 0.05; done; echo later; exit 5", background=True)
        h.disconnect()
        again = sb.commands.connect(h.pid)
        sb.files.write("/tmp/go2", "1")
        with pytest.raises(CommandExitException) as ei:
            again.wait()
        assert ei.value.exit_code == 5 and "later" in ei.value.stdout
        # Files.
        info = sb.files.write("/tmp/e2b/a.txt", "hello files")
        assert info.path == "/tmp/e2b/a.txt"
        assert sb.files.read("/tmp/e2b/a.txt") == "hello files"
        assert bytes(sb.files.read("/tmp/e2b/a.txt", format="bytes")) == b"hello files"
        names = {e.name: e for e in sb.files.list("/tmp/e2b")}
        assert names["a.txt"].size == len("hello files") and names["a.txt"].type.value == "file"
        assert sb.files.exists("/tmp/e2b/a.txt") and not sb.files.exists("/tmp/e2b/nope")
        assert sb.files.make_dir("/tmp/e2b/sub") is True
        assert sb.files.make_dir("/tmp/e2b/sub") is False  # already there
        moved = sb.files.rename("/tmp/e2b/a.txt", "/tmp/e2b/sub/b.txt")
        assert moved.path == "/tmp/e2b/sub/b.txt" and sb.files.read("/tmp/e2b/sub/b.txt") == "hello files"
        assert not sb.files.exists("/tmp/e2b/a.txt")
        # A directory watch (the sync SDK polls a watcher).
        watch = sb.files.watch_dir("/tmp/e2b/sub")
        sb.files.write("/tmp/e2b/sub/new.txt", "n")
        events = watch.get_new_events()
        assert [(e.name, e.type.value) for e in events] == [("new.txt", "create"), ("new.txt", "chmod"), ("new.txt", "write")], events
        watch.stop()
        sb.files.remove("/tmp/e2b/sub")
        assert not sb.files.exists("/tmp/e2b/sub/b.txt")
        with pytest.raises(NotFoundException):
            sb.files.read("/tmp/e2b/sub/b.txt")
        # List (with a metadata filter), timeout, info.
        listed = Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "gateway"}), **gw.sdk()).next_items()
        assert [s.sandbox_id for s in listed] == [sb.sandbox_id]
        assert Sandbox.list(query=e2b.SandboxQuery(metadata={"suite": "other"}), **gw.sdk()).next_items() == []
        before = sb.get_info().end_at
        sb.set_timeout(600)
        after = sb.get_info()
        assert after.end_at > before and after.template_id == "base" and after.metadata == {"suite": "gateway"}
        # connect() gives a working handle on the same sandbox.
        again = Sandbox.connect(sb.sandbox_id, **gw.sdk())
        assert again.commands.run("echo again").stdout == "again\n"
    finally:
        sb.kill()
    # A killed sandbox: envd answers as E2B's proxy does, and the SDK says so.
    assert sb.is_running() is False
    with pytest.raises(SandboxNotRunningException):
        sb.commands.run("true")
    with pytest.raises(NotFoundException):
        Sandbox.connect(sb.sandbox_id, **gw.sdk())
    assert sb.sandbox_id not in [s.sandbox_id for s in Sandbox.list(**gw.sdk()).next_items()]


async def test_e2b_sdk_end_to_end(gw: Gw) -> None:
    await asyncio.to_thread(_e2b_flow, gw)


def _user_fallback(gw: Gw) -> None:
    from e2b import InvalidArgumentException, Sandbox, SandboxException

    sb = Sandbox.create("base", timeout=120, **gw.sdk())
    try:
        # The busybox template has no bash and no `user`: documented fallback to /bin/sh as root, home /root.
        r = sb.commands.run("whoami; pwd; echo $HOME")
        assert r.stdout == "root\n/root\n/root\n", r
        sb.files.write("rel.txt", "relative")  # a relative path starts at the user's home
        assert sb.files.read("/root/rel.txt") == "relative"
        assert sb.commands.run("cat rel.txt", cwd="/root").stdout == "relative"
        # A user the template does not have is refused, clearly.
        with pytest.raises((InvalidArgumentException, SandboxException)) as ei:
            sb.commands.run("true", user="nobody-here")
        assert "nobody-here" in str(ei.value)
    finally:
        sb.kill()


async def test_e2b_user_and_shell_fallback(gw: Gw) -> None:
    await asyncio.to_thread(_user_fallback, gw)


# --------------------------------------------------------------------------------------------- keys
def _two_keys(gw: Gw) -> None:
    from e2b import NotFoundException, Sandbox

    a = Sandbox.create("base", timeout=120, **gw.sdk(gw.key_a))
    try:
        sid = a.sandbox_id
        # Key B neither sees nor controls A's sandbox: 404 everywhere, as E2B answers.
        assert sid not in [s.sandbox_id for s in Sandbox.list(**gw.sdk(gw.key_b)).next_items()]
        assert sid in [s.sandbox_id for s in Sandbox.list(**gw.sdk(gw.key_a)).next_items()]
        for method, path, body in (("GET", f"/sandboxes/{sid}", None), ("DELETE", f"/sandboxes/{sid}", None),
                                   ("POST", f"/sandboxes/{sid}/timeout", b'{"timeout": 5}'), ("POST", f"/v2/sandboxes/{sid}/connect", b'{"timeout": 5}'),
                                   ("GET", f"/sandboxes/{sid}/metrics", None), ("GET", f"/v1/sandboxes/{sid}", None)):
            st, doc, _ = http(gw, method, path, body, {"Content-Type": "application/json"}, key="b")
            assert st == 404, (method, path, st, doc)
        with pytest.raises(NotFoundException):
            Sandbox.connect(sid, **gw.sdk(gw.key_b))
        # envd with B's token (what the SDK sends as X-Access-Token): what E2B's proxy says of a
        # sandbox it does not know, 502 "... was not found" (the SDK raises SandboxNotRunning).
        st, doc, _ = http(gw, "POST", "/process.Process/List", b"{}", {"Content-Type": "application/json", "E2b-Sandbox-Id": sid,
                                                                      "X-Access-Token": gw.key_b}, key=None)
        assert st == 502 and "was not found" in doc["message"], (st, doc)
        st, doc, _ = http(gw, "GET", "/files?path=/etc/hostname", None, {"E2b-Sandbox-Id": sid, "X-Access-Token": gw.key_b}, key=None)
        assert st == 502, (st, doc)
        # ... while A still has it, untouched.
        assert a.commands.run("echo mine").stdout == "mine\n"
        assert a.get_info().end_at.timestamp() > time.time() + 60  # B's timeout of 5 s did not apply
    finally:
        a.kill()


async def test_two_keys_see_only_their_own_sandboxes(gw: Gw) -> None:
    await asyncio.to_thread(_two_keys, gw)


async def test_wrong_key_is_refused(gw: Gw) -> None:
    wrong_secret = gw.key_a[:-32] + ("0" * 32 if not gw.key_a.endswith("0" * 32) else "1" * 32)
    for key in ("garbage", wrong_secret, "dsec_nosuchuser.secret", "e2b_" + "ab" * 24):
        st, doc, _ = await asyncio.to_thread(http, gw, "GET", "/v2/sandboxes", None, None, key)
        assert st == 401 and doc["code"] == 401 and doc["message"], (key, st, doc)
    st, doc, _ = await asyncio.to_thread(http, gw, "GET", "/v2/sandboxes", None, None, None)
    assert st == 401 and "API key" in doc["message"]
    # Positive control, and the gateway kept serving.
    st, doc, _ = await asyncio.to_thread(http, gw, "GET", "/v2/sandboxes")
    assert st == 200 and isinstance(doc, list)


async def test_revoked_key_is_refused_within_seconds(gw: Gw) -> None:
    """`dsec api-key revoke`: the key worked a moment ago, on an open sandbox; once `dsec up` has NATS
    reload its users the gateway answers it 401 (its NATS connection was dropped and is refused) and
    the sandbox keeps running (no --kill-sandboxes); `dsec api-key ls` no longer lists it."""
    env = subprocess_env(gw.nats_url, DSEC_CONTEXT=str(gw.data.parent / f"{gw.data.name}.context.json"))
    rc, out, err = await run_process(*DSEC, "api-key", "create", "--name", "carol", "--data-dir", str(gw.data), env=env)
    assert rc == 0, (rc, out, err)
    key = out.strip()
    st, doc, _ = await asyncio.to_thread(http, gw, "POST", "/v1/sandboxes", json.dumps({"template": "base"}).encode(), None, key)
    assert st in (200, 201), (st, doc)
    sid = doc["sandbox_id"] if "sandbox_id" in doc else doc["sandboxID"]
    st, doc, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}", None, None, key)
    assert st == 200, (st, doc)
    rc, out, err = await run_process(*DSEC, "api-key", "ls", "--json", "--data-dir", str(gw.data), env=env)
    assert rc == 0 and "carol" in {k["name"] for k in json.loads(out)}, (out, err)
    rc, out, err = await run_process(*DSEC, "api-key", "revoke", "carol", "--data-dir", str(gw.data), env=env)
    assert rc == 0 and "keep running" in out, (rc, out, err)
    t0 = time.monotonic()

    async def refused() -> bool:
        st, _, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}", None, None, key)
        return st == 401

    await eventually(refused, timeout=15, interval=0.2, what="the revoked key refused by the gateway")
    assert time.monotonic() - t0 < 15
    rc, out, err = await run_process(*DSEC, "api-key", "ls", "--json", "--data-dir", str(gw.data), env=env)
    assert "carol" not in {k["name"] for k in json.loads(out)}
    # Positive control: another key still works; the revoked key's sandbox still runs (the operator's view).
    st, _, _ = await asyncio.to_thread(http, gw, "GET", "/v2/sandboxes")
    assert st == 200
    from bus.auth import AuthConfig
    from sdk import AsyncSandbox
    from sdk._async import _nc

    admin = AuthConfig.load_or_create(gw.data / "auth.json").url_for("admin", gw.nats_url)
    sb = AsyncSandbox(sid, await _nc(admin))
    assert await sb.is_running()
    await sb.kill()


# --------------------------------------------------------------------------------------------- ports
def _ports(gw: Gw) -> None:
    from e2b import Sandbox

    sb = Sandbox.create("base", timeout=120, **gw.sdk())
    try:
        sb.files.write("/tmp/www/index.html", "served from inside")
        sb.commands.run("httpd -f -p 8080 -h /tmp/www", background=True)
        host = sb.get_host(8080)
        assert host == f"8080-{sb.sandbox_id}.localhost:{gw.url.rsplit(':', 1)[1]}"

        def get(headers: dict[str, str], path: str = "/index.html") -> tuple[int, Any]:
            st, doc, _ = http(gw, "GET", path, None, headers, key=None)
            return st, doc

        deadline = time.monotonic() + 10
        while True:  # httpd starts in the background: bounded wait until it listens
            st, doc = get({"Host": host, "X-API-Key": gw.key_a})
            if st == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # poll interval
        assert (st, doc) == (200, b"served from inside")
        # envd by host name too (port 49983), as E2B's own sandbox URLs name it.
        assert get({"Host": sb.get_host(49983), "X-Access-Token": gw.key_a}, "/health")[0] == 204
        # By header too (E2b-Sandbox-Port), and with the SDK's traffic token header.
        assert get({"E2b-Sandbox-Id": sb.sandbox_id, "E2b-Sandbox-Port": "8080", "e2b-traffic-access-token": gw.key_a}) == (200, b"served from inside")
        st, doc = get({"Host": host, "X-API-Key": gw.key_a}, "/missing")
        assert st == 404  # the server's own answer, relayed
        # Only with the key: none -> 401, the other key -> 404.
        assert get({"Host": host})[0] == 401
        assert get({"Host": host, "X-API-Key": gw.key_b})[0] == 502  # as for a sandbox that does not exist
        # Nothing listening: 502 with a reason.
        st, doc = get({"Host": sb.get_host(8081), "X-API-Key": gw.key_a})
        assert st == 502 and "port is not open" in doc["message"] and "8081" in doc["message"], (st, doc)
        # The key never reaches the sandbox: a one-shot server records the request it got.
        sb.files.write("/tmp/resp", "HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok")
        sb.commands.run("nc -l -p 8082 < /tmp/resp > /tmp/req", background=True)
        deadline = time.monotonic() + 10
        while (got := get({"Host": sb.get_host(8082), "X-API-Key": gw.key_a, "X-Extra": "kept"}, "/seen?q=1"))[0] != 200:
            assert time.monotonic() < deadline, got
            time.sleep(0.05)  # poll interval: nc starts in the background
        assert got == (200, b"ok")
        while not (seen := sb.files.read("/tmp/req")).endswith("\r\n\r\n"):  # nc writes what it got as it goes
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)  # poll interval
        assert seen.startswith("GET /seen?q=1 HTTP/1.1\r\n") and "X-Extra: kept" in seen, seen
        assert gw.key_a[-32:] not in seen and "x-api-key" not in seen.lower(), seen
        # The sandbox's network is still closed: loopback only.
        ifaces = sb.commands.run("cat /proc/net/dev").stdout
        assert "lo:" in ifaces and "eth0" not in ifaces, ifaces
    finally:
        sb.kill()


async def test_sandbox_port_through_the_gateway(gw: Gw) -> None:
    await asyncio.to_thread(_ports, gw)


# --------------------------------------------------------------------------------------------- REST
async def test_dsec_rest_api_and_openapi(gw: Gw) -> None:
    st, doc, _ = await asyncio.to_thread(http, gw, "GET", "/openapi.json", None, None, None)
    assert st == 200 and doc["openapi"].startswith("3.") and "/v1/sandboxes/{id}/exec" in doc["paths"]
    st, sbd, _ = await asyncio.to_thread(http, gw, "POST", "/v1/sandboxes", json.dumps({"template": "base", "memory_mb": 64}).encode())
    assert st == 201 and sbd["state"] == "running", sbd
    sid = sbd["sandbox_id"]
    try:
        st, r, _ = await asyncio.to_thread(http, gw, "POST", f"/v1/sandboxes/{sid}/exec", json.dumps({"cmd": "echo rest; exit 4"}).encode())
        assert st == 200 and r == {"stdout": "rest\n", "stderr": "", "exit_code": 4}
        st, w, _ = await asyncio.to_thread(http, gw, "PUT", f"/v1/sandboxes/{sid}/files?path=/tmp/r.bin", b"\x00\x01rest")
        assert st == 200 and w["size"] == 6
        st, data, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}/files?path=/tmp/r.bin")
        assert st == 200 and data == b"\x00\x01rest"
        st, ls, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}/files/list?path=/tmp")
        assert "r.bin" in [e["name"] for e in ls]
        st, err, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}/files?path=/tmp/none")
        assert st == 404 and err["code"] == "file_not_found"
        st, err, _ = await asyncio.to_thread(http, gw, "POST", "/v1/sandboxes", json.dumps({"memory_mb": -1}).encode())
        assert st == 400 and err["code"] == "invalid_argument" and "memory_mb" in err["message"]
        st, lst, _ = await asyncio.to_thread(http, gw, "GET", "/v1/sandboxes")
        assert sid in [s["sandbox_id"] for s in lst]
    finally:
        st, _, _ = await asyncio.to_thread(http, gw, "DELETE", f"/v1/sandboxes/{sid}")
        assert st == 204
    st, err, _ = await asyncio.to_thread(http, gw, "GET", f"/v1/sandboxes/{sid}")
    assert st == 404 and err["code"] == "sandbox_not_found"


# --------------------------------------------------------------------------------------------- bad input
def _envelope(doc: dict[str, Any]) -> bytes:
    raw = json.dumps(doc).encode()
    return struct.pack(">BI", 0, len(raw)) + raw


def _bad_input(gw: Gw) -> None:
    from e2b import Sandbox

    sb = Sandbox.create("base", timeout=120, **gw.sdk())
    sid = sb.sandbox_id
    envd = {"E2b-Sandbox-Id": sid, "X-Access-Token": gw.key_a}
    try:
        sb.files.write("/tmp/canary", "alive")
        json_h = {"Content-Type": "application/json"}
        # Malformed JSON, a JSON that is not an object, wrong field types: 400 with a message.
        bodies = (b"{not json", b"[1, 2]", b'{"templateID": 7}', b'{"templateID": "base", "timeout": "soon"}', b'{"templateID": "base", "metadata": {"a": 1}}')
        for body in bodies:
            st, doc, _ = http(gw, "POST", "/v2/sandboxes", body, json_h)
            assert st == 400 and doc["code"] == 400 and doc["message"], (body, st, doc)
        st, doc, _ = http(gw, "POST", f"/sandboxes/{sid}/timeout", b"{", json_h)
        assert st == 400, doc
        st, doc, _ = http(gw, "POST", "/v2/sandboxes", b'{"templateID": "' + b"x" * (5 << 20) + b'"}', json_h)
        assert st == 413 and doc["code"] == 413, (st, doc)
        st, doc, _ = http(gw, "GET", "/v2/sandboxes?limit=lots")
        assert st == 400 and "limit" in doc["message"]
        st, doc, _ = http(gw, "POST", "/v2/sandboxes", b'{"templateID": "no-such-template"}', json_h)
        assert st == 404 and "no-such-template" in doc["message"], doc
        # Unknown routes: 404 in the API's error shape.
        for method, path in (("GET", "/nope"), ("POST", "/sandboxes/x/y/z"), ("PATCH", "/sandboxes")):
            st, doc, _ = http(gw, method, path)
            assert st in (404, 405) and doc["code"] == st and doc["message"], (path, st, doc)
        # envd: malformed Connect requests get Connect errors; unknown methods are unimplemented.
        st, doc, _ = http(gw, "POST", "/filesystem.Filesystem/Stat", b"{oops", {**envd, **json_h}, key=None)
        assert (st, doc["code"]) == (400, "invalid_argument"), doc
        st, doc, _ = http(gw, "POST", "/filesystem.Filesystem/Stat", b"{}", {**envd, "Content-Type": "text/plain"}, key=None)
        assert (st, doc["code"]) == (400, "invalid_argument"), doc
        st, doc, _ = http(gw, "POST", "/process.Process/Nope", b"{}", {**envd, **json_h}, key=None)
        assert (st, doc["code"]) == (501, "unimplemented"), doc
        st, doc, _ = http(gw, "POST", "/process.Process/Start", _envelope({"process": {}}), {**envd, "Content-Type": "application/connect+json"}, key=None)
        assert st == 200 and b'"invalid_argument"' in (doc if isinstance(doc, bytes) else json.dumps(doc).encode())
        st, doc, _ = http(gw, "GET", "/files?path=/tmp/none", None, envd, key=None)
        assert st == 404 and doc["code"] == 404
        st, doc, _ = http(gw, "GET", "/elsewhere", None, envd, key=None)
        assert st == 404, doc
        # A client that goes away mid-stream: a command streaming output, the socket closed after
        # the first bytes. The gateway keeps serving and the sandbox is unaffected.
        host, port = gw.url.removeprefix("http://").split(":")
        body = _envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "for i in $(seq 1 200); do echo line $i; sleep 0.01; done"]}})
        for _ in range(3):
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(
                f"POST /process.Process/Start HTTP/1.1\r\nHost: {host}\r\nE2b-Sandbox-Id: {sid}\r\nX-Access-Token: {gw.key_a}\r\n"
                f"Content-Type: application/connect+json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
            )
            assert s.recv(64)  # the response had started
            s.close()
        assert sb.files.read("/tmp/canary") == "alive"
        assert sb.commands.run("echo still").stdout == "still\n"
        st, _, _ = http(gw, "GET", f"/sandboxes/{sid}")
        assert st == 200
    finally:
        sb.kill()


async def test_bad_input_gets_status_and_message(gw: Gw) -> None:
    await asyncio.to_thread(_bad_input, gw)


async def test_oversized_upload_is_refused(gw: Gw) -> None:
    """A gateway with a 1 MiB upload limit (its own process on the same stack): 413, nothing half-written
    that the next upload cannot replace, and it keeps serving."""
    from e2b import Sandbox

    from bus.auth import ENV_MONITOR_URL, MONITOR_ROLE, AuthConfig

    http_port = free_port()
    monitor = AuthConfig.load_or_create(gw.data / "auth.json").url_for(MONITOR_ROLE, gw.nats_url)  # its reader of records, as `dsec up` gives it
    small = Child([PY, "-m", "sdk.gateway", "--http-port", str(http_port), "--max-upload-mb", "1"],
                  subprocess_env(gw.nats_url, **{ENV_MONITOR_URL: monitor}), gw.data / "gateway-small.log").start()
    url = f"http://127.0.0.1:{http_port}"
    try:
        await eventually(lambda: _status(url + "/health") == 200, timeout=30, what="the second gateway to answer")
        small_gw = Gw(url, gw.nats_url, gw.data, gw.key_a, gw.key_b, small)

        def scenario() -> None:
            sb = Sandbox.create("base", timeout=120, **small_gw.sdk())
            try:
                envd = {"E2b-Sandbox-Id": sb.sandbox_id, "X-Access-Token": gw.key_a}
                big = b"x" * (1024 * 1024 + 1)
                st, doc, _ = http(small_gw, "POST", "/files?path=/tmp/big", big, {**envd, "Content-Type": "application/octet-stream"}, key=None)
                assert st == 413 and "limit" in doc["message"], (st, doc)
                boundary = "b0undary"
                multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"big\"\r\n"
                             "Content-Type: application/octet-stream\r\n\r\n").encode() + big + f"\r\n--{boundary}--\r\n".encode()
                mp_h = {**envd, "Content-Type": f"multipart/form-data; boundary={boundary}"}
                st, doc, _ = http(small_gw, "POST", "/files?path=/tmp/big", multipart, mp_h, key=None)
                assert st == 413, (st, doc)
                st, doc, _ = http(small_gw, "PUT", f"/v1/sandboxes/{sb.sandbox_id}/files?path=/tmp/big", big, None)
                assert st == 413 and doc["code"] == "payload_too_large"
                # Within the limit it works (multipart, as the SDK sends it), and the sandbox is fine.
                sb.files.write("/tmp/big", b"y" * 1000)
                assert sb.files.read("/tmp/big") == "y" * 1000
            finally:
                sb.kill()

        await asyncio.to_thread(scenario)
    finally:
        small.signal(signal.SIGTERM)
        await small.wait(20)


def test_api_key_format() -> None:
    from sdk.gateway._keys import BadKey, make_key, parse_key

    assert parse_key(make_key("cli-alice-1234", "s3cr.et")) == ("cli-alice-1234", "s3cr.et")
    for bad in ("", "e2b_x", "dsec_", "dsec_a", "dsec_bad name.x", "dsec_a.", "dsec_a.b.c" * 100):
        with pytest.raises(BadKey):
            parse_key(bad)


def test_envd_user_header() -> None:
    from sdk.gateway._users import DEFAULT_USER, user_of

    assert user_of(None) == DEFAULT_USER
    assert user_of("Basic " + base64.b64encode(b"root:").decode()) == "root"
    from bus.errors import InvalidArgument

    with pytest.raises(InvalidArgument):
        user_of("Basic !!!")


# --------------------------------------------------------------------------------------------- Python template
async def test_e2b_on_the_python_template_runs_as_user(gw: Gw) -> None:
    """The Python template has E2B's `user` (home /home/user) and bash: commands run as that user by
    default, relative paths land in its home and belong to it, and a request naming root is honoured."""
    from bus.auth import AuthConfig

    admin = AuthConfig.load_or_create(gw.data / "auth.json").url_for("admin", gw.nats_url)
    rc, out, err = await run_process(*DSEC, "image", "build-python", "--data-dir", str(gw.data), "--json", env=subprocess_env(admin), timeout=1800)
    assert rc == 0, (out, err)

    def scenario() -> None:
        from e2b import Sandbox

        sb = Sandbox.create("python", timeout=300, **gw.sdk())
        try:
            r = sb.commands.run('whoami; pwd; echo "$HOME"; test -n "$BASH_VERSION" && echo bash')
            assert r.stdout == "user\n/home/user\n/home/user\nbash\n", r
            sb.files.write("notes.txt", "mine")
            assert sb.commands.run("stat -c %U /home/user/notes.txt; cat notes.txt").stdout == "user\nmine"
            assert sb.files.make_dir("made") and sb.commands.run("stat -c %U /home/user/made").stdout == "user\n"
            assert sb.commands.run("whoami", user="root").stdout == "root\n"
            assert sb.commands.run("python3 -c 'print(6*7)'").stdout == "42\n"
        finally:
            sb.kill()

    await asyncio.to_thread(scenario)


def _pagination(gw: Gw) -> None:
    from e2b import Sandbox

    tag = uuid.uuid4().hex[:8]
    made = [Sandbox.create("base", timeout=120, metadata={"page": tag}, **gw.sdk(gw.key_b)) for _ in range(3)]
    try:
        q = f"/v2/sandboxes?limit=2&metadata=page%3D{tag}"
        st, first, h = http(gw, "GET", q, key="b")
        assert st == 200 and len(first) == 2 and h.get("x-next-token"), (st, first, h)
        st, second, h2 = http(gw, "GET", f"{q}&nextToken={h['x-next-token']}", key="b")
        assert st == 200 and len(second) == 1 and not h2.get("x-next-token"), (second, h2)
        assert {s["sandboxID"] for s in first + second} == {sb.sandbox_id for sb in made}
        assert http(gw, "GET", f"/v2/sandboxes?state=paused&metadata=page%3D{tag}", key="b")[1] == []
        assert len(http(gw, "GET", f"/v2/sandboxes?state=running,paused&metadata=page%3D{tag}", key="b")[1]) == 3
        st, doc, _ = http(gw, "GET", "/v2/sandboxes?nextToken=bogus", key="b")
        assert st == 400 and "nextToken" in doc["message"]
        # The SDK's paginator walks the same pages.
        pager = Sandbox.list(query=e2b.SandboxQuery(metadata={"page": tag}), limit=2, **gw.sdk(gw.key_b))
        seen = pager.next_items()
        assert pager.has_next
        seen += pager.next_items()
        assert len(seen) == 3 and not pager.has_next
    finally:
        for sb in made:
            sb.kill()


async def test_list_filters_and_pagination(gw: Gw) -> None:
    await asyncio.to_thread(_pagination, gw)


async def test_e2b_async_sdk(gw: Gw) -> None:
    """The async e2b SDK takes other envd paths: WatchDir as a server stream, commands.kill by pid, metrics."""
    from e2b import AsyncSandbox

    sb = await AsyncSandbox.create("base", timeout=120, **gw.sdk())
    try:
        r = await sb.commands.run("echo async; echo err >&2")
        assert (r.stdout, r.stderr) == ("async\n", "err\n")
        h = await sb.commands.run("sleep 300", background=True)
        assert await sb.commands.kill(h.pid) is True

        async def gone() -> bool:  # killed; reaped by the agent a moment later (a zombie answers kill -0)
            return (await sb.commands.run(f"kill -0 {h.pid} 2>/dev/null || echo gone")).stdout == "gone\n"

        await eventually(gone, timeout=10, what="the killed command gone")
        events: list[Any] = []
        await sb.files.make_dir("/tmp/aw")
        watch = await sb.files.watch_dir("/tmp/aw", on_event=events.append)
        await sb.files.write("/tmp/aw/f", "1")
        await eventually(lambda: any(e.name == "f" and e.type.value == "create" for e in events), timeout=10, what="a create event")
        await watch.stop()
        [m] = await sb.get_metrics()
        assert m.mem_total == 512 * 1024 * 1024 and m.cpu_count == 1
    finally:
        await sb.kill()


# --------------------------------------------------------------------------------- pause, snapshots, fork
def _pause_resume_snapshot_fork(gw: Gw) -> None:
    from e2b import Sandbox, SandboxNotFoundException, SandboxQuery, SandboxState

    def paused_ids() -> list[str]:
        return [s.sandbox_id for s in Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED]), **gw.sdk()).next_items()]

    sb = Sandbox.create("base", timeout=300, **gw.sdk())
    made: list[Any] = [sb]
    try:
        payload = "".join(chr(32 + i % 90) for i in range(5000)) + "\n\x01end"
        sb.files.write("/tmp/keep.txt", payload)
        for round_ in range(3):
            assert sb.pause() is True
            assert sb.get_info().state.value == "paused", round_
            assert sb.sandbox_id in paused_ids()
            assert sb.pause() is False  # e2b's answer to 409: already paused
            st, body, _ = http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/pause", b"{}")
            assert (st, body["code"]) == (409, 409) and "already paused" in body["message"], body
            back = Sandbox.connect(sb.sandbox_id, **gw.sdk())  # resumes it (E2B's 201)
            info = back.get_info()
            assert info.state.value == "running" and sb.sandbox_id not in paused_ids()
            assert (info.end_at - dt.datetime.now(dt.UTC)).total_seconds() > 200  # its own 300 s again, not E2B's 15 s
            assert back.files.read("/tmp/keep.txt") == payload
            assert back.commands.run("echo alive").stdout == "alive\n"
        # Resume of a running sandbox: E2B's 409; connect to it: 200.
        st, body, _ = http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/resume", b"{}")
        assert (st, body["code"]) == (409, 409), body
        assert http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/connect", b'{"timeout": 300}')[0] == 200
        # The resume route itself, after a pause over raw HTTP.
        assert http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/pause", b"{}")[0] == 204
        st, body, _ = http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/resume", b'{"timeout": 300}')
        assert st == 201 and body["sandboxID"] == sb.sandbox_id, body
        assert sb.files.read("/tmp/keep.txt") == payload
        # Snapshot, then a sandbox created from it has the file; the snapshot lists for its sandbox only.
        snap = sb.create_snapshot()
        assert snap.snapshot_id.startswith("snap-") and snap.names
        assert [s.snapshot_id for s in sb.list_snapshots().next_items()] == [snap.snapshot_id]
        assert snap.snapshot_id in [s.snapshot_id for s in Sandbox.list_snapshots(**gw.sdk()).next_items()]
        assert snap.snapshot_id not in [s.snapshot_id for s in Sandbox.list_snapshots(**gw.sdk(gw.key_b)).next_items()]
        sb.files.write("/tmp/keep.txt", "changed after the snapshot")
        child = Sandbox.create(snap.snapshot_id, timeout=120, **gw.sdk())
        made.append(child)
        assert child.files.read("/tmp/keep.txt") == payload
        # Fork: two sandboxes with the source's files as of now; the source keeps running.
        forks = sb.fork(count=2, timeout=120)
        made.extend(f for f in forks if not isinstance(f, Exception))
        assert len(forks) == 2 and all(not isinstance(f, Exception) for f in forks), forks
        assert {f.files.read("/tmp/keep.txt") for f in forks} == {"changed after the snapshot"}
        assert len({f.sandbox_id for f in forks} | {sb.sandbox_id}) == 3 and sb.is_running()
        # Another key: its pause, snapshot, fork and create-from-snapshot see nothing.
        for path in ("pause", "resume", "snapshots", "fork", "connect"):
            st, body, _ = http(gw, "POST", f"/sandboxes/{sb.sandbox_id}/{path}", b"{}", key="b")
            assert (st, body["code"]) == (404, 404), (path, body)
        st, body, _ = http(gw, "POST", "/sandboxes", json.dumps({"templateID": snap.snapshot_id}).encode(), key="b")
        assert st == 404 and snap.snapshot_id in body["message"], body
        assert http(gw, "DELETE", f"/templates/{snap.snapshot_id}", key="b")[0] == 404
        with pytest.raises(SandboxNotFoundException):
            Sandbox.pause(sb.sandbox_id, **gw.sdk(gw.key_b))
        # B over NATS with its own key (no gateway in between): the host agent refuses to restore A's
        # snapshot into B's sandbox, and B may not read snapshot records (they hold A's envs).
        from bus.auth import with_credentials
        from bus.errors import PermissionDenied
        from sdk import Sandbox as DsecSandbox
        from sdk.gateway._keys import parse_key

        b_url = with_credentials(gw.nats_url, *parse_key(gw.key_b))
        with pytest.raises(PermissionDenied, match="does not belong to tenant"):
            DsecSandbox.create("base", snapshot=snap.snapshot_id, nats_url=b_url, create_timeout=60)
        with pytest.raises(PermissionDenied):
            DsecSandbox.list_snapshots(nats_url=b_url)
        # Positive control: A's own key restores it over NATS.
        own = DsecSandbox.create("base", snapshot=snap.snapshot_id, nats_url=with_credentials(gw.nats_url, *parse_key(gw.key_a)), create_timeout=60)
        try:
            assert own.files.read("/tmp/keep.txt") == payload
        finally:
            own.kill()
        assert sb.is_running()
    finally:
        for s in made:
            s.kill()
    # Unknown ids: 404; a killed sandbox pauses no more.
    for sid in ("sb-nope", sb.sandbox_id):
        for path in ("pause", "resume", "snapshots", "fork"):
            st, body, _ = http(gw, "POST", f"/sandboxes/{sid}/{path}", b"{}")
            assert (st, body["code"]) == (404, 404), (sid, path, body)
    st, body, _ = http(gw, "POST", "/sandboxes", b'{"templateID": "snap-nope"}')
    assert st == 404, body
    with pytest.raises(SandboxNotFoundException):
        Sandbox.pause("sb-nope", **gw.sdk())
    # Snapshots outlive their sandbox; deleting (newest first: the fork's builds on the first) is e2b's True, then False.
    snaps = Sandbox.list_snapshots(sandbox_id=sb.sandbox_id, **gw.sdk()).next_items()
    assert [s.snapshot_id for s in snaps][0] == snap.snapshot_id and len(snaps) == 2
    assert Sandbox.delete_snapshot(snap.snapshot_id, **gw.sdk(gw.key_b)) is False
    for s in reversed(snaps):
        assert Sandbox.delete_snapshot(s.snapshot_id, **gw.sdk()) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id, **gw.sdk()) is False
    # Bad bodies: 400.
    assert http(gw, "POST", "/sandboxes/sb-nope/pause", b'{"memory": "yes"}')[0] == 400


async def test_e2b_pause_resume_snapshot_fork(gw: Gw) -> None:
    await asyncio.to_thread(_pause_resume_snapshot_fork, gw)


def _persisted_pause_and_rest(gw: Gw) -> None:
    from e2b import Sandbox

    # E2B's filesystem-only pause: the sandbox is snapshotted and its host freed; connect starts it again.
    sb = Sandbox.create("base", timeout=300, **gw.sdk())
    try:
        sb.files.write("/home/persist.txt", "on disk")
        assert sb.pause(mode="filesystem") is True
        st, rec, _ = http(gw, "GET", f"/v1/sandboxes/{sb.sandbox_id}")
        assert st == 404 or rec["state"] == "paused", rec  # no host holds it now
        assert [s["state"] for s in http(gw, "GET", "/v1/sandboxes")[1] if s["sandbox_id"] == sb.sandbox_id] == ["paused"]
        back = Sandbox.connect(sb.sandbox_id, **gw.sdk())
        assert back.files.read("/home/persist.txt") == "on disk"
        assert back.commands.run("echo up").stdout == "up\n"
    finally:
        sb.kill()

    # dsec's REST: pause (frozen, then persisted), resume, snapshot, create from it, fork, list, delete.
    st, d, _ = http(gw, "POST", "/v1/sandboxes", json.dumps({"template": "base", "memory_mb": 64}).encode())
    assert st == 201, d
    sid, made = d["sandbox_id"], [d["sandbox_id"]]
    try:
        assert http(gw, "PUT", f"/v1/sandboxes/{sid}/files?path=/home/r.txt", b"rest file")[0] == 200
        st, p, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/pause", b"{}")
        assert st == 200 and p == {"sandbox_id": sid, "snapshot": None}, p
        assert http(gw, "POST", f"/v1/sandboxes/{sid}/pause", b"{}")[0] == 200  # dsec: pausing a paused one is a no-op
        st, err, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/exec", json.dumps({"cmd": "true"}).encode())
        assert (st, err["code"]) == (409, "not_running"), err
        st, r, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/resume")
        assert st == 200 and r["state"] == "running", r
        st, p, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/pause", b'{"persist": true}')
        assert st == 200 and p["snapshot"]["sandbox_id"] == sid, p
        st, r, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/resume")
        assert st == 200 and r["state"] == "running", r
        assert http(gw, "GET", f"/v1/sandboxes/{sid}/files?path=/home/r.txt")[1] == b"rest file"
        st, snap, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/snapshots", json.dumps({"name": "rest", "metadata": {"k": "v"}}).encode())
        assert st == 201 and snap["name"] == "rest" and snap["metadata"] == {"k": "v"}, snap
        assert http(gw, "GET", f"/v1/snapshots/{snap['snapshot_id']}")[1]["snapshot_id"] == snap["snapshot_id"]
        assert snap["snapshot_id"] in [s["snapshot_id"] for s in http(gw, "GET", f"/v1/snapshots?sandbox_id={sid}")[1]]
        assert snap["snapshot_id"] not in [s["snapshot_id"] for s in http(gw, "GET", "/v1/snapshots", key="b")[1]]
        assert http(gw, "GET", f"/v1/snapshots/{snap['snapshot_id']}", key="b")[0] == 404
        st, c, _ = http(gw, "POST", "/v1/sandboxes", json.dumps({"snapshot": snap["snapshot_id"], "memory_mb": 64}).encode())
        assert st == 201, c
        made.append(c["sandbox_id"])
        assert http(gw, "GET", f"/v1/sandboxes/{c['sandbox_id']}/files?path=/home/r.txt")[1] == b"rest file"
        st, forks, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/fork", json.dumps({"count": 2, "timeout": 120}).encode())
        assert st == 201 and len(forks) == 2 and all(f["state"] == "running" for f in forks), forks
        made.extend(f["sandbox_id"] for f in forks)
        assert http(gw, "GET", f"/v1/sandboxes/{forks[1]['sandbox_id']}/files?path=/home/r.txt")[1] == b"rest file"
        for path, body in (("pause", b'{"persist": 1}'), ("fork", b'{"count": 0}'), ("snapshots", b'{"nope": 1}')):
            st, err, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/{path}", body)
            assert (st, err["code"]) == (400, "invalid_argument"), (path, err)
        for path in ("pause", "resume", "snapshots", "fork"):
            st, err, _ = http(gw, "POST", f"/v1/sandboxes/{sid}/{path}", b"{}", key="b")
            assert (st, err["code"]) == (404, "sandbox_not_found"), (path, err)
        st, err, _ = http(gw, "POST", "/v1/sandboxes", json.dumps({"snapshot": snap["snapshot_id"]}).encode(), key="b")
        assert (st, err["code"]) == (404, "unknown_snapshot"), err
        doc = http(gw, "GET", "/openapi.json", key=None)[1]
        assert {"/v1/sandboxes/{id}/pause", "/v1/sandboxes/{id}/resume", "/v1/sandboxes/{id}/snapshots", "/v1/sandboxes/{id}/fork",
                "/v1/snapshots", "/v1/snapshots/{id}"} <= set(doc["paths"])
    finally:
        for s in made:
            assert http(gw, "DELETE", f"/v1/sandboxes/{s}")[0] == 204
    assert http(gw, "DELETE", f"/v1/snapshots/{snap['snapshot_id']}", key="b")[0] == 404
    st, err, _ = http(gw, "DELETE", f"/v1/snapshots/{snap['snapshot_id']}")
    assert (st, err["code"]) == (409, "snapshot_in_use"), err  # the fork's snapshot builds on it
    (fork_snap,) = [s for s in http(gw, "GET", f"/v1/snapshots?sandbox_id={sid}")[1] if s["parent_id"] == snap["snapshot_id"]]
    for s in (fork_snap, snap):
        assert http(gw, "DELETE", f"/v1/snapshots/{s['snapshot_id']}")[0] == 204
    assert http(gw, "GET", f"/v1/snapshots/{snap['snapshot_id']}")[0] == 404


async def test_persisted_pause_and_rest_snapshots(gw: Gw) -> None:
    await asyncio.to_thread(_persisted_pause_and_rest, gw)


async def test_run_code_with_the_key_in_the_url(gw: Gw) -> None:
    """SandboxFusion's /run_code on `dsec up --fn-pool base=2` with authentication on: the key in the
    path, the key as basic auth, and a wrong key (tests/integration/test_fncall.py has the rest)."""

    def scenario() -> None:
        body = json.dumps({"code": "echo fused", "language": "sh"}).encode()
        json_ct = {"Content-Type": "application/json"}
        st, out, _ = http(gw, "POST", f"/k/{gw.key_a}/run_code", body, json_ct, key=None)
        assert st == 200 and out["status"] == "Success" and out["run_result"]["stdout"] == "fused\n", out
        basic = {**json_ct, "Authorization": "Basic " + base64.b64encode(f"dsec:{gw.key_b}".encode()).decode()}
        st, out, _ = http(gw, "POST", "/run_code", body, basic, key=None)
        assert st == 200 and out["status"] == "Success", out
        st, out, _ = http(gw, "POST", f"/k/{gw.key_a}x/run_code", body, json_ct, key=None)
        assert st == 401 and out["status"] == "SandboxError", out

    await asyncio.to_thread(scenario)
