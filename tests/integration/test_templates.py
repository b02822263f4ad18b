"""Templates users define: Dockerfile builds on the real stack (build sandboxes through the bus, each
step a snapshot packed by the host's real lazy loader, the step cache), FROM a template, a snapshot or
an image in a real registry (docker-registry, pushed with skopeo), and what a bad build leaves: nothing.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from bus import codec
from bus import subjects as S
from bus.errors import BuildFailed, InvalidArgument
from bus.streams import ensure_kv
from sdk._builder import TemplateBuilder, build_dockerfile
from sdk._dockerfile import parse_dockerfile
from tests import registry as R
from tests.conftest import needs
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, needs_stack
from . import test_gateway as _gateway
from .test_gateway import Gw, http

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse, needs(R.missing())]
gw = _gateway.gw  # the `dsec up` stack with its gateway (a module fixture of its own here)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def imaged(stack: Stack, lazy: LazyDaemon) -> AsyncIterator[Any]:
    from imaged._service import ImagedService

    svc = ImagedService(stack.url, data_dir=stack.data_dir / "imaged", ensure_base=False)
    await svc.start()
    try:
        yield svc
    finally:
        await svc.shutdown()


@pytest.fixture(scope="module")
def registry():
    reg = R.LocalRegistry().start()
    yield reg
    reg.close()


def _opts(stack: Stack, logs: list[str] | None = None, **kw: Any) -> dict[str, Any]:
    return {"nats_url": stack.url, "pool": stack.pool, "on_log": (logs.append if logs is not None else None), **kw}


def _build_sandboxes(stack: Stack) -> list[str]:
    return sorted(sid for sid, ls in stack.host.live.items() if ls.spec.metadata.get("dsec.build"))


async def _manifest(stack: Stack, name: str) -> Any:
    kv = await ensure_kv(stack.js, S.KV_IMAGES)
    try:
        entry = await kv.get(name)
    except Exception:  # noqa: BLE001 - KeyNotFoundError: not there
        return None
    return codec.TEMPLATE.decode(entry.value) if entry.value else None


DOCKERFILE = """\
# a comment
ARG GREETING=hello
FROM base
ARG GREETING
ENV APP_HOME=/srv/app \\
    MODE="fast mode"
