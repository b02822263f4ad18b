"""``sudo`` in an E2B sandbox, through the unmodified e2b SDK against the gateway under ``dsec up``
(the ``gw`` stack of test_gateway): E2B runs commands as ``user`` and agents run ``sudo ...``.

The ``e2b`` profile leaves no_new_privileges off, so ``sudo id -u`` prints 0; root reached that way
is still under the same seccomp filter and capability bounding set, and the agent holds none of the
capability lent to it for its own setup. The ``default`` profile keeps no_new_privileges: the same
command in the same template is refused by sudo's own check of the flag.

The template: busybox, E2B's ``user`` account, and Debian's ``sudo`` package (``apt-get download``,
kept in ``SUDO_CACHE``) with the host's shared libraries it needs (the host is Debian 12 as well)
and a PAM stack of ``pam_permit`` (the image has no ``common-*`` PAM files).
"""

# ruff: noqa: F811 - the parameters named gw are the stack fixture imported from test_gateway
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import pytest

from .conftest import run_process, subprocess_env
from .test_gateway import DSEC, Gw, gw  # noqa: F401 - gw is the module's stack fixture

TEMPLATE = "e2b-sudo"
SUDO_CACHE = Path("/tmp/dsec-e2b-sudo-deb")  # the downloaded .deb, kept across runs (2 MB)
CAP_SYS_ADMIN = 21  # linux/capability.h


def _sudo_deb() -> Path:
    found = sorted(SUDO_CACHE.glob("sudo_*.deb"))
    if found:
        return found[-1]
    SUDO_CACHE.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".fetch-", dir=SUDO_CACHE))
    try:
        subprocess.run(["apt-get", "download", "sudo"], cwd=work, check=True, capture_output=True)
        deb = next(work.glob("sudo_*.deb"))
        os.rename(deb, SUDO_CACHE / deb.name)
        return SUDO_CACHE / deb.name
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _copy_host_file(root: Path, path: str) -> None:
    real = os.path.realpath(path)
    for p in {path, real}:
        dest = root / p.lstrip("/")
        if dest.exists() or dest.is_symlink():
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        if p == real:
            shutil.copy2(real, dest)
        else:
            os.symlink(real, dest)


def add_sudo(root: Path) -> None:
    """Debian's sudo into the rootfs ``root``, with the libraries its binaries and plugins load."""
    subprocess.run(["dpkg-deb", "-x", str(_sudo_deb()), str(root)], check=True, capture_output=True)
    pam_permit = "/lib/x86_64-linux-gnu/security/pam_permit.so"
    elves = [str(p) for p in (root / "usr").rglob("*") if p.is_file() and p.read_bytes()[:4] == b"\x7fELF"]
    for elf in [*elves, pam_permit]:
        out = subprocess.run(["ldd", elf], capture_output=True, text=True).stdout
        for line in out.splitlines():
            parts = line.split()
            lib = parts[2] if len(parts) > 2 and parts[1] == "=>" else parts[0] if parts and parts[0].startswith("/") else ""
            if lib.startswith("/"):
                _copy_host_file(root, lib)
    _copy_host_file(root, pam_permit)
    (root / "etc" / "pam.d" / "sudo").write_text("".join(f"{k} required pam_permit.so\n" for k in ("auth", "account", "session")))


@pytest.fixture(scope="module", autouse=True)
async def sudo_template(gw: Gw, tmp_path_factory: pytest.TempPathFactory) -> None:
    from bus.auth import AuthConfig
    from imaged._busybox import build_busybox_rootfs
    from imaged._debootstrap import ensure_e2b_user

    if not shutil.which("apt-get") or not os.path.exists("/lib/x86_64-linux-gnu/security/pam_permit.so"):
        pytest.fail("needs a Debian x86_64 host (apt-get, libpam-modules): the template takes Debian's sudo")
    root = tmp_path_factory.mktemp("e2b-sudo-rootfs") / "root"
    await asyncio.to_thread(build_busybox_rootfs, str(root))
    await asyncio.to_thread(add_sudo, root)
    ensure_e2b_user(root)  # the account, and (sudo being there) its NOPASSWD rule, as E2B's base image has
    admin = AuthConfig.load_or_create(gw.data / "auth.json").url_for("admin", gw.nats_url)
    rc, out, err = await run_process(*DSEC, "image", "build", TEMPLATE, "--base", str(root), "--data-dir", str(gw.data), "--json",
                                     env=subprocess_env(admin), timeout=600)
    assert rc == 0, (out, err)


def _caps(status: str, field: str) -> int:
    return next(int(ln.split()[1], 16) for ln in status.splitlines() if ln.startswith(field + ":"))


def _profile_caps() -> int:
    from bus.profiles import e2b_profile
    from hostagent._profiles import CAP_NUMBERS, compile_profile

    return sum(1 << CAP_NUMBERS[c] for c in compile_profile(e2b_profile()).capabilities)


