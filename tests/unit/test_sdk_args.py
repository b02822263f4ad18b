"""Invalid SDK arguments fail fast, client-side, with ``InvalidArgument`` naming the argument.

Needs no stack: validation happens before anything is sent. The errors that need an answer from the
control plane use the session's NATS plus, for templates, one placement replica (no host at all).
"""

from __future__ import annotations

import time
import uuid

import pytest

import sdk._async
from bus.natsd import free_port
from sdk import AsyncSandbox, InvalidArgument, Sandbox, SandboxNotFound, Unavailable, UnknownTemplate, build_spec


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"cpu": 0}, "cpu"),
        ({"cpu": -1}, "cpu"),
        ({"cpu": "x"}, "cpu"),
        ({"cpu": None}, "cpu"),
        ({"cpu": True}, "cpu"),
        ({"cpu": 1000}, "cpu"),
        ({"memory_mb": 0}, "memory_mb"),
        ({"memory_mb": 1.5}, "memory_mb"),
        ({"memory_mb": "512"}, "memory_mb"),
        ({"memory_mb": 8}, "memory_mb"),
        ({"disk_mb": 0}, "disk_mb"),
        ({"disk_mb": 2.5}, "disk_mb"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": -5}, "timeout"),
        ({"timeout": "long"}, "timeout"),
        ({"create_timeout": 0}, "create_timeout"),
        ({"envs": {"A": 1}}, "envs"),
        ({"envs": {1: "a"}}, "envs"),
        ({"envs": ["A=1"]}, "envs"),
        ({"metadata": {"k": None}}, "metadata"),
        ({"backend": "docker"}, "backend"),
        ({"backend": ""}, "backend"),
        ({"network": {"allow": ["1.2.3.4"]}}, "network"),
        ({"network": {"allow_out": "1.2.3.4"}}, "allow_out"),
        ({"network": {"allow_out": [""]}}, "allow_out"),
        ({"network": {"allow_out": [5]}}, "allow_out"),
        ({"network": ["allow_out"]}, "network"),
        ({"priority": "urgent"}, "priority"),
        ({"lease": 0}, "lease"),
        ({"sandbox_id": "has.dots"}, "sandbox_id"),
        ({"sandbox_id": "a b"}, "sandbox_id"),
        ({"sandbox_id": "x" * 129}, "sandbox_id"),
        ({"template": ""}, "template"),
        ({"template": 3}, "template"),
    ],
)
def test_create_arguments(kwargs: dict, name: str) -> None:
    template = kwargs.pop("template", "base")
    with pytest.raises(InvalidArgument) as ei:
        build_spec(template, **kwargs)
    assert ei.value.code == "invalid_argument"
    assert name in str(ei.value), str(ei.value)


def test_valid_arguments_pass() -> None:
    spec = build_spec(
        "base", cpu=0.5, memory_mb=64, disk_mb=128, timeout=10, envs={"A": "1"}, metadata={"k": "v"},
        network={"allow_out": ["10.0.0.0/8", "pypi.org:443"]}, priority="latency-sensitive", lease=30, sandbox_id="ok-1_A",
    )
    assert spec.cpu == 0.5 and spec.memory_mb == 64 and spec.network is not None and spec.network.allow_out[1] == "pypi.org:443"
    assert spec.sandbox_id == "ok-1_A" and spec.create_deadline > time.time()