WORKDIR $APP_HOME
COPY app/ ./
COPY --chmod=0755 run.sh /usr/local/bin/run.sh
RUN echo "$GREETING from $MODE" > greeting.txt && mkdir -p /var/lib/thing && echo 1 > /var/lib/thing/v
RUN rm /etc/hostname
LABEL ignored=yes
CMD ["/usr/local/bin/run.sh"]
RUN echo {last} > last.txt
"""


def _context(tmp: Path) -> Path:
    ctx = tmp / "ctx"
    (ctx / "app" / "pkg").mkdir(parents=True, exist_ok=True)
    (ctx / "app" / "main.txt").write_text("main\n")
    (ctx / "app" / "pkg" / "mod.txt").write_text("mod\n")
    os.symlink("main.txt", ctx / "app" / "link")
    (ctx / "run.sh").write_text("#!/bin/sh\necho running\n")
    return ctx


async def test_dockerfile_build_then_cached_rebuild(stack: Stack, imaged: Any, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(last="one"))
    name = f"df-{stack.uid}"
    logs: list[str] = []
    rep = await build_dockerfile(name, ctx / "Dockerfile", build_args={"GREETING": "hi"}, **_opts(stack, logs))
    assert rep.sandboxes == 1 and not any(s.cached for s in rep.steps)
    assert any("[1/" in line and "FROM base" in line for line in logs)
    assert _build_sandboxes(stack) == []
    m = await _manifest(stack, name)
    assert m is not None and m == rep.manifest
    d = m.defaults
    assert d.env == {"APP_HOME": "/srv/app", "MODE": "fast mode"} and d.workdir == "/srv/app" and d.cmd == ["/usr/local/bin/run.sh"]
    async with stack.sandbox(template=name) as sb:
        r = await sb.commands.run(
            "cat /srv/app/greeting.txt /srv/app/main.txt /srv/app/pkg/mod.txt /var/lib/thing/v /srv/app/last.txt;"
            " readlink /srv/app/link; stat -c %a /usr/local/bin/run.sh; /usr/local/bin/run.sh; test -e /etc/hostname || echo nohost"
        )
        assert r.stdout.split("\n")[:-1] == ["hi from fast mode", "main", "mod", "1", "one", "main.txt", "755", "running", "nohost"]
        # the image's ENV and WORKDIR apply to a command that names neither; what the command names wins
        r = await sb.commands.run('pwd; echo "$APP_HOME|$MODE"')
        assert r.stdout.split("\n")[:-1] == ["/srv/app", "/srv/app|fast mode"]
        r = await sb.commands.run('pwd; echo "$MODE"', cwd="/tmp", envs={"MODE": "slow"})
        assert r.stdout.split("\n")[:-1] == ["/tmp", "slow"]

    # the same Dockerfile again: every step from the cache, no build sandbox at all
    rep2 = await build_dockerfile(name, ctx / "Dockerfile", build_args={"GREETING": "hi"}, **_opts(stack))
    assert rep2.sandboxes == 0 and all(s.cached for s in rep2.steps if s.snapshot)
    assert [lay.digest for lay in rep2.manifest.layers] == [lay.digest for lay in m.layers]
    # the last step changed: only it runs again (one sandbox, from the cached prefix)
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(last="two"))
    rep3 = await build_dockerfile(name, ctx / "Dockerfile", build_args={"GREETING": "hi"}, **_opts(stack))
    fs_steps = [s for s in rep3.steps if s.snapshot]
    assert rep3.sandboxes == 1 and all(s.cached for s in fs_steps[:-1]) and not fs_steps[-1].cached
    assert [lay.digest for lay in rep3.manifest.layers][:-1] == [lay.digest for lay in m.layers][:-1]
    # a different build arg changes the RUN that uses it (and what follows), not the COPYs before it
    rep4 = await build_dockerfile(f"{name}-b", ctx / "Dockerfile", build_args={"GREETING": "yo"}, **_opts(stack))
    assert [s.cached for s in rep4.steps if s.snapshot] == [True, True, True, False, False, False]
    # a changed file in the context invalidates its COPY
    (ctx / "app" / "main.txt").write_text("main v2\n")
    rep5 = await build_dockerfile(f"{name}-c", ctx / "Dockerfile", build_args={"GREETING": "hi"}, **_opts(stack))
    assert [s.cached for s in rep5.steps if s.snapshot][:3] == [True, False, False]
    async with stack.sandbox(template=f"{name}-c") as sb:
        assert (await sb.files.read("/srv/app/main.txt")) == "main v2\n"
    assert _build_sandboxes(stack) == []


async def test_failing_run_fails_the_build_and_leaves_nothing(stack: Stack, imaged: Any, tmp_path: Path) -> None:
    name = f"dffail-{stack.uid}"
    df = tmp_path / "Dockerfile"
    df.write_text("FROM base\nRUN echo preparing\nRUN echo out-line; echo err-line >&2; exit 7\nRUN echo never\n")
    logs: list[str] = []
    with pytest.raises(BuildFailed) as ei:
        await build_dockerfile(name, df, **_opts(stack, logs))
    e = ei.value
    assert e.code == "build_failed" and e.context["exit_code"] == 7 and e.context["step"] == 3
    assert "exit 7" in e.context["instruction"] and "out-line" in e.context["output"] and "err-line" in e.context["output"]
    assert await _manifest(stack, name) is None
    assert _build_sandboxes(stack) == []
    assert "  never" not in logs and any("out-line" in line for line in logs)
    # positive control: the same build without the failing step makes the template
    df.write_text("FROM base\nRUN echo preparing\nRUN echo fine\n")
    rep = await build_dockerfile(name, df, **_opts(stack))
    assert rep.steps[1].cached  # the step that succeeded before is in the cache
    assert await _manifest(stack, name) is not None


async def test_bad_dockerfiles_and_contexts_are_refused(stack: Stack, imaged: Any, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    (tmp_path / "secret").write_text("outside\n")
    os.symlink(str(tmp_path / "secret"), ctx / "escape")
    (ctx / "inner").mkdir()
    os.symlink("../../secret", ctx / "inner" / "up")
    name = f"dfbad-{stack.uid}"
    cases = {
        "FROM base\nCOPY ../secret /x\n": "climbs out",
        "FROM base\nCOPY escape /x\n": "outside the build context",
        "FROM base\nCOPY inner /x\n": "outside the build context",
        "FROM base\nCOPY nothere /x\n": "not in the build context",
        "FROM base\nFROBNICATE x\n": "unknown instruction",
        "FROM base\nFROM base\n": "multi-stage",
        "RUN echo\n": "before FROM",
        "FROM template:no-such-template-x\n": "no such template",
    }
    for text, why in cases.items():
        (ctx / "Dockerfile").write_text(text)
        with pytest.raises(InvalidArgument) as ei:
            await build_dockerfile(name, ctx / "Dockerfile", **_opts(stack))
        assert why in ei.value.description, (text, ei.value.description)
    assert await _manifest(stack, name) is None and _build_sandboxes(stack) == []
    # positive control: a COPY inside the context
    (ctx / "Dockerfile").write_text("FROM base\nCOPY app/main.txt /x\n")
    await build_dockerfile(name, ctx / "Dockerfile", **_opts(stack))
    assert await _manifest(stack, name) is not None


async def test_from_a_registry_image_and_from_a_snapshot(stack: Stack, imaged: Any, registry: Any, tmp_path: Path) -> None:
    layout = R.oci_layout(tmp_path / "img", [R.busybox_layer(), R.tar_layer({"opt": ("dir",), "opt/from-image.txt": b"image\n"})],
                          {"Env": ["PATH=/bin", "IMG=yes"], "WorkingDir": "/opt"})
    digest = registry.push(layout, "test/app", "v1")
    df = tmp_path / "Dockerfile"
    df.write_text(f"FROM {registry.host}/test/app:v1\nRUN echo built-on-image > /opt/b.txt && echo $IMG >> /opt/b.txt\n")
    name = f"dfimg-{stack.uid}"
    rep = await build_dockerfile(name, df, **_opts(stack))
    assert rep.manifest.defaults.env == {"PATH": "/bin", "IMG": "yes"} and rep.manifest.defaults.workdir == "/opt"
    async with stack.sandbox(template=name) as sb:
        r = await sb.commands.run("cat /opt/from-image.txt /opt/b.txt")
        assert r.stdout == "image\nbuilt-on-image\nyes\n"
        snap = await sb.create_snapshot("from-here")
    # the SDK's own call for a pull (BuildImage(from_ref=...) to imaged): the same layers as the FROM's base
    from sdk import build_from_image

    pulled = await build_from_image(f"{name}-pull", f"{registry.host}/test/app@{digest}", nats_url=stack.url)
    assert [lay.digest for lay in pulled.layers] == [lay.digest for lay in rep.manifest.layers][:2]
    assert pulled.defaults is not None and pulled.defaults.source == f"{registry.host}/test/app@{digest}"
    df.write_text(f"FROM {registry.host}/test/app@{digest}\nRUN echo built-on-image > /opt/b.txt && echo $IMG >> /opt/b.txt\n")
    rep_d = await build_dockerfile(f"{name}-d", df, **_opts(stack))
    assert [lay.digest for lay in rep_d.manifest.layers][:2] == [lay.digest for lay in rep.manifest.layers][:2]
    # FROM a snapshot: its files are the start
    df.write_text(f"FROM snapshot:{snap.snapshot_id}\nRUN cat /opt/b.txt > /opt/c.txt\n")
    rep2 = await build_dockerfile(f"{name}-s", df, **_opts(stack))
    async with stack.sandbox(template=f"{name}-s") as sb:
        assert (await sb.files.read("/opt/c.txt")) == "built-on-image\nyes\n"
    assert len(rep2.manifest.layers) > len(rep.manifest.layers)
    # an image that is not there: typed, nothing made
    df.write_text(f"FROM {registry.host}/test/absent:v1\nRUN true\n")
    from bus.errors import ImageNotFound

    with pytest.raises(ImageNotFound):
        await build_dockerfile(f"{name}-x", df, **_opts(stack))
    assert await _manifest(stack, f"{name}-x") is None and _build_sandboxes(stack) == []


def test_parse_dockerfile_forms() -> None:
    steps = parse_dockerfile(
        'ARG V=1\nFROM --platform=linux/amd64 img:${V} AS b\nENV A=x B="y z"\nENV C legacy value\nRUN ["echo", "$A"]\n'
        "RUN echo a \\\n  && echo b\nCOPY --chown=1:1 a b /d/\nWORKDIR ${A:-none}/w\nUSER ${NOPE:-nobody}\nEXPOSE 80\n"
    )
    assert [s.kind for s in steps] == ["ARG", "FROM", "ENV", "ENV", "RUN", "RUN", "COPY", "WORKDIR", "USER"]
    assert steps[1].args == ["img:1"] and steps[1].flags == {"platform": "linux/amd64"}
    assert steps[2].args == ["A", "x", "B", "y z"] and steps[3].args == ["C", "legacy value"]
    assert steps[4].exec_form and steps[4].args == ["echo", "$A"]  # no expansion in RUN: the shell does it
    assert steps[5].args == ["echo a && echo b"]
    assert steps[6].flags == {"chown": "1:1"} and steps[6].args == ["a", "b", "/d/"]
    assert steps[7].args == ["x/w"] and steps[8].args == ["nobody"]
    for bad in ("FROM a\nONBUILD RUN x\n", "FROM a\nCOPY --from=x a b\n", "FROM a\nSHELL /bin/bash\n", "ENV A=1\n", ""):
        with pytest.raises(InvalidArgument):
            parse_dockerfile(bad)


async def test_builder_needs_a_good_name(stack: Stack) -> None:
    with pytest.raises(InvalidArgument):
        await TemplateBuilder(nats_url=stack.url).build("bad name!", parse_dockerfile("FROM base\n"))


# --------------------------------------------------------------------------- E2B's template API, unmodified SDK

E2B_DOCKERFILE = """\
FROM {image}
ENV GREETING=dockerfile
WORKDIR /opt/df
COPY app/ ./app/
RUN echo "$GREETING built" > /opt/df/built.txt
"""


def _e2b_flow(gw: Gw, image: str, ctx: Path, uid: str) -> None:
    from e2b import BuildException, Sandbox, Template

    name = f"e2b-{uid}"
    assert not Template.exists(name, **gw.sdk()) and not Template.alias_exists(name, **gw.sdk())
    t = (
        Template(file_context_path=str(ctx))
        .from_image(image)
        .set_envs({"E2B_X": "from-env"})
        .copy("app", "/opt/app/")
        .copy("tool.sh", "/usr/local/bin/tool.sh", mode=0o755)
        .set_workdir("/opt/app")
        .run_cmd(["echo built > /opt/app/built.txt", "echo $E2B_X >> /opt/app/built.txt"])
    )
    logs: list = []
    info = Template.build(t, name, on_build_logs=logs.append, **gw.sdk())
    assert info.template_id == name and info.build_id
    messages = [str(getattr(e, "message", "")) for e in logs]
    assert any("RUN" in m for m in messages) and any("Uploaded 'app'" in m for m in messages), messages
    assert Template.exists(name, **gw.sdk()) and Template.alias_exists(name, **gw.sdk())
    assert Template.get_build_status(info, **gw.sdk()).status.value == "ready"
    sb = Sandbox.create(name, timeout=120, **gw.sdk())
    try:
        r = sb.commands.run("cat /opt/app/built.txt /opt/app/main.txt; /usr/local/bin/tool.sh", user="root")
        assert r.stdout == "built\nfrom-env\nmain\ntool ran\n", r
    finally:
        sb.kill()
    # the same template again: the steps come from the cache (no upload either: the files are present)
    logs.clear()
    Template.build(t, name, on_build_logs=logs.append, **gw.sdk())
    messages = [str(getattr(e, "message", "")) for e in logs]
    assert any("already cached" in m for m in messages) and sum(m == "  cached" for m in messages) >= 3, messages

    # from_dockerfile: the SDK parses it into the same steps
    dname = f"e2bdf-{uid}"
    td = Template(file_context_path=str(ctx)).from_dockerfile(E2B_DOCKERFILE.format(image=image))
    Template.build(td, dname, **gw.sdk())
    sb = Sandbox.create(dname, timeout=120, **gw.sdk())
    try:
        r = sb.commands.run("cat /opt/df/built.txt /opt/df/app/main.txt", user="root")
        assert r.stdout == "dockerfile built\nmain\n", r
    finally:
        sb.kill()

    # a failing step: BuildException naming its exit code and output; no template
    fname = f"e2bfail-{uid}"
    with pytest.raises(BuildException) as ei:
        Template.build(Template().from_template("base").run_cmd("echo boom-output; exit 3"), fname, **gw.sdk())
    assert "exit code 3" in str(ei.value) and "boom-output" in str(ei.value)
    assert not Template.exists(fname, **gw.sdk())

    # the name is alice's: bob can neither build over it nor see it as his; a builtin one is taken too
    with pytest.raises(BuildException) as eb:
        Template.build(Template().from_template("base").run_cmd("true"), name, **gw.sdk(gw.key_b))
    assert "taken" in str(eb.value)
    assert Template.exists(name, **gw.sdk(gw.key_b))  # E2B: another team's alias exists (403)
    with pytest.raises(BuildException):
        Template.build(Template().from_template("base").run_cmd("true"), "base", **gw.sdk())


async def test_e2b_template_api_with_the_unmodified_sdk(gw: Gw, registry: Any, tmp_path: Path) -> None:
    import asyncio
    import uuid

    layout = R.oci_layout(tmp_path / "img", [R.busybox_layer()], {"Env": ["PATH=/usr/local/bin:/bin"]})
    registry.push(layout, "test/e2b", "v1")
    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app" / "main.txt").write_text("main\n")
    (ctx / "tool.sh").write_text("#!/bin/sh\necho tool ran\n")
    uid = uuid.uuid4().hex[:8]
    await asyncio.to_thread(_e2b_flow, gw, f"{registry.host}/test/e2b:v1", ctx, uid)

    # list and delete (the API the SDK's client exposes; raw HTTP here)
    status, body, _ = http(gw, "GET", "/templates")
    assert status == 200 and {t["templateID"] for t in body} >= {f"e2b-{uid}", f"e2bdf-{uid}"}
    assert all(t["templateID"] != "base" for t in body)
    status, body, _ = http(gw, "GET", "/templates", key="b")
    assert status == 200 and body == []
    assert http(gw, "DELETE", f"/templates/e2b-{uid}", key="b")[0] == 403
    assert http(gw, "DELETE", f"/templates/e2b-{uid}")[0] == 204
    assert http(gw, "GET", f"/templates/aliases/e2b-{uid}")[0] == 404
    assert http(gw, "DELETE", f"/templates/e2b-{uid}")[0] == 404
    # an upload link is one use, and only a link the gateway gave out works
    assert http(gw, "PUT", "/templates/uploads/not-a-token", body=b"x", key=None)[0] == 403


async def test_cli_dockerfile_build_against_dsec_up(gw: Gw, tmp_path: Path) -> None:
    import uuid

    from .conftest import run_process, subprocess_env

    from bus.auth import OPERATOR_ROLE, AuthConfig

    operator = AuthConfig.load_or_create(gw.data / "auth.json").url_for(OPERATOR_ROLE, gw.nats_url)  # nothing connects without credentials
    env = subprocess_env(operator, DSEC_CONTEXT=str(gw.data.parent / f"{gw.data.name}.context.json"))
    (tmp_path / "a.txt").write_text("from the context\n")
    df = tmp_path / "Dockerfile"
    name = f"cli-{uuid.uuid4().hex[:8]}"
    df.write_text("FROM base\nCOPY a.txt /opt/a.txt\nRUN cat /opt/a.txt > /opt/b.txt\n")
    rc, out, err = await run_process(*_gateway.DSEC, "image", "build", name, "--dockerfile", str(df), "--json", env=env, timeout=300)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["name"] == name and [s["cached"] for s in rep["steps"]] == [False, False, False] and rep["sandboxes"] == 1
    rc, out, err = await run_process(*_gateway.DSEC, "image", "build", name, "--dockerfile", str(df), env=env, timeout=300)
    assert rc == 0 and "(2 cached)" in out, (out, err)
    assert "[1/3] FROM base" in err and "cached" in err  # the build log, streamed to stderr
    df.write_text("FROM base\nRUN echo no; exit 4\n")
    rc, out, err = await run_process(*_gateway.DSEC, "image", "build", f"{name}-x", "--dockerfile", str(df), env=env, timeout=300)
    assert rc == 1 and "[build_failed]" in err and "exit code 4" in err
    df.write_text("FROM base\nCOPY ../../etc/passwd /x\n")
    rc, out, err = await run_process(*_gateway.DSEC, "image", "build", f"{name}-x", "--dockerfile", str(df), env=env, timeout=300)
    assert rc == 1 and "[invalid_argument]" in err and "climbs out" in err
    rc, out, _ = await run_process(*_gateway.DSEC, "image", "ls", "--json", env=env)
    names = {t["name"] for t in json.loads(out)}
    assert name in names and f"{name}-x" not in names


async def test_e2b_upload_that_climbs_out_fails_the_build(gw: Gw, tmp_path: Path) -> None:
    """Uploaded COPY sources are unpacked inside the build context: a member naming ../.. fails the build
    (invalid_argument in its status) and writes nothing outside; the upload link is one use."""
    import io
    import tarfile
    import uuid

    from tests.conftest import eventually

    uid = uuid.uuid4().hex[:8]
    escape = Path(f"/tmp/dsec-evil-{uid}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for name in ("ok.txt", f"../../../../../..{escape}"):
            ti = tarfile.TarInfo(name)
            ti.size = 3
            tf.addfile(ti, io.BytesIO(b"bad"))
    status, body, _ = http(gw, "POST", "/v3/templates", json.dumps({"name": f"evil-{uid}"}).encode(), {"Content-Type": "application/json"})
    assert status == 202, body
    tid, bid = body["templateID"], body["buildID"]
    files_hash = "f" * 64
    status, link, _ = http(gw, "GET", f"/templates/{tid}/files/{files_hash}")
    assert status == 201 and link["present"] is False
    path = link["url"].split(gw.url, 1)[1]
    assert http(gw, "PUT", path, buf.getvalue(), key=None)[0] == 200
    assert http(gw, "PUT", path, buf.getvalue(), key=None)[0] == 403  # one use
    steps = {"fromTemplate": "base", "steps": [{"type": "COPY", "args": ["ok.txt", "/ok.txt", "", ""], "filesHash": files_hash, "force": False}]}
    status, body, _ = http(gw, "POST", f"/v2/templates/{tid}/builds/{bid}", json.dumps(steps).encode(), {"Content-Type": "application/json"})
    assert status == 202, body
    # another key sees no such build
    assert http(gw, "GET", f"/templates/{tid}/builds/{bid}/status", key="b")[0] == 404

    def finished() -> bool:
        return http(gw, "GET", f"/templates/{tid}/builds/{bid}/status")[1]["status"] in ("ready", "error")

    await eventually(finished, timeout=60, what="the build to finish")
    st = http(gw, "GET", f"/templates/{tid}/builds/{bid}/status")[1]
    assert st["status"] == "error" and "climbs out" in st["reason"]["message"], st
    assert not escape.exists()
    assert http(gw, "GET", f"/templates/aliases/{tid}")[0] == 404


async def test_template_files_are_bounded_per_tenant(gw: Gw) -> None:
    """COPY sources a client uploads for its builds are kept up to the gateway's per-tenant limit (8 MiB
    on this stack): one that would pass it is refused, typed, before it is written; under it (and for
    another client) uploads go on."""
    import uuid

    MiB = 1 << 20
    uid = uuid.uuid4().hex[:8]

    def link(key: str, tid: str, files_hash: str) -> tuple[str, bool]:
        status, doc, _ = http(gw, "GET", f"/templates/{tid}/files/{files_hash}", key=key)
        assert status == 201, doc
        return doc["url"].split(gw.url, 1)[1], doc["present"]

    def build_of(key: str) -> str:
        status, body, _ = http(gw, "POST", "/v3/templates", json.dumps({"name": f"quota-{key}-{uid}"}).encode(),
                               {"Content-Type": "application/json"}, key=key)
        assert status == 202, body
        return str(body["templateID"])

    tid = build_of("a")
    h1, h2, h3 = (f"{c}{uid}".ljust(64, c) for c in "123")
    assert http(gw, "PUT", link("a", tid, h1)[0], os.urandom(5 * MiB), key=None)[0] == 200  # 5 of 8 MiB
    status, body, _ = http(gw, "PUT", link("a", tid, h2)[0], os.urandom(4 * MiB), key=None)
    assert status == 429, body
    assert "template_files_bytes_per_tenant" in json.dumps(body) or "per-tenant limit of 8388608 bytes" in json.dumps(body), body
    assert link("a", tid, h2)[1] is False  # nothing kept
    assert http(gw, "PUT", link("a", tid, h3)[0], os.urandom(2 * MiB), key=None)[0] == 200  # just under: 7 of 8
    assert link("a", tid, h1)[1] and link("a", tid, h3)[1]
    # another client's sources are its own
    other = build_of("b")
    assert http(gw, "PUT", link("b", other, h2)[0], os.urandom(4 * MiB), key=None)[0] == 200