def _e2b_sudo(gw: Gw) -> None:
    from e2b import CommandExitException, Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=180, metadata={"dsec.profile": "e2b"}, **gw.sdk())
    try:
        assert sb.commands.run("id -u").stdout.strip() == "1000"  # the SDK's default user
        r = sb.commands.run("sudo id -u")
        assert r.stdout.strip() == "0", (r.stdout, r.stderr)
        assert sb.commands.run("sudo -n sh -c 'echo hi > /etc/motd && cat /etc/motd'").stdout == "hi\n"
        own = sb.commands.run("cat /proc/self/status").stdout
        assert "NoNewPrivs:\t0" in own
        # Root through sudo: the profile's bounding set, its seccomp filter; nothing more.
        root_status = sb.commands.run("sudo cat /proc/self/status").stdout
        assert _caps(root_status, "CapBnd") == _profile_caps() and _caps(root_status, "CapEff") == _profile_caps()
        assert "Seccomp:\t2" in root_status and "Seccomp_filters:\t2" in root_status  # runc's and the agent's (audited) filter
        # The agent (pid 1) gave back the CAP_SYS_ADMIN it was lent to install its filter.
        agent = sb.commands.run("sudo cat /proc/1/status").stdout
        for field in ("CapPrm", "CapEff", "CapInh", "CapBnd", "CapAmb"):
            assert not _caps(agent, field) >> CAP_SYS_ADMIN & 1, (field, agent)
        assert "Seccomp_filters:\t2" in agent
        # Root still cannot make a mount namespace (seccomp: EPERM) or mount.
        with pytest.raises(CommandExitException) as exc:
            sb.commands.run("sudo unshare -m true")
        assert exc.value.exit_code != 0 and "Operation not permitted" in exc.value.stderr, exc.value.stderr
        with pytest.raises(CommandExitException) as exc:
            sb.commands.run("sudo mount -t tmpfs t /mnt")
        assert "mount" in exc.value.stderr and ("permission denied" in exc.value.stderr.lower() or "not permitted" in exc.value.stderr), exc.value.stderr
    finally:
        sb.kill()


async def test_sudo_works_as_user_in_an_e2b_sandbox(gw: Gw) -> None:
    await asyncio.to_thread(_e2b_sudo, gw)


def _default_blocks_setuid(gw: Gw) -> None:
    from e2b import CommandExitException, Sandbox

    sb = Sandbox.create(TEMPLATE, timeout=180, metadata={"dsec.profile": "default"}, **gw.sdk())
    try:
        assert "NoNewPrivs:\t1" in sb.commands.run("cat /proc/self/status").stdout
        # The setuid bit is there (the control: the same file runs as root in the e2b sandbox) ...
        assert sb.commands.run("stat -c %a /usr/bin/sudo").stdout.strip() == "4755"
        # ... and the kernel does not honour it: sudo sees it still runs as uid 1000 under no_new_privs.
        with pytest.raises(CommandExitException) as exc:
            sb.commands.run("sudo id -u")
        assert exc.value.exit_code == 1
        assert 'The "no new privileges" flag is set, which prevents sudo from running as root.' in exc.value.stderr, exc.value.stderr
        assert "0" not in exc.value.stdout.split()
    finally:
        sb.kill()


async def test_setuid_stays_blocked_in_a_default_sandbox(gw: Gw) -> None:
    await asyncio.to_thread(_default_blocks_setuid, gw)


def test_only_a_profile_without_no_new_privileges_lends_the_agent_sys_admin() -> None:
    from bus.profiles import builtin_profiles
    from hostagent._profiles import compile_profile
    from hostagent.backends.container.containerd import build_spec

    for name, p in builtin_profiles().items():
        enf = compile_profile(p)
        spec = build_spec("sb", args=["/x", *enf.agent_args], env={}, cpu=1, memory_mb=256, pids_max=64, capabilities=enf.capabilities,
                          no_new_privileges=enf.no_new_privileges, setup_capabilities=enf.setup_capabilities)
        caps: dict[str, Any] = spec["process"]["capabilities"]
        args = spec["process"]["args"]
        if name == "e2b":
            # lent for the agent's setup, and named to it to drop (bounding set included) before it serves
            assert spec["process"]["noNewPrivileges"] is False and "--allow-setuid" in args
            assert args[args.index("--setup-cap") + 1] == str(CAP_SYS_ADMIN)
            assert all("CAP_SYS_ADMIN" in caps[s] for s in ("bounding", "permitted", "effective")) and "inheritable" not in caps
        else:
            assert spec["process"]["noNewPrivileges"] is True and "--allow-setuid" not in args and "--setup-cap" not in args, name
            assert not any("CAP_SYS_ADMIN" in caps[s] for s in ("bounding", "permitted", "effective")), name