async def test_create_rejects_before_connecting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad arguments fail without touching the network (here: no NATS at all)."""
    monkeypatch.setenv("DSEC_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    t0 = time.monotonic()
    with pytest.raises(InvalidArgument, match="memory_mb"):
        await AsyncSandbox.create(memory_mb=0)
    with pytest.raises(InvalidArgument, match="count"):
        await AsyncSandbox.create_batch(0)
    with pytest.raises(InvalidArgument, match="sandbox_ids"):
        await AsyncSandbox.create_batch(2, sandbox_ids=["a", "a"])
    with pytest.raises(InvalidArgument, match="sandbox id"):
        await AsyncSandbox.connect("not a valid id")
    assert time.monotonic() - t0 < 1.0


class _NoNats:
    """Stands in for a connection: argument checks must fail before any request is made."""

    def __getattr__(self, name: str):
        raise AssertionError(f"a request was attempted ({name}) before the arguments were checked")


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda sb: sb.files.write("relative.txt", "x"), "path"),
        (lambda sb: sb.files.write("", "x"), "path"),
        (lambda sb: sb.files.write(b"/tmp/x", "x"), "path"),
        (lambda sb: sb.files.write("/tmp/x", 123), "data"),
        (lambda sb: sb.files.write("/tmp/x", ["a"]), "data"),
        (lambda sb: sb.files.read("tmp/x"), "path"),
        (lambda sb: sb.files.read("/tmp/x", format="json"), "format"),
        (lambda sb: sb.files.read("/tmp/x", format="stream"), "format"),
        (lambda sb: sb.files.list("."), "path"),
        (lambda sb: sb.files.remove("x"), "path"),
        (lambda sb: sb.files.exists("~/x"), "path"),
        (lambda sb: sb.commands.run(""), "cmd"),
        (lambda sb: sb.commands.run(["ls", "-l"]), "cmd"),
        (lambda sb: sb.commands.run("ls", timeout=-1), "timeout"),  # 0 is "no limit", as in E2B
        (lambda sb: sb.commands.run("ls", timeout="1"), "timeout"),
        (lambda sb: sb.commands.run("ls", envs={"A": 1}), "envs"),
        (lambda sb: sb.commands.run("ls", user="a:b"), "user"),
        (lambda sb: sb.commands.run("ls", output_cap=-2), "output_cap"),
        (lambda sb: sb.commands.kill(0), "pid"),
        (lambda sb: sb.commands.kill("12"), "pid"),
        (lambda sb: sb.commands.send_stdin(5, 3.0), "data"),
        (lambda sb: sb.commands.connect(-1), "pid"),
        (lambda sb: sb.files.make_dir("rel"), "path"),
        (lambda sb: sb.files.rename("/a", "b"), "new_path"),
        (lambda sb: sb.files.watch_dir("x"), "path"),
        (lambda sb: sb.files.read("/x", offset=-1), "offset"),
        (lambda sb: sb.files.read("/x", length=-1), "length"),
        (lambda sb: sb.set_timeout(0), "timeout"),
        (lambda sb: sb.set_timeout(-1), "timeout"),
    ],
)
async def test_sandbox_call_arguments(call, name: str) -> None:
    sb = AsyncSandbox("sb-args-test", _NoNats())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument) as ei:
        await call(sb)
    assert name in str(ei.value), str(ei.value)


def test_sync_sandbox_checks_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(InvalidArgument, match="cpu"):
        Sandbox.create(cpu="x")
    with pytest.raises(InvalidArgument, match="backend"):
        Sandbox.create(backend="firecracker")
    sb = Sandbox(AsyncSandbox("sb-args-test", _NoNats()))  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="path"):
        sb.files.read("relative")
    with pytest.raises(InvalidArgument, match="format"):
        sb.files.read("/abs", format="yaml")


async def test_no_nats_is_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setenv("DSEC_NATS_URL", url)
    t0 = time.monotonic()
    with pytest.raises(Unavailable) as ei:
        await AsyncSandbox.create()
    assert ei.value.code == "unavailable" and "127.0.0.1" in str(ei.value)
    with pytest.raises(Unavailable):
        await AsyncSandbox.connect("sb-whatever")  # (list() and every other call share the same connect)
    assert time.monotonic() - t0 < 20, "Unavailable must come within the client's connect timeout"


def test_no_nats_is_unavailable_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_NATS_URL", f"nats://127.0.0.1:{free_port()}")
    with pytest.raises(Unavailable):
        Sandbox.create()


async def test_connect_to_unknown_sandbox(nats_server) -> None:
    with pytest.raises(SandboxNotFound, match="not running"):
        await AsyncSandbox.connect(f"sb-{uuid.uuid4().hex}", nats_url=nats_server.url)
    sb = AsyncSandbox(f"sb-{uuid.uuid4().hex}", await sdk._async._nc(nats_server.url))
    with pytest.raises(SandboxNotFound):
        await sb.commands.run("true")
    with pytest.raises(SandboxNotFound):
        await sb.files.read("/etc/hostname")
    assert not await sb.is_running()
    await sb.kill()  # killing what is not there is fine


async def test_unknown_template(nats_server) -> None:
    """Placement answers an unknown template with a typed error; no host is needed for that."""
    from placement import Placement

    p = Placement(nats_server.url, replica_id=f"args-{uuid.uuid4().hex[:6]}")
    await p.start()
    try:
        name = f"no-such-template-{uuid.uuid4().hex[:8]}"
        with pytest.raises(UnknownTemplate, match=name) as ei:
            await AsyncSandbox.create(name, nats_url=nats_server.url, pool=f"nohost-{uuid.uuid4().hex[:6]}", create_timeout=20)
        assert ei.value.code == "unknown_template"
    finally:
        await p.shutdown()
        await sdk._async.close_connections()
