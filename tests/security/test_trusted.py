"""Red team: grader runs (``commands.run(cmd, trusted=True)``) that a cheating agent cannot hijack.

The agent is root in its sandbox and writes wherever the sandbox lets it: its home (``/root``),
``/tmp``, the workspace. Each vector below is planted the way such an agent would (files written
through the files API, exports in its login profile, variables the sandbox was created with),
then the SAME command runs twice: ordinarily, where the vector must fire (the positive control:
the plant is real and reaches the command), and trusted, where it must not. Afterwards the
sandbox's files are exactly as the agent left them.

Vectors that need writing into system directories (``/etc/ld.so.preload``, ``/etc/profile``,
Python's ``sitecustomize`` in ``/usr/local/lib/python3*/dist-packages``) cannot be planted under
the default profile (read-only mounts: EROFS, asserted). Under an operator's profile that leaves
``/etc`` writable they fire in ordinary runs, and a trusted run is refused (``not_supported``):
the in-sandbox agent has no way to mount over them, and no environment makes a run trustworthy
when the loader's and the interpreters' own configuration is the agent's to write.

The template: the busybox ``base`` has no dynamic loader, bash, python or git, so the tests build
one from it plus the host's own ``/bin/bash``, ``/usr/bin/python3.11`` (and its standard library),
``/usr/bin/git``, their shared libraries and the loader, and a preload library built with gcc.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.conftest import cannot_run, needs
from tests.security.conftest import SKIP_REASON, until

pytestmark = needs(SKIP_REASON)

TEMPLATE = "trustedpy"
PYVER = "python3.11"
HOST_BINARIES = ("/bin/bash", f"/usr/bin/{PYVER}", "/usr/bin/git")
USER_SITE = f"/root/.local/lib/{PYVER}/site-packages"
PRELOAD_SRC = r"""
#include <unistd.h>
__attribute__((constructor)) static void hijack(void) { write(1, MARK "\n", sizeof MARK); }
"""
SNAPSHOT = (  # every file, dir and link the agent could have touched, with content hashes
    "find /workspace /root /tmp -xdev ! -path '/tmp/.dsec-trusted-*' | sort | while read -r p; do "
    "if [ -f \"$p\" ] && [ ! -L \"$p\" ]; then echo \"$p $(stat -c '%a %s %Y' \"$p\") $(md5sum < \"$p\")\"; "
    "else echo \"$p $(stat -c '%F %a %Y' \"$p\")\"; fi; done"
)


# ------------------------------------------------------------------------------------ the template
def _libs(binary: str) -> list[str]:
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    libs = []
    for ln in out.splitlines():
        parts = ln.split()
        if "=>" in parts and parts[parts.index("=>") + 1].startswith("/"):
            libs.append(parts[parts.index("=>") + 1])
        elif parts and parts[0].startswith("/"):
            libs.append(parts[0])
    return libs


def _put(root: Path, host_path: str, at: str | None = None) -> None:
    dest = root / (at or host_path).lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(dest):  # a busybox applet link: copying through it would write the host's busybox
        dest.unlink()
    shutil.copy2(os.path.realpath(host_path), dest)


@pytest.fixture(scope="module")
def glibc_rootfs() -> Iterator[Path]:
    """busybox + the host's bash, python3.11, git and their libraries + ``/opt/pwn.so`` (prints
    HIJACKED-so when loaded); python3 and bash resolve on the default PATH."""
    from imaged._busybox import build_busybox_rootfs

    missing = [b for b in (*HOST_BINARIES, f"/usr/lib/{PYVER}/os.py") if not os.path.exists(b)]
    if missing or not shutil.which("gcc"):
        cannot_run(f"the test template is built from the host's binaries: missing {missing or 'gcc'}")
    d = Path(tempfile.mkdtemp(prefix="dsec-trusted-tpl-"))
    root = d / "rootfs"
    try:
        build_busybox_rootfs(str(root))
        for b in HOST_BINARIES:
            _put(root, b)
            for lib in _libs(b):
                # the loader where the binaries' interpreter path names it, libraries in the multiarch dir
                _put(root, lib, lib if lib.startswith("/lib64/") else "/usr/lib/x86_64-linux-gnu/" + os.path.basename(lib))
        (root / "usr/bin/python3").symlink_to(PYVER)
        skip = shutil.ignore_patterns("test", "tests", "idlelib", "tkinter", "turtledemo", "ensurepip", "lib2to3", "config-3*", "dist-packages")
        shutil.copytree(f"/usr/lib/{PYVER}", root / f"usr/lib/{PYVER}", symlinks=True, ignore=skip)
        (root / f"usr/local/lib/{PYVER}/dist-packages").mkdir(parents=True)
        for mark, name in (("HIJACKED-so", "pwn.so"),):
            src = d / "pwn.c"
            src.write_text(PRELOAD_SRC)
            (root / "opt").mkdir(exist_ok=True)
            r = subprocess.run(["gcc", "-shared", "-fPIC", "-O1", f'-DMARK="{mark}"', "-o", str(root / "opt" / name), str(src)],
                               capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
        yield root
    finally:
        shutil.rmtree(d, ignore_errors=True)


async def _register(st: Any, rootfs: Path) -> None:
    from bus import codec
    from bus import subjects as S
    from bus.messages import LayerRef, TemplateManifest
    from bus.streams import ensure_kv

    kv = await ensure_kv(st.nc.jetstream(), S.KV_IMAGES)
    digest = "sha256:" + hashlib.sha256(str(rootfs).encode()).hexdigest()
    await kv.put(TEMPLATE, codec.encode(TemplateManifest(
        name=TEMPLATE, created_at=time.time(), description="busybox + host bash/python/git (tests)",
        layers=[LayerRef(role="base", digest=digest, kind="dir", path=str(rootfs))],
    )))


async def _lax_profile(st: Any) -> None:
    """Profile ``lax``: the default one, but /etc writable (an operator's choice we must survive)."""
    from bus import codec
    from bus import subjects as S
    from bus.profiles import default_profile

    full = default_profile()
    lax = msgspec.structs.replace(full, name="lax", fs=msgspec.structs.replace(
        full.fs, readonly_paths=[p for p in full.fs.readonly_paths if p != "/etc"], writable=[*full.fs.writable, "/etc"],
    ))
    kv = await st.nc.jetstream().key_value(S.KV_PROFILES)
    await kv.put("lax", codec.encode(lax))
    await until(lambda: "lax" in st.host.profiles.profiles, timeout=10, what="the host agent to see profile lax")


# ------------------------------------------------------------------------------------------ helpers
async def run(sb: Any, cmd: str, **kw: Any) -> Any:
    from sdk.errors import CommandExitError

    try:
        return await sb.commands.run(cmd, timeout=60, **kw)
    except CommandExitError as exc:
        return exc.result


def fired(res: Any, mark: str) -> bool:
    return mark in res.stdout or mark in res.stderr


async def plant(sb: Any, files: dict[str, str]) -> None:
    for path, text in files.items():
        await sb.files.write(path, text)
    await run(sb, "chmod 755 /root/bin/* /tmp/bin/* 2>/dev/null; true")


# Every vector: files the agent writes, the command a grader runs, the mark a hijack prints.
# The login profile (~/.profile) is shared: each vector adds its export to it.
PROFILE = "\n".join([
    "echo HIJACKED-profile",
    "export PYTHONPATH=/tmp/pp",
    "export PYTHONSTARTUP=/tmp/startup.py",
    "export BASH_ENV=/tmp/bash_env.sh",
    "export ENV=/tmp/sh_env.sh",
    "export LD_PRELOAD=/opt/pwn.so",
    "export PATH=/root/bin:$PATH",
    "",
])
VECTORS: list[tuple[str, dict[str, str], str, str]] = [
    ("usercustomize in the user site-packages", {f"{USER_SITE}/usercustomize.py": "print('HIJACKED-usercustomize')\n"},
     "python3 -c 'print(1)'", "HIJACKED-usercustomize"),
    (".pth file in the user site-packages", {f"{USER_SITE}/zz.pth": "import sys; print('HIJACKED-pth')\n"},
     "python3 -c 'print(1)'", "HIJACKED-pth"),
    ("sitecustomize on PYTHONPATH (exported by the login profile)", {"/tmp/pp/sitecustomize.py": "print('HIJACKED-pythonpath')\n"},
     "bash -l -c \"python3 -c 'print(1)'\"", "HIJACKED-pythonpath"),
    ("PYTHONSTARTUP", {"/tmp/startup.py": "print('HIJACKED-startup')\n"}, "bash -l -c 'python3 -i < /dev/null'", "HIJACKED-startup"),
    ("~/.profile of a login shell", {}, "bash -l -c true", "HIJACKED-profile"),
    ("~/.bashrc of an interactive bash", {"/root/.bashrc": "echo HIJACKED-bashrc\n"}, "bash -i -c true < /dev/null", "HIJACKED-bashrc"),
    ("BASH_ENV", {"/tmp/bash_env.sh": "echo HIJACKED-bash_env\n"}, "bash -l -c 'bash -c true'", "HIJACKED-bash_env"),
    ("ENV of sh", {"/tmp/sh_env.sh": "echo HIJACKED-sh_env\n"}, "bash -l -c 'sh -i -c true < /dev/null'", "HIJACKED-sh_env"),
    ("git global config", {"/root/.gitconfig": "[user]\n\tname = HIJACKED-gitconfig\n"}, "git config user.name", "HIJACKED-gitconfig"),
    ("git XDG config", {"/root/.config/git/config": "[core]\n\teditor = HIJACKED-xdg\n"}, "git config core.editor", "HIJACKED-xdg"),
    ("LD_PRELOAD (exported by the login profile)", {}, "bash -l -c \"python3 -c 'print(1)'\"", "HIJACKED-so"),
    ("a binary planted earlier in PATH", {"/root/bin/git": "#!/bin/sh\necho HIJACKED-path\n"}, "bash -l -c 'git --version'", "HIJACKED-path"),
]
# Variables the sandbox was created with reach every ordinary run: a second sandbox has these.
SANDBOX_ENVS = {"PYTHONPATH": "/tmp/inherited", "PATH": "/tmp/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
INHERITED: list[tuple[str, dict[str, str], str, str]] = [
    ("PYTHONPATH the sandbox was created with", {"/tmp/inherited/sitecustomize.py": "print('HIJACKED-inherited')\n"},
     "/usr/bin/python3 -c 'print(1)'", "HIJACKED-inherited"),
    ("PATH the sandbox was created with (a planted binary in /tmp/bin)", {"/tmp/bin/python3": "#!/bin/sh\necho HIJACKED-sandbox_path\n"},
     "python3 -c 'print(1)'", "HIJACKED-sandbox_path"),
]


# ------------------------------------------------------------------------------------------ tests
async def test_each_vector_fires_in_an_ordinary_run_and_not_in_a_trusted_one(make_stack: Any, glibc_rootfs: Path, redteam: Any) -> None:
    st = await make_stack()
    await _register(st, glibc_rootfs)
    agent = await st.create(template=TEMPLATE, memory_mb=256)
    inherits = await st.create(template=TEMPLATE, memory_mb=256, envs=SANDBOX_ENVS)
    for sb, vectors in ((agent, VECTORS), (inherits, INHERITED)):
        base = await run(sb, "python3 -c 'print(40 + 2)'", trusted=True)
        assert base.exit_code == 0 and base.stdout == "42\n", f"python3 runs in the test template: {base}"
        await plant(sb, {"/root/.profile": PROFILE, **{p: t for _, files, _, _ in vectors for p, t in files.items()},
                         "/workspace/solution.py": "def answer():\n    return 42\n"})
        ordinary = {}
        for what, _files, cmd, mark in vectors:
            ordinary[cmd] = await run(sb, cmd)
            assert fired(ordinary[cmd], mark), f"positive control: {what} must fire in an ordinary run of {cmd!r}: {ordinary[cmd]}"
            redteam.allowed(f"ordinary run: {what} fires")
        # After the ordinary runs (python wrote its __pycache__ for the planted modules): as the agent left it,
        # with every time set far back, so any write, creation or removal shows in a second-resolution mtime.
        await run(sb, "find /workspace /root /tmp -xdev ! -type l -exec touch -t 200101010000 {} +")
        before = (await run(sb, SNAPSHOT)).stdout
        assert " 978307200" in before, before  # the times were set
        assert "/root/.profile" in before and "/workspace/solution.py" in before
        for what, _files, cmd, _mark in vectors:
            trusted = await run(sb, cmd, trusted=True)
            assert not fired(trusted, "HIJACKED"), f"{what}: the trusted run of {cmd!r} was hijacked: {trusted}"
            assert trusted.exit_code == ordinary[cmd].exit_code or cmd.startswith("git config"), (ordinary[cmd], trusted)
            redteam.blocked(f"trusted run: {what}")
        # The grader's own use of the workspace still works, and nothing is written into it.
        graded = await run(sb, "python3 -c 'import solution; print(solution.answer())'", cwd="/workspace", trusted=True)
        assert graded.exit_code == 0 and graded.stdout == "42\n", graded
        after = (await run(sb, SNAPSHOT)).stdout
        assert after == before, "the sandbox's files changed across the trusted runs"
        left = await run(sb, "ls -a /tmp | grep -c '^.dsec-trusted-' || true")
        assert left.stdout.strip() == "0", f"private HOMEs left behind: {left}"


async def test_trusted_environment_home_and_user(make_stack: Any, glibc_rootfs: Path) -> None:
    st = await make_stack()
    await _register(st, glibc_rootfs)
    sb = await st.create(template=TEMPLATE, memory_mb=128, envs={"FROM_SANDBOX": "1"})
    probe = "echo $HOME; stat -c '%a %u' $HOME; ls -A $HOME | wc -l; pwd; env | sort"
    r = await run(sb, probe, trusted=True, envs={"GRADER": "yes", "LANG": "C"})
    home, mode, count, cwd, *env_lines = r.stdout.splitlines()
    env = dict(ln.split("=", 1) for ln in env_lines)
    assert r.exit_code == 0 and home.startswith("/tmp/.dsec-trusted-") and mode == "700 0" and count.strip() == "0" and cwd == home, r
    assert env["HOME"] == home and env["PATH"] == "/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", env  # the existing system dirs
    assert env["PYTHONNOUSERSITE"] == "1" and env["GIT_CONFIG_GLOBAL"] == "/dev/null" and env["GRADER"] == "yes" and env["LANG"] == "C"
    fixed = {"HOME", "USER", "LOGNAME", "PATH", "LANG", "PYTHONNOUSERSITE", "PYTHONDONTWRITEBYTECODE", "GIT_CONFIG_GLOBAL",
             "GIT_CONFIG_NOSYSTEM", "GRADER", "PWD", "SHLVL", "_"}  # the last three: what sh itself sets
    assert set(env) <= fixed, f"variables a trusted run should not have: {set(env) - fixed}"
    ordinary = await run(sb, "echo $FROM_SANDBOX $HOME")
    assert ordinary.stdout == "1 /root\n", ordinary  # positive control: ordinary runs inherit the sandbox's
    second = await run(sb, "echo $HOME", trusted=True)
    assert second.stdout.strip() != home, "each trusted run has a HOME of its own"
    gone = await run(sb, f"test -e {home} && echo there || echo gone")
    assert gone.stdout == "gone\n"
    # As another user: the HOME is theirs, and the run is theirs.
    r = await run(sb, "id -u; stat -c '%a %u' $HOME; touch $HOME/ok && echo writable", trusted=True, user="nobody")
    assert r.stdout.split("\n")[:3] == ["65534", "700 65534", "writable"], r


async def test_system_vectors_cannot_be_planted_under_the_default_profile(make_stack: Any, glibc_rootfs: Path, redteam: Any) -> None:
    st = await make_stack()
    await _register(st, glibc_rootfs)
    sb = await st.create(template=TEMPLATE, memory_mb=128)
    ok = await run(sb, "echo /opt/pwn.so > /tmp/preload && echo written")
    assert ok.stdout == "written\n", ok  # positive control: the agent does write where it may
    redteam.allowed("default profile: writing /tmp")
    for path in ("/etc/ld.so.preload", "/etc/profile", f"/usr/local/lib/{PYVER}/dist-packages/sitecustomize.py", "/usr/bin/python3",
                 "/etc/hosts", "/etc/resolv.conf", "/lib64/ld-linux-x86-64.so.2"):
        r = await run(sb, f"echo x >> {path}")
        assert r.exit_code != 0 and "Read-only file system" in r.stderr, f"{path}: {r}"
        redteam.blocked(f"default profile: planting {path} (EROFS)")


async def test_writable_system_dirs_fire_and_a_trusted_run_is_refused(make_stack: Any, glibc_rootfs: Path, redteam: Any) -> None:
    from bus.errors import NotSupported

    st = await make_stack()
    await _register(st, glibc_rootfs)
    await _lax_profile(st)
    sb = await st.create(template=TEMPLATE, memory_mb=128, profile="lax")
    await plant(sb, {"/etc/ld.so.preload": "/opt/pwn.so\n", "/etc/profile": "echo HIJACKED-etc_profile\n"})
    r = await run(sb, "python3 -c 'print(1)'")
    assert fired(r, "HIJACKED-so"), f"positive control: /etc/ld.so.preload fires in an ordinary run: {r}"
    r = await run(sb, "bash -l -c true")
    assert fired(r, "HIJACKED-etc_profile"), f"positive control: /etc/profile fires in an ordinary run: {r}"
    with pytest.raises(NotSupported, match="/etc is writable") as exc:
        await sb.commands.run("python3 -c 'print(1)'", trusted=True)
    assert exc.value.code == "not_supported"
    redteam.blocked("writable /etc (ld.so.preload, profile): the trusted run is refused, not run hijacked")
    assert (await run(sb, "echo still serving")).stdout == "still serving\n"


async def test_trusted_over_rest_exec(make_stack: Any, glibc_rootfs: Path) -> None:
    from aiohttp import web

    from sdk.gateway import GatewayConfig, make_app

    st = await make_stack()
    await _register(st, glibc_rootfs)
    runner = web.AppRunner(make_app(GatewayConfig(nats_url=st.url)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    def http(method: str, path: str, doc: Any = None) -> tuple[int, Any]:
        req = urllib.request.Request(base + path, data=None if doc is None else json.dumps(doc).encode(), method=method,
                                     headers={"X-API-Key": "dsec_trusted.secret", "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as resp:
                raw, status = resp.read(), resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        return status, json.loads(raw) if raw else None

    sid = ""
    try:
        status, sbd = await asyncio.to_thread(http, "POST", "/v1/sandboxes", {"template": TEMPLATE, "memory_mb": 128})
        assert status == 201, sbd
        sid = sbd["sandbox_id"]
        hijack = f"mkdir -p {USER_SITE} && echo \"print('HIJACKED')\" > {USER_SITE}/usercustomize.py"
        status, w = await asyncio.to_thread(http, "POST", f"/v1/sandboxes/{sid}/exec", {"cmd": hijack})
        assert status == 200 and w["exit_code"] == 0, w
        cmd = {"cmd": "python3 -c 'print(1)'; echo $HOME"}
        status, ordinary = await asyncio.to_thread(http, "POST", f"/v1/sandboxes/{sid}/exec", cmd)
        assert status == 200 and ordinary["stdout"] == "HIJACKED\n1\n/root\n", ordinary
        status, trusted = await asyncio.to_thread(http, "POST", f"/v1/sandboxes/{sid}/exec", {**cmd, "trusted": True})
        assert status == 200 and trusted["stdout"].startswith("1\n/tmp/.dsec-trusted-"), trusted
        status, bad = await asyncio.to_thread(http, "POST", f"/v1/sandboxes/{sid}/exec", {**cmd, "trusted": "yes"})
        assert status == 400 and bad["code"] == "invalid_argument" and "trusted" in bad["message"], bad
    finally:
        if sid:
            await asyncio.to_thread(http, "DELETE", f"/v1/sandboxes/{sid}")
        await runner.cleanup()


async def test_an_agent_without_trusted_runs_never_runs_one_as_ordinary(tmp_path: Path) -> None:
    """An agent of an older protocol (built here from today's source without its 'T' request: the
    older agents in running sandboxes know only 'X') answers EPROTO and starts nothing; today's
    agent refuses with ENOTSUP where the system directories are writable (here: the host's own)."""
    import errno

    from hostagent._agent import AGENT_SOURCE, AgentClient, AgentError

    src = AGENT_SOURCE.read_text()
    line = "    case 'T': op_exec(c, &r, 1); return;\n"
    assert line in src
    marker = tmp_path / "ran"
    for name, text, want in (("old", src.replace(line, ""), errno.EPROTO), ("new", src, errno.ENOTSUP)):
        exe, sock = tmp_path / f"agent-{name}", str(tmp_path / f"{name}.sock")
        r = subprocess.run(["gcc", "-static", "-O1", "-x", "c", "-o", str(exe), "-"], input=text, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        proc = subprocess.Popen([str(exe), "--socket", sock], stdin=subprocess.DEVNULL)
        try:
            client = AgentClient(sock, expected_pid=proc.pid)
            await client.wait_ready(10)
            ok = await client.exec(f"touch {marker}-ordinary")
            assert ok.exit_code == 0 and os.path.exists(f"{marker}-ordinary")  # positive control: it runs commands
            with pytest.raises(AgentError) as exc:
                await client.exec(f"touch {marker}-{name}", trusted=True)
            assert exc.value.errno == want, exc.value
            assert not os.path.exists(f"{marker}-{name}"), f"the {name} agent ran the trusted command"
            if name == "new":
                assert "trusted run refused" in exc.value.message and "is writable" in exc.value.message
            client.close_idle()
        finally:
            proc.terminate()
            proc.wait(10)
