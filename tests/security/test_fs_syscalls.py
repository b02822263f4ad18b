"""Red team: filesystem, syscall, capability and resource attacks by root inside real sandboxes.

Every attack runs as root inside a sandbox of the real stack (NATS, placement, host agent with
containerd + runc, the busybox ``base`` template) and asserts one specific block: an errno
(EPERM from seccomp, EACCES from Landlock, EROFS from a read-only mount) or the process killed
(SIGSYS: status 159). Every group also has positive controls: the same tool doing something
allowed works in the sandbox, and where it matters the same binary succeeds on the unconfined
host, so a broken sandbox or a broken tool can't pass as "blocked".

Attack binaries are tiny static C programs (``progs/``) compiled on the host with ``gcc -static``
and copied in through the files API. 32-bit syscalls go through ``int $0x80`` from a 64-bit binary
(no 32-bit toolchain is needed for that, and it is what an attacker would do).

The run ends with the red-team tally (``conftest.RedTeam``): the number of attacks blocked.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import cannot_run, needs
from tests.security.conftest import SKIP_REASON, until

pytestmark = needs(SKIP_REASON)

PROGS = Path(__file__).with_name("progs")
EPERM, EACCES, EXDEV, EROFS, ENOSPC = 1, 13, 18, 30, 28
SIGSYS_STATUS = 128 + 31

# i386 syscall numbers (asm/unistd_32.h): what `int $0x80` dispatches on.
I386 = {
    "getpid": 20, "mount": 21, "umount2": 52, "ptrace": 26, "init_module": 128, "pivot_root": 217,
    "kexec_load": 283, "keyctl": 288, "unshare": 310, "perf_event_open": 336, "setns": 346,
    "bpf": 357, "io_uring_setup": 425,
}
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x20000, 0x10000000, 0x20000000, 0x40000000
O_RDWR_CREAT = 0x42
FIONREAD = 0x541B


# ------------------------------------------------------------------------------------------ helpers
@pytest.fixture(scope="module")
def progs() -> Iterator[dict[str, bytes]]:
    """The attack tools, compiled once per module: name -> static binary."""
    d = tempfile.mkdtemp(prefix="dsec-redteam-")
    out: dict[str, bytes] = {}
    try:
        for src in sorted(PROGS.glob("*.c")):
            exe = os.path.join(d, src.stem)
            r = subprocess.run(["gcc", "-static", "-O1", "-Wall", "-o", exe, str(src)], capture_output=True, text=True)
            assert r.returncode == 0, f"cannot build {src.name}: {r.stderr}"
            out[src.stem] = Path(exe).read_bytes()
        out["_dir"] = d.encode()
        yield out
    finally:
        shutil.rmtree(d, ignore_errors=True)


def host_tool(progs: dict[str, bytes], name: str) -> str:
    return os.path.join(progs["_dir"].decode(), name)


def nr(name: str) -> int:
    from hostagent._profiles import syscall_numbers

    return syscall_numbers()[name]


class Result:
    def __init__(self, code: int, out: str) -> None:
        self.code = code
        self.out = out

    @property
    def errno(self) -> int | None:
        m = re.search(r"errno=(\d+)", self.out)
        return int(m.group(1)) if m else None

    def __repr__(self) -> str:
        return f"Result(code={self.code}, out={self.out!r})"


async def sh(sb: Any, cmd: str, timeout: float = 60) -> Result:
    """Run ``cmd`` in the sandbox; never raises on a non-zero exit."""
    import sdk

    try:
        r = await sb.commands.run(cmd, timeout=timeout)
    except sdk.CommandExitError as e:
        r = e.result
    return Result(r.exit_code, (r.stdout + r.stderr).strip())


async def push(sb: Any, progs: dict[str, bytes], *names: str) -> None:
    for n in names:
        await sb.files.write(f"/tmp/{n}", progs[n], mode=0o755)


async def sysx(sb: Any, *args: Any) -> Result:
    return await sh(sb, "/tmp/sysx " + " ".join(str(a) for a in args))


def host_sysx(progs: dict[str, bytes], *args: Any) -> Result:
    r = subprocess.run([host_tool(progs, "sysx"), *map(str, args)], capture_output=True, text=True, timeout=30)
    return Result(r.returncode, (r.stdout + r.stderr).strip())


def assert_errno(r: Result, *errnos: int, what: str) -> None:
    assert r.code != 0 and r.errno in errnos, f"{what}: expected errno in {errnos}, got {r}"


def cap_bits(status: str, field: str) -> int:
    m = re.search(rf"^{field}:\s*([0-9a-f]+)$", status, re.M)
    assert m, f"{field} missing from /proc/self/status"
    return int(m.group(1), 16)


# ------------------------------------------------------- filesystem (Landlock, read-only mounts)
async def test_system_files_cannot_be_written_replaced_or_removed(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    sb = await stack.create(timeout=300)
    before = await sh(sb, "md5sum /bin/busybox /etc/passwd")
    assert before.code == 0, before

    # Positive controls: root writes, renames and removes freely where work happens.
    for d in ("/tmp", "/workspace", "/root", "/home", "/var/tmp", "/run", "/dev/shm"):
        r = await sh(sb, f"echo data > {d}/f && mv {d}/f {d}/g && cat {d}/g && rm {d}/g && mkdir {d}/sub && rmdir {d}/sub")
        assert r.code == 0 and r.out == "data", (d, r)
        redteam.allowed(f"write/rename/remove under {d}")
    r = await sh(sb, "echo x > /dev/null && head -c 4 /dev/zero | wc -c")
    assert r.code == 0 and r.out.endswith("4"), r
    r = await sh(sb, "id -u && cat /etc/passwd | head -1")
    assert r.out.startswith("0\nroot:"), r

    await push(sb, progs, "sysx")
    await sh(sb, "printf '#!/bin/sh\\necho HIJACKED\\n' > /tmp/evil && chmod +x /tmp/evil")
    # Through the shell, the way an agent would try (busybox itself runs these, so attacks on the
    # busybox binary's contents go through sysx below, where ETXTBSY can't be what stops them).
    # Since the system paths are read-only mounts, the mount refuses most of these before Landlock
    # sees them (EROFS; EXDEV for a link or rename across the mount's edge). Landlock still holds
    # them beneath (and alone guards the rest of the image outside the writable paths: see the last
    # raw calls, and the guard-violation test).
    attacks = {
        "append to /etc/passwd": ("echo 'evil::0:0::/:/bin/sh' >> /etc/passwd", EROFS),
        "sed -i /etc/passwd": ("sed -i s/root/toor/ /etc/passwd", EROFS),
        "unlink /bin/sh": ("rm -f /bin/sh", EROFS),
        "unlink /bin/busybox": ("rm -f /bin/busybox", EROFS),
        "unlink /etc/passwd": ("rm -f /etc/passwd", EROFS),
        "symlink planted in /usr/local/bin": ("ln -s /tmp/evil /usr/local/bin/python3", EROFS),
        "rename over /bin/sh": ("mv -f /tmp/evil /bin/sh", EROFS),
        "hard link /bin/busybox into /tmp": ("ln /bin/busybox /tmp/bb-link", EXDEV),
        "plant /usr/local/bin/python": ("cp /tmp/evil /usr/local/bin/python", EROFS),
        "plant /etc/ld.so.preload": ("touch /etc/ld.so.preload", EROFS),
        "mkdir in /usr": ("mkdir /usr/evil", EROFS),
        "move /bin away": ("mv /bin /tmp/bin", EACCES),
        "rm -rf /usr /etc": ("rm -rf /usr /etc", EROFS),
    }
    message = {EROFS: "Read-only file system", EXDEV: "Invalid cross-device link", EACCES: "Permission denied"}
    blocker = {EROFS: "read-only mount", EXDEV: "read-only mount", EACCES: "landlock"}
    for what, (cmd, err) in attacks.items():
        r = await sh(sb, cmd)
        assert r.code != 0, f"{what} succeeded: {r}"
        assert message[err] in r.out, (what, r)
        redteam.blocked(f"{blocker[err]}: {what}")
    # The same as raw syscalls, each with its errno (EXDEV: the mount's edge, or Landlock refusing
    # a cross-directory link/rename without the REFER right).
    O_WRONLY, O_CREAT, O_TRUNC, O_APPEND = 0o1, 0o100, 0o1000, 0o2000
    raw = {
        "open /bin/busybox for writing": ([nr("openat"), -100, "s:/bin/busybox", O_WRONLY], EROFS),
        "open /bin/busybox O_TRUNC": ([nr("openat"), -100, "s:/bin/busybox", O_WRONLY | O_TRUNC], EROFS),
        "truncate(/bin/busybox)": ([nr("truncate"), "s:/bin/busybox", 0], EROFS),
        "open /etc/passwd O_APPEND": ([nr("openat"), -100, "s:/etc/passwd", O_WRONLY | O_APPEND], EROFS),
        "rename(/tmp/evil, /bin/sh)": ([nr("rename"), "s:/tmp/evil", "s:/bin/sh"], EXDEV),
        "renameat2 RENAME_EXCHANGE /tmp/evil <-> /bin/busybox": (
            [nr("renameat2"), -100, "s:/tmp/evil", -100, "s:/bin/busybox", 2], EXDEV),
        "rename(/bin/sh, /bin/sh.old)": ([nr("rename"), "s:/bin/sh", "s:/bin/sh.old"], EROFS),
        "unlink(/bin/busybox)": ([nr("unlink"), "s:/bin/busybox"], EROFS),
        "link(/bin/busybox, /tmp/bb)": ([nr("link"), "s:/bin/busybox", "s:/tmp/bb"], EXDEV),
        "symlink into /usr/local/bin": ([nr("symlink"), "s:/tmp/evil", "s:/usr/local/bin/python3"], EROFS),
        "mknod regular file in /etc": ([nr("mknodat"), -100, "s:/etc/x", 0o100644, 0], EROFS),
        "rmdir /usr/local/bin": ([nr("rmdir"), "s:/usr/local/bin"], EROFS),
        "rename(/etc, /tmp/etc)": ([nr("rename"), "s:/etc", "s:/tmp/etc"], EACCES),
        # Outside the read-only mounts and the writable paths only Landlock stands.
        "create /evil in the root dir": ([nr("openat"), -100, "s:/evil", O_WRONLY | O_CREAT, 0o755], EACCES),
        "mkdir /var/evil": ([nr("mkdir"), "s:/var/evil", 0o755], EACCES),
        "rename(/var/tmp, /var/tmp.old)": ([nr("rename"), "s:/var/tmp", "s:/var/tmp.old"], EACCES),
    }
    for what, (args, err) in raw.items():
        r = await sh(sb, "exec /tmp/sysx " + " ".join(map(str, args)))
        assert_errno(r, err, what=what)
        redteam.blocked(f"{blocker[err]}: {what}")
    # Nothing changed, and the shell still is the shell.
    after = await sh(sb, "md5sum /bin/busybox /etc/passwd")
    assert after.out == before.out
    r = await sh(sb, "echo still-sh; ls /usr/local/bin /tmp/bb-link /tmp/bb 2>&1; readlink /bin/sh")
    assert r.out.startswith("still-sh") and "python" not in r.out and "bb-link: No such file" in r.out, r
    assert "/tmp/bb: No such file" in r.out and r.out.endswith("busybox"), r
    # The same writes through the files API hit the same wall (the agent itself is confined).
    import sdk

    for path in ("/bin/sh", "/etc/passwd", "/usr/bin/new"):
        with pytest.raises(sdk.DsecError):
            await sb.files.write(path, b"HIJACKED")
        redteam.blocked(f"read-only mount: files API write {path}")
    with pytest.raises(sdk.DsecError):
        await sb.files.remove("/bin/busybox")
    redteam.blocked("read-only mount: files API remove /bin/busybox")
    await sb.files.write("/workspace/ok.txt", b"fine")
    assert await sb.files.read("/workspace/ok.txt") == "fine"
    redteam.allowed("files API write /workspace")


# ------------------------------------------------------------------- system paths: read-only mounts
FS_IOC_SETFLAGS, FS_IOC_FSSETXATTR = 0x40086602, 0x401C5820
FS_NODUMP_FL = 0x40
MS_REMOUNT, MS_BIND, MS_RDONLY, MNT_DETACH = 0x20, 0x1000, 0x1, 2
AT_FDCWD, AT_SYMLINK_NOFOLLOW = -100, 0x100
S_IFIFO = 0o010000
O_WRONLY, O_CREAT, O_TRUNC = 0o1, 0o100, 0o1000
# security.capability, VFS_CAP_REVISION_2: magic, then permitted/inheritable (CAP_NET_BIND_SERVICE)
FILE_CAPS = "hex:" + "00000002" + "00040000" + "00000000" + "00000000" + "00000000"
SYSTEM_MOUNTS = ("/usr", "/bin", "/sbin", "/etc")  # the busybox image's system dirs (no /lib*)


def mount_options(mountinfo: str) -> dict[str, str]:
    """mount point -> its per-mount options (the last mount on a path is the one in effect)."""
    return {f[4]: f[5] for f in (ln.split() for ln in mountinfo.splitlines()) if len(f) > 5}


async def test_system_paths_are_read_only_mounts(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    """Landlock has no rights for metadata, so root could chmod, chown, touch, set xattrs and inode
    flags on /bin/sh. The profile's system paths are read-only mounts too: each of those fails with
    EROFS there, while the very same call works on a workspace or scratch file (run first, so a
    broken tool or sandbox can't pass as blocked)."""
    sb = await stack.create()
    await push(sb, progs, "sysx")
    meta = "stat -c '%n %f %u %g %Y %Z' /bin/busybox /bin/sh /etc /etc/passwd /etc/shadow /usr/bin /sbin; md5sum /bin/busybox"
    before = await sh(sb, meta)
    assert before.code == 0, before
    opts = mount_options((await sh(sb, "cat /proc/self/mountinfo")).out)
    for p in SYSTEM_MOUNTS:
        assert opts.get(p, "").split(",")[0] == "ro", f"{p} is not a read-only mount: {opts}"
    for p in ("/", "/.dsec/run"):
        assert opts[p].split(",")[0] == "rw", (p, opts)
    for p in ("/tmp", "/workspace", "/root", "/home", "/var/tmp"):
        assert p not in opts, f"{p} should stay on the writable root mount: {opts}"
    r = await sh(sb, "echo x > /workspace/ctl && echo x > /tmp/ctl && echo x > /root/ctl && echo x > /workspace/victim && "
                     "printf '#!/bin/sh\\necho HIJACKED\\n' > /tmp/evil && chmod +x /tmp/evil && echo ok")
    assert r.out == "ok", r

    # (what, attack, its errno, the same call on a workspace/scratch path, that call's errno: 0 = works)
    cases: list[tuple[str, list[Any], int, list[Any], int]] = [
        ("chmod u+s /bin/busybox", [nr("chmod"), "s:/bin/busybox", 0o4755], EROFS, [nr("chmod"), "s:/workspace/ctl", 0o4755], 0),
        ("chmod 0666 /etc/shadow", [nr("fchmodat"), AT_FDCWD, "s:/etc/shadow", 0o666], EROFS, [nr("fchmodat"), AT_FDCWD, "s:/tmp/ctl", 0o666], 0),
        ("chmod 0777 /usr/bin (a directory)", [nr("chmod"), "s:/usr/bin", 0o777], EROFS, [nr("chmod"), "s:/root", 0o777], 0),
        ("fchmod through an fd of /bin/busybox", [nr("fchmod"), "cat:/bin/busybox", 0o6777], EROFS, [nr("fchmod"), "cat:/workspace/ctl", 0o6777], 0),
        ("chown /bin/busybox to 1000", [nr("chown"), "s:/bin/busybox", 1000, 1000], EROFS, [nr("chown"), "s:/workspace/ctl", 1000, 1000], 0),
        ("lchown the /bin/sh symlink", [nr("lchown"), "s:/bin/sh", 1000, 1000], EROFS, [nr("lchown"), "s:/tmp/ctl", 1000, 1000], 0),
        ("fchownat /etc/passwd", [nr("fchownat"), AT_FDCWD, "s:/etc/passwd", 1000, 1000, AT_SYMLINK_NOFOLLOW], EROFS,
         [nr("fchownat"), AT_FDCWD, "s:/root/ctl", 1000, 1000, AT_SYMLINK_NOFOLLOW], 0),
        ("setxattr user.* on /bin/busybox", [nr("setxattr"), "s:/bin/busybox", "s:user.evil", "s:x", 1, 0], EROFS,
         [nr("setxattr"), "s:/workspace/ctl", "s:user.evil", "s:x", 1, 0], 0),
        ("setxattr security.capability (file caps) on /bin/busybox",
         [nr("setxattr"), "s:/bin/busybox", "s:security.capability", FILE_CAPS, 20, 0], EROFS,
         [nr("setxattr"), "s:/workspace/ctl", "s:security.capability", FILE_CAPS, 20, 0], 0),
        # trusted.* needs CAP_SYS_ADMIN, so the workspace refuses it too (EPERM); on a system path
        # the mount refuses it first. (trusted.overlay.opaque on /etc would hide the whole image's /etc.)
        ("setxattr trusted.overlay.opaque on /etc", [nr("lsetxattr"), "s:/etc", "s:trusted.overlay.opaque", "s:y", 1, 0], EROFS,
         [nr("lsetxattr"), "s:/workspace", "s:trusted.overlay.opaque", "s:y", 1, 0], EPERM),
        ("removexattr user.* on /bin/busybox", [nr("removexattr"), "s:/bin/busybox", "s:user.evil"], EROFS,
         [nr("removexattr"), "s:/workspace/ctl", "s:user.evil"], 0),
        ("removexattr security.capability on /bin/busybox", [nr("lremovexattr"), "s:/bin/busybox", "s:security.capability"], EROFS,
         [nr("lremovexattr"), "s:/workspace/ctl", "s:security.capability"], 0),
        ("utimensat (now) on /etc/passwd", [nr("utimensat"), AT_FDCWD, "s:/etc/passwd", 0, 0], EROFS,
         [nr("utimensat"), AT_FDCWD, "s:/tmp/ctl", 0, 0], 0),
        ("utimes (back to 1970) on /bin/busybox", [nr("utimes"), "s:/bin/busybox", "buf:32"], EROFS, [nr("utimes"), "s:/workspace/ctl", "buf:32"], 0),
        ("truncate(/bin/busybox)", [nr("truncate"), "s:/bin/busybox", 0], EROFS, [nr("truncate"), "s:/workspace/ctl", 0], 0),
        ("open /etc/passwd O_WRONLY|O_TRUNC", [nr("openat"), AT_FDCWD, "s:/etc/passwd", O_WRONLY | O_TRUNC], EROFS,
         [nr("openat"), AT_FDCWD, "s:/tmp/ctl", O_WRONLY | O_TRUNC], 0),
        ("hard link /bin/busybox out into /workspace", [nr("link"), "s:/bin/busybox", "s:/workspace/bb"], EXDEV,
         [nr("link"), "s:/workspace/ctl", "s:/workspace/ctl-link"], 0),
        ("hard link /tmp/evil into /usr/bin", [nr("link"), "s:/tmp/evil", "s:/usr/bin/evil"], EROFS,
         [nr("link"), "s:/tmp/evil", "s:/tmp/evil-link"], 0),
        ("mknod a fifo in /bin", [nr("mknodat"), AT_FDCWD, "s:/bin/fifo", S_IFIFO | 0o644, 0], EROFS,
         [nr("mknodat"), AT_FDCWD, "s:/workspace/fifo", S_IFIFO | 0o644, 0], 0),
        ("create /usr/bin/python3", [nr("openat"), AT_FDCWD, "s:/usr/bin/python3", O_WRONLY | O_CREAT, 0o755], EROFS,
         [nr("openat"), AT_FDCWD, "s:/workspace/python3", O_WRONLY | O_CREAT, 0o755], 0),
        ("symlink /usr/bin/python3 -> /tmp/evil", [nr("symlink"), "s:/tmp/evil", "s:/usr/bin/python3"], EROFS,
         [nr("symlink"), "s:/tmp/evil", "s:/workspace/py"], 0),
        ("rename /tmp/evil over /bin/sh", [nr("rename"), "s:/tmp/evil", "s:/bin/sh"], EXDEV,
         [nr("rename"), "s:/workspace/python3", "s:/workspace/victim"], 0),
        ("rename /bin/busybox over /bin/sh", [nr("rename"), "s:/bin/busybox", "s:/bin/sh"], EROFS,
         [nr("rename"), "s:/tmp/evil-link", "s:/tmp/ctl-copy"], 0),
        ("renameat2 RENAME_EXCHANGE /bin/sh <-> /bin/busybox", [nr("renameat2"), AT_FDCWD, "s:/bin/sh", AT_FDCWD, "s:/bin/busybox", 2], EROFS,
         [nr("renameat2"), AT_FDCWD, "s:/workspace/py", AT_FDCWD, "s:/workspace/victim", 2], 0),
        ("chattr +d (FS_IOC_SETFLAGS) on /bin/busybox", [nr("ioctl"), "cat:/bin/busybox", FS_IOC_SETFLAGS, f"hex:{FS_NODUMP_FL:02x}000000"], EROFS,
         [nr("ioctl"), "cat:/tmp/ctl", FS_IOC_SETFLAGS, f"hex:{FS_NODUMP_FL:02x}000000"], 0),
        ("FS_IOC_FSSETXATTR on /etc/passwd", [nr("ioctl"), "cat:/etc/passwd", FS_IOC_FSSETXATTR, "buf:28"], EROFS,
         [nr("ioctl"), "cat:/root/ctl", FS_IOC_FSSETXATTR, "buf:28"], 0),
    ]
    for what, attack, err, control, control_err in cases:
        c = await sysx(sb, *control)
        if control_err:
            assert_errno(c, control_err, what=f"{what}: the same call on the workspace")
        else:
            assert c.code == 0, f"positive control for {what!r} failed: {c}"
            redteam.allowed(f"{what}: the same call on a workspace/scratch path")
        r = await sysx(sb, *attack)
        assert_errno(r, err, what=what)
        redteam.blocked(f"read-only mount: {what}")
    # The controls really changed the workspace and scratch files.
    r = await sh(sb, "stat -c '%n %a %u %F' /workspace/ctl /tmp/ctl /root/ctl /workspace/fifo /workspace/ctl-link")
    assert r.code == 0 and r.out.splitlines() == [
        "/workspace/ctl 777 1000 regular empty file", "/tmp/ctl 666 1000 regular empty file",
        "/root/ctl 644 1000 regular file", "/workspace/fifo 644 0 fifo", "/workspace/ctl-link 777 1000 regular empty file",
    ], r

    # Through the shell, the way an agent would try.
    for what, cmd in {
        "chmod -R 777 /usr": "chmod -R 777 /usr",
        "chown root:1000 /etc/shadow": "chown 0:1000 /etc/shadow",
        "touch -d 2000-01-01 /bin/busybox": "touch -d '2000-01-01 00:00' /bin/busybox",
        "touch -c /etc/passwd": "touch -c /etc/passwd",
        "truncate -s 0 /etc/passwd": "truncate -s 0 /etc/passwd",
        "mv /tmp/evil /usr/bin/sh": "mv -f /tmp/evil /usr/bin/sh",
    }.items():
        r = await sh(sb, cmd)
        assert r.code != 0 and "Read-only file system" in r.out, (what, r)
        redteam.blocked(f"read-only mount: {what}")

    # The mounts can't be undone: the whole mount API is refused (and CAP_SYS_ADMIN is gone).
    for what, args in {
        "remount /usr read-write": [nr("mount"), "s:none", "s:/usr", 0, MS_REMOUNT | MS_BIND, 0],
        "remount /etc read-write (no MS_BIND)": [nr("mount"), "s:none", "s:/etc", 0, MS_REMOUNT, 0],
        "umount2 /usr to uncover the writable root": [nr("umount2"), "s:/usr", MNT_DETACH],
        "bind /tmp over /bin": [nr("mount"), "s:/tmp", "s:/bin", 0, MS_BIND, 0],
        "mount_setattr clearing MOUNT_ATTR_RDONLY on /usr": [nr("mount_setattr"), AT_FDCWD, "s:/usr", 0, "hex:" + "00" * 8 + "01" + "00" * 23, 32],
        "open_tree clone of /usr": [nr("open_tree"), AT_FDCWD, "s:/usr", 1],
    }.items():
        r = await sysx(sb, *args)
        assert_errno(r, EPERM, what=what)
        redteam.blocked(f"seccomp: {what}")
    assert (await sysx(sb, nr("getpid"))).code == 0  # the tool itself still works

    after = await sh(sb, meta)
    assert after.out == before.out, (before, after)
    opts = mount_options((await sh(sb, "cat /proc/self/mountinfo")).out)
    assert all(opts[p].split(",")[0] == "ro" for p in SYSTEM_MOUNTS), opts
    # The files API (the agent is confined the same way) can't change them either.
    import sdk

    for path in ("/etc/passwd", "/usr/bin/new", "/bin/sh"):
        with pytest.raises(sdk.DsecError):
            await sb.files.write(path, b"HIJACKED", mode=0o4755)
        redteam.blocked(f"read-only mount: files API write {path}")
    await sb.files.write("/workspace/ok", b"fine", mode=0o4755)
    assert await sb.files.read("/workspace/ok") == "fine"


def _merged_usr_rootfs(base: Path, dest: Path) -> None:
    """The busybox image laid out like a merged-/usr distribution: /bin, /sbin and /lib symlinks
    into /usr, /lib64 a symlink to nothing, no /lib32 or /libx32 at all."""
    shutil.copytree(base, dest, symlinks=True)
    for d in ("bin", "sbin"):
        for name in os.listdir(dest / d):
            os.rename(dest / d / name, dest / "usr" / d / name)
        os.rmdir(dest / d)
        os.symlink(f"usr/{d}", dest / d)
    (dest / "usr" / "lib").mkdir()
    (dest / "usr" / "lib" / "libc.so.6").write_bytes(b"\x7fELF")
    os.symlink("usr/lib", dest / "lib")
    os.symlink("usr/lib64", dest / "lib64")


async def test_merged_usr_image_system_paths_are_read_only(make_stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    """An image whose /bin, /sbin, /lib are symlinks into /usr (and whose /lib64 dangles, /lib32 is
    missing) starts under the same profile, and what the symlinks lead to is read-only too."""
    from bus import codec
    from bus import subjects as S
    from bus.messages import LayerRef, TemplateManifest

    st = await make_stack()
    rootfs = st.data_dir / "rootfs-merged-usr"
    await asyncio.to_thread(_merged_usr_rootfs, st.data_dir / "rootfs", rootfs)
    kv = await st.nc.jetstream().key_value(S.KV_IMAGES)
    await kv.put("merged-usr", codec.encode(TemplateManifest(
        name="merged-usr", created_at=time.time(), description="busybox, merged /usr (tests)",
        layers=[LayerRef(role="base", digest="sha256:" + "1" * 64, kind="dir", path=str(rootfs))],
    )))
    sb = await st.create(template="merged-usr")
    await push(sb, progs, "sysx")
    r = await sh(sb, "for l in /bin /sbin /lib /lib64; do readlink $l; done; ls /lib32 2>&1; echo x > /workspace/f && /bin/busybox echo alive")
    assert r.out.splitlines() == ["usr/bin", "usr/sbin", "usr/lib", "usr/lib64", "ls: /lib32: No such file or directory", "alive"], r
    opts = mount_options((await sh(sb, "cat /proc/self/mountinfo")).out)
    assert opts["/usr"].split(",")[0] == "ro" and opts["/etc"].split(",")[0] == "ro" and opts["/"].split(",")[0] == "rw", opts
    for what, attack, err, control in [
        ("chmod /bin/busybox (really /usr/bin/busybox)", [nr("chmod"), "s:/bin/busybox", 0o4755], EROFS, [nr("chmod"), "s:/workspace/f", 0o4755]),
        ("chown /lib/libc.so.6", [nr("chown"), "s:/lib/libc.so.6", 1000, 1000], EROFS, [nr("chown"), "s:/workspace/f", 1000, 1000]),
        ("setxattr on /sbin/init's target", [nr("setxattr"), "s:/sbin/init", "s:user.evil", "s:x", 1, 0], EROFS,
         [nr("setxattr"), "s:/workspace/f", "s:user.evil", "s:x", 1, 0]),
        ("utimensat /lib/libc.so.6", [nr("utimensat"), AT_FDCWD, "s:/lib/libc.so.6", 0, 0], EROFS, [nr("utimensat"), AT_FDCWD, "s:/workspace/f", 0, 0]),
        ("create /lib64 (the dangling symlink's target)", [nr("openat"), AT_FDCWD, "s:/lib64", O_WRONLY | O_CREAT, 0o755], EROFS,
         [nr("openat"), AT_FDCWD, "s:/workspace/g", O_WRONLY | O_CREAT, 0o755]),
        # The symlinks themselves live in the root dir, where Landlock refuses replacing them.
        ("replace the /bin symlink", [nr("rename"), "s:/tmp/evil", "s:/bin"], EACCES, [nr("rename"), "s:/workspace/g", "s:/workspace/f"]),
        ("unlink the /lib symlink", [nr("unlink"), "s:/lib"], EACCES, [nr("unlink"), "s:/workspace/f"]),
    ]:
        if what == "replace the /bin symlink":
            await sh(sb, "ln -s /tmp/evilbin /tmp/evil")
        c = await sysx(sb, *control)
        assert c.code == 0, f"positive control for {what!r} failed: {c}"
        redteam.allowed(f"merged /usr: {what}: the same call on the workspace")
        r = await sysx(sb, *attack)
        assert_errno(r, err, what=what)
        redteam.blocked(f"{'read-only mount' if err == EROFS else 'landlock'}: merged /usr: {what}")
    r = await sh(sb, "readlink /bin; readlink /lib; stat -c '%a %u' /usr/bin/busybox /usr/lib/libc.so.6")
    assert r.out.splitlines() == ["usr/bin", "usr/lib", "755 0", "644 0"], r


async def test_warm_pool_serves_only_the_profile_it_was_started_with(make_stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    """A pooled container's mounts were fixed when it started: a sandbox claimed from the pool has
    the same read-only mounts as a cold one, and a profile that changed (even under the same name
    and version) never gets a container started for its old content."""
    import msgspec

    from bus import codec
    from bus import subjects as S
    from bus.profiles import default_profile

    st = await make_stack(warm_pool=1)
    backend = st.backend

    def pooled(profile: str) -> list[Any]:
        return [k for k, v in backend.pool.entries().items() if k.profile == profile and v]

    cold = await st.create()
    await until(lambda: pooled("default"), timeout=60, what="a warm container for the default profile")
    warm = await st.create()
    assert st.handle(warm).extra["cid"].startswith("wp-") and st.handle(cold).extra["cid"] == cold.sandbox_id
    ro: dict[str, dict[str, str]] = {}
    for sb in (cold, warm):
        opts = mount_options((await sh(sb, "cat /proc/self/mountinfo")).out)
        ro[sb.sandbox_id] = {p: o.split(",")[0] for p, o in opts.items() if not p.startswith("/.dsec")}
        await push(sb, progs, "sysx")
        await sh(sb, "echo x > /workspace/f")
        c = await sysx(sb, nr("chmod"), "s:/workspace/f", 0o4755)
        assert c.code == 0, c
        assert_errno(await sysx(sb, nr("chmod"), "s:/bin/busybox", 0o4755), EROFS, what="chmod /bin/busybox")
    assert ro[cold.sandbox_id] == ro[warm.sandbox_id] and all(ro[warm.sandbox_id][p] == "ro" for p in SYSTEM_MOUNTS), ro
    redteam.allowed("warm pool: chmod in the workspace")
    redteam.blocked("read-only mount: chmod /bin/busybox in a sandbox claimed from the warm pool")

    # An operator edits profile "edit" in place (same name, same version): first without /etc
    # among its read-only mounts, then with it again.
    kv = await st.nc.jetstream().key_value(S.KV_PROFILES)
    full = msgspec.structs.replace(default_profile(), name="edit", version=7)
    no_etc = msgspec.structs.replace(full, fs=msgspec.structs.replace(full.fs, readonly_paths=[p for p in full.fs.readonly_paths if p != "/etc"]))
    await kv.put("edit", codec.encode(no_etc))
    await until(lambda: "edit" in st.host.profiles.profiles, timeout=10, what="the host agent to see profile edit")
    loose = await st.create(profile="edit")
    await push(loose, progs, "sysx")
    c = await sysx(loose, nr("chmod"), "s:/etc/hostname", 0o600)
    assert c.code == 0, f"without /etc among its read-only mounts the profile leaves /etc's metadata open: {c}"
    await until(lambda: pooled("edit"), timeout=60, what="a warm container for profile edit without /etc")
    stale_key = pooled("edit")[0]
    stale_cids = [w.cid for w in backend.pool.entries()[stale_key]]
    await kv.put("edit", codec.encode(full))
    await until(lambda: "/etc" in st.host.profiles.profiles["edit"].fs.readonly_paths, timeout=10, what="the edited profile")
    tight = await st.create(profile="edit")
    assert st.handle(tight).extra["cid"] not in stale_cids
    await push(tight, progs, "sysx")
    opts = mount_options((await sh(tight, "cat /proc/self/mountinfo")).out)
    assert opts.get("/etc", "").split(",")[0] == "ro", opts
    await sh(tight, "echo x > /tmp/f")
    assert (await sysx(tight, nr("chmod"), "s:/tmp/f", 0o600)).code == 0
    assert_errno(await sysx(tight, nr("chmod"), "s:/etc/hostname", 0o600), EROFS, what="chmod /etc/hostname after the edit")
    redteam.blocked("warm pool: a container started for a profile's old content is not handed out after an edit")

    async def stale_gone() -> bool:
        live = {c.id for c in await backend.rt.list()}
        return stale_key not in backend.pool.entries() and not live & set(stale_cids)

    await until(stale_gone, timeout=30, what="the warm containers of the old content to be removed")


# -------------------------------------------------------------------------------- file ioctls
IOCTLS = {
    "FICLONE": 0x40049409,
    "FICLONERANGE": 0x4020940D,
    "FIDEDUPERANGE": 0xC0189436,
    "XFS_IOC_SWAPEXT": 0xC0C0586D,
    "XFS_IOC_EXCHANGE_RANGE": 0x40285881,
    "EXT4_IOC_MOVE_EXT": 0xC028660F,
}


async def test_extent_swap_and_clone_ioctls_refused(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    from guard import DENY_IOCTLS

    assert {k: DENY_IOCTLS[k] for k in IOCTLS} == IOCTLS, "test and profile disagree on ioctl numbers"
    sb = await stack.create()
    await push(sb, progs, "sysx")
    await sh(sb, "echo target > /workspace/t && echo donor > /tmp/d")
    # Positive control: ioctls in general still work (FIONREAD on a regular file).
    r = await sysx(sb, nr("ioctl"), "cat:/workspace/t", FIONREAD, "buf:8")
    assert r.code == 0, r
    redteam.allowed("ioctl FIONREAD")
    with tempfile.TemporaryDirectory(prefix="dsec-ioctl-") as hd:
        Path(hd, "t").write_text("target")
        Path(hd, "d").write_text("donor")
        for name, cmd in IOCTLS.items():
            # Unconfined, the same call reaches the filesystem (which says "not here", never EPERM).
            h = host_sysx(progs, nr("ioctl"), f"fd:{hd}/t:{O_RDWR_CREAT}", cmd, f"cat:{hd}/d")
            assert h.errno not in (None, EPERM) or h.code == 0, (name, h)
            for high in (0, 1 << 32, 0xFFFFFFFF << 32):  # set high bits must not dodge the filter
                r = await sysx(sb, nr("ioctl"), f"fd:/workspace/t:{O_RDWR_CREAT}", cmd | high, "cat:/tmp/d")
                assert_errno(r, EPERM, what=f"{name} {cmd | high:#x}")
                redteam.blocked(f"seccomp: ioctl {name} (request {cmd | high:#x})")
    assert (await sh(sb, "cat /workspace/t")).out == "target"


# ---------------------------------------------------------------------------------- syscalls
def _native_attacks() -> dict[str, list[Any]]:
    return {
        "mount tmpfs": [nr("mount"), "s:none", "s:/tmp", "s:tmpfs", 0, 0],
        "mount proc": [nr("mount"), "s:proc", "s:/tmp", "s:proc", 0, 0],
        "umount2 /proc": [nr("umount2"), "s:/proc", 2],
        "pivot_root": [nr("pivot_root"), "s:/tmp", "s:/tmp"],
        "fsopen": [nr("fsopen"), "s:tmpfs", 0],
        "fspick": [nr("fspick"), -100, "s:/", 0],
        "open_tree": [nr("open_tree"), -100, "s:/", 1],
        "move_mount": [nr("move_mount"), -100, "s:/tmp", -100, "s:/mnt", 0],
        "mount_setattr": [nr("mount_setattr"), -100, "s:/", 0, "buf:32", 32],
        "unshare(CLONE_NEWUSER)": [nr("unshare"), CLONE_NEWUSER],
        "unshare(CLONE_NEWNS)": [nr("unshare"), CLONE_NEWNS],
        "unshare(NEWUSER|NEWNS)": [nr("unshare"), CLONE_NEWUSER | CLONE_NEWNS],
        "unshare(CLONE_NEWNET)": [nr("unshare"), CLONE_NEWNET],
        "clone(CLONE_NEWUSER)": [nr("clone"), CLONE_NEWUSER | 17, 0, 0, 0, 0],
        "clone(CLONE_NEWPID)": [nr("clone"), CLONE_NEWPID | 17, 0, 0, 0, 0],
        "setns(mnt ns)": [nr("setns"), "cat:/proc/self/ns/mnt", 0],
        "setns(user ns)": [nr("setns"), "cat:/proc/self/ns/user", 0],
        "bpf(PROG_LOAD)": [nr("bpf"), 5, "buf:128", 128],
        "bpf(MAP_CREATE)": [nr("bpf"), 0, "buf:128", 128],
        "perf_event_open": [nr("perf_event_open"), "buf:128", 0, -1, -1, 0],
        "io_uring_setup": [nr("io_uring_setup"), 8, "buf:120"],
        "kexec_load": [nr("kexec_load"), 0, 0, 0, 0],
        "kexec_file_load": [nr("kexec_file_load"), "cat:/bin/busybox", "cat:/bin/busybox", 1, "s:", 0],
        "init_module": [nr("init_module"), "buf:64", 64, "s:"],
        "finit_module": [nr("finit_module"), "cat:/bin/busybox", "s:", 0],
        "delete_module": [nr("delete_module"), "s:ext4", 0],
        "keyctl(GET_KEYRING_ID)": [nr("keyctl"), 0, -3, 1],
        "add_key": [nr("add_key"), "s:user", "s:k", "buf:4", 4, -3],
        "request_key": [nr("request_key"), "s:user", "s:k", 0, -3],
        "userfaultfd": [nr("userfaultfd"), 0],
        "open_by_handle_at": [nr("open_by_handle_at"), "cat:/", "buf:128", 0],
        "name_to_handle_at": [nr("name_to_handle_at"), -100, "s:/etc/passwd", "buf:136", "buf:4", 0],
        "ptrace(PTRACE_ATTACH, 1)": [nr("ptrace"), 16, 1, 0, 0],
        "process_vm_readv(1)": [nr("process_vm_readv"), 1, "buf:16", 1, "buf:16", 1, 0],
        "mknod char device (mem 1:1)": [nr("mknod"), "s:/tmp/mem", 0o20600, 0x0101],
        "mknodat block device (8:0)": [nr("mknodat"), -100, "s:/tmp/sda", 0o60600, 0x0800],
        "syslog(READ_ALL)": [nr("syslog"), 3, "buf:64", 64],
        "reboot": [nr("reboot"), 0xFEE1DEAD, 0x28121969, 0x1234567],
        "swapon": [nr("swapon"), "s:/tmp/swap", 0],
        "settimeofday": [nr("settimeofday"), "buf:16", 0],
        "iopl(3)": [nr("iopl"), 3],
        "acct": [nr("acct"), "s:/tmp/acct"],
    }


async def test_dangerous_syscalls_refused(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    sb = await stack.create()
    await push(sb, progs, "sysx")
    # Positive controls: the tool works, harmless relatives of the refused calls are allowed.
    for what, args in {
        "getpid": [nr("getpid")],
        "unshare(0)": [nr("unshare"), 0],
        "unshare(CLONE_FS)": [nr("unshare"), 0x200],
        "mknod FIFO": [nr("mknod"), "s:/tmp/fifo", 0o10644, 0],
        "mknodat regular file": [nr("mknodat"), -100, "s:/tmp/reg", 0o100644, 0],
        "landlock_create_ruleset(version)": [nr("landlock_create_ruleset"), 0, 0, 1],
    }.items():
        r = await sysx(sb, *args)
        assert r.code == 0, (what, r)
        redteam.allowed(what)
    r = await sh(sb, "ls -l /tmp/fifo | cut -c1")
    assert r.out == "p", r
    # Unconfined on the host, the very same binary gets through for a sample of them (run as a
    # throwaway process; nothing it does outlives it).
    for what, args in {
        "unshare(CLONE_NEWUSER)": [nr("unshare"), CLONE_NEWUSER],
        "io_uring_setup": [nr("io_uring_setup"), 8, "buf:120"],
        "keyctl(GET_KEYRING_ID)": [nr("keyctl"), 0, -3, 1],
        "userfaultfd": [nr("userfaultfd"), 0],
        "name_to_handle_at": [nr("name_to_handle_at"), -100, "s:/etc/passwd", "buf:136", "buf:4", 0],
    }.items():
        h = host_sysx(progs, *args)
        assert h.code == 0 or h.errno not in (None, EPERM), (f"host control {what}", h)
    for what, args in _native_attacks().items():
        r = await sysx(sb, *args)
        assert_errno(r, EPERM, what=what)
        redteam.blocked(f"seccomp: {what}")
    r = await sh(sb, "ls /tmp/mem /tmp/sda 2>&1; grep -c ' /tmp ' /proc/mounts")
    assert "No such file" in r.out and r.out.endswith("0"), r


async def test_32bit_syscall_abi_is_killed(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    """int $0x80 from a 64-bit process: the compat syscall table, where a native-only filter that
    forgot to check the architecture would match the wrong numbers."""
    sb = await stack.create()
    await push(sb, progs, "sysx")
    # Positive controls: on the host the compat ABI works for this binary, inside the native one does.
    h = host_sysx(progs, "-32", I386["getpid"])
    assert h.code == 0, f"host: int $0x80 getpid should work (IA32 emulation): {h}"
    r = await sysx(sb, nr("getpid"))
    assert r.code == 0, r
    redteam.allowed("native getpid")
    attacks = {
        "getpid": [I386["getpid"]],
        "mount": [I386["mount"], "s:none", "s:/tmp", "s:tmpfs", 0, 0],
        "umount2": [I386["umount2"], "s:/proc", 2],
        "unshare(NEWUSER|NEWNS)": [I386["unshare"], CLONE_NEWUSER | CLONE_NEWNS],
        "setns": [I386["setns"], "cat:/proc/self/ns/mnt", 0],
        "bpf": [I386["bpf"], 0, "buf:128", 128],
        "perf_event_open": [I386["perf_event_open"], "buf:128", 0, -1, -1, 0],
        "io_uring_setup": [I386["io_uring_setup"], 8, "buf:120"],
        "kexec_load": [I386["kexec_load"], 0, 0, 0, 0],
        "init_module": [I386["init_module"], "buf:64", 64, "s:"],
        "keyctl": [I386["keyctl"], 0, -3, 1],
        "ptrace": [I386["ptrace"], 0],
        "pivot_root": [I386["pivot_root"], "s:/tmp", "s:/tmp"],
    }
    for what, args in attacks.items():
        r = await sysx(sb, "-32", *args)
        assert r.code == SIGSYS_STATUS, f"i386 {what}: expected the process killed by SIGSYS, got {r}"
        redteam.blocked(f"seccomp arch: i386 {what}")
    # x32 ABI: the x86_64 arch with bit 30 set in the syscall number.
    r = await sysx(sb, 0x40000000 | nr("getpid"))
    assert r.code == SIGSYS_STATUS, f"x32 getpid: {r}"
    redteam.blocked("seccomp arch: x32 getpid")
    r = await sysx(sb, 0x40000000 | nr("mount"), "s:none", "s:/tmp", "s:tmpfs", 0, 0)
    assert r.code == SIGSYS_STATUS, f"x32 mount: {r}"
    redteam.blocked("seccomp arch: x32 mount")
    assert (await sh(sb, "echo alive")).out == "alive"


# ------------------------------------------------------------------------------- /proc and /sys
async def test_proc_sys_sysrq_and_cgroups_not_writable(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    sb = await stack.create(memory_mb=128)
    await push(sb, progs, "sysx")
    # Positive controls: readable.
    r = await sh(sb, "cat /proc/sys/kernel/ostype /sys/fs/cgroup/memory/memory.limit_in_bytes")
    assert r.code == 0 and r.out.split() == ["Linux", str(128 << 20)], r
    redteam.allowed("read /proc/sys and own cgroup")
    r = await sh(sb, "echo 1 > /tmp/w && cat /tmp/w")
    assert r.code == 0 and r.out == "1", r
    redteam.allowed("the same shell redirection writes where writing is allowed")
    ro, eacces = "Read-only file system", "Permission denied"
    blocked = {  # what -> (command, the one error that proves the block)
        # written with the value already there: harmless even if it got through
        "/proc/sys/kernel/core_pattern": ("cat /proc/sys/kernel/core_pattern > /proc/sys/kernel/core_pattern", ro),
        "/proc/sys/vm/overcommit_memory": ("cat /proc/sys/vm/overcommit_memory > /proc/sys/vm/overcommit_memory", ro),
        "/proc/sys/fs/file-max": ("cat /proc/sys/fs/file-max > /proc/sys/fs/file-max", ro),
        "/proc/sys/kernel/modprobe": ("echo /tmp/x > /proc/sys/kernel/modprobe", ro),
        "/proc/self/oom_score_adj (lower)": ("echo -1000 > /proc/self/oom_score_adj", eacces),
        "/proc/1/mem (the agent's memory)": ("echo x > /proc/1/mem", eacces),
        "/proc/1/attr/current": ("echo x > /proc/1/attr/current", eacces),
        "/sys/kernel/mm/transparent_hugepage/enabled": ("echo never > /sys/kernel/mm/transparent_hugepage/enabled", ro),
        # the sandbox's view holds no release_agent (only a hierarchy's root has one; asserted
        # below): creating one is refused by the read-only mount, not missed for lack of a file
        "cgroup release_agent": ("echo /tmp/x > /sys/fs/cgroup/memory/release_agent", ro),
        "cgroup notify_on_release": ("echo 1 > /sys/fs/cgroup/memory/notify_on_release", ro),
        "cgroup memory.limit_in_bytes (raise)": ("echo -1 > /sys/fs/cgroup/memory/memory.limit_in_bytes", ro),
        "cgroup pids.max (raise)": ("echo max > /sys/fs/cgroup/pids/pids.max", ro),
        "cgroup.procs (move)": ("echo $$ > /sys/fs/cgroup/pids/cgroup.procs", ro),
        "mkdir child cgroup": ("mkdir /sys/fs/cgroup/memory/escape", ro),
    }
    if os.path.exists("/proc/sysrq-trigger"):  # not in every kernel (CONFIG_MAGIC_SYSRQ)
        blocked["/proc/sysrq-trigger"] = ("echo h > /proc/sysrq-trigger", ro)  # h: print help, the harmless one; a read-only path
    for what, (cmd, error) in blocked.items():
        target = cmd.rsplit(">", 1)[-1].strip() if ">" in cmd else ""
        if target.startswith(("/proc/sys/", "/sys/kernel/")) and not os.path.exists(target):
            continue  # this kernel lacks the knob: nothing to attack
        r = await sh(sb, cmd)
        assert r.code != 0 and error in r.out, (what, error, r)
        redteam.blocked(f"write {what} [{error}]")
    # release_agent: the host's memory hierarchy has one (the knob an escape wants), the sandbox's
    # cgroup view does not show it, and the file the write above would have created is not there.
    assert os.path.exists("/sys/fs/cgroup/memory/release_agent")
    r = await sh(sb, "ls /sys/fs/cgroup/memory/")
    assert r.code == 0 and "notify_on_release" in r.out.split() and "release_agent" not in r.out.split(), r
    redteam.blocked("cgroup release_agent is not in the sandbox's view of its cgroup")
    # A fresh cgroup (or any) mount for a release_agent escape: refused before it starts.
    await sh(sb, "mkdir -p /tmp/cg")
    r = await sysx(sb, nr("mount"), "s:cgroup", "s:/tmp/cg", "s:cgroup", 0, "s:memory")
    assert_errno(r, EPERM, what="mount cgroup v1")
    redteam.blocked("mount cgroup v1 hierarchy (release_agent escape)")
    r = await sysx(sb, nr("mount"), "s:cgroup2", "s:/tmp/cg", "s:cgroup2", 0, 0)
    assert_errno(r, EPERM, what="mount cgroup2")
    redteam.blocked("mount cgroup2")
    r = await sh(sb, "cat /sys/fs/cgroup/memory/memory.limit_in_bytes; grep -c ' /tmp/cg ' /proc/mounts")
    assert r.out.split() == [str(128 << 20), "0"], r
    # Masked: what the host shows there reads as empty inside.
    from bus.profiles import MASKED_PATHS

    for p in (p for p in MASKED_PATHS if os.path.exists(p)):
        host_has = bool(os.listdir(p)) if os.path.isdir(p) else bool(Path(p).read_bytes()[:1])
        if not host_has:
            continue
        r = await sh(sb, f"if [ -d {p} ]; then ls -A {p} | wc -l; else cat {p} | wc -c; fi")
        assert r.out == "0", (p, r)
        redteam.blocked(f"read {p} (masked)")


async def test_capability_set(stack: Any, redteam: Any) -> None:
    sb = await stack.create()
    r = await sh(sb, "cat /proc/self/status")
    eff, bnd, prm = (cap_bits(r.out, f) for f in ("CapEff", "CapBnd", "CapPrm"))
    assert cap_bits(r.out, "CapAmb") == 0 and cap_bits(r.out, "CapInh") == 0
    dropped = {
        "CAP_DAC_READ_SEARCH": 2, "CAP_LINUX_IMMUTABLE": 9, "CAP_NET_ADMIN": 12, "CAP_NET_RAW": 13,
        "CAP_IPC_LOCK": 14, "CAP_SYS_MODULE": 16, "CAP_SYS_RAWIO": 17, "CAP_SYS_PTRACE": 19,
        "CAP_SYS_PACCT": 20, "CAP_SYS_ADMIN": 21, "CAP_SYS_BOOT": 22, "CAP_SYS_NICE": 23,
        "CAP_SYS_RESOURCE": 24, "CAP_SYS_TIME": 25, "CAP_SYS_TTY_CONFIG": 26, "CAP_MKNOD": 27,
        "CAP_LEASE": 28, "CAP_AUDIT_CONTROL": 30, "CAP_MAC_OVERRIDE": 32, "CAP_MAC_ADMIN": 33,
        "CAP_SYSLOG": 34, "CAP_WAKE_ALARM": 35, "CAP_BLOCK_SUSPEND": 36, "CAP_AUDIT_READ": 37,
        "CAP_PERFMON": 38, "CAP_BPF": 39, "CAP_CHECKPOINT_RESTORE": 40,
    }
    for name, bit in dropped.items():
        assert not (eff >> bit) & 1 and not (bnd >> bit) & 1 and not (prm >> bit) & 1, f"{name} still held"
        redteam.blocked(f"capability {name} dropped (effective, permitted, bounding)")
    for name, bit in {"CAP_CHOWN": 0, "CAP_DAC_OVERRIDE": 1, "CAP_FOWNER": 3, "CAP_KILL": 5, "CAP_SETUID": 7, "CAP_NET_BIND_SERVICE": 10}.items():
        assert (eff >> bit) & 1, f"{name} should be kept"
    assert re.search(r"^NoNewPrivs:\s*1$", r.out, re.M) and re.search(r"^Seccomp:\s*2$", r.out, re.M), r.out
    assert re.search(r"^Seccomp_filters:\s*2$", r.out, re.M), "runtime filter + the agent's audited filter"
    # Functional checks: a kept capability works, a dropped one doesn't.
    r = await sh(sb, "touch /tmp/c && chown 1234:1234 /tmp/c && stat -c %u /tmp/c")
    assert r.out == "1234", r
    redteam.allowed("chown with CAP_CHOWN")
    r = await sh(sb, "chattr +i /tmp/c 2>&1 || echo refused")
    assert "refused" in r.out or "Operation not permitted" in r.out or "not supported" in r.out.lower(), r
    r = await sh(sb, "hostname evil")
    assert r.code != 0, r
    redteam.blocked("sethostname")


# ---------------------------------------------------------------------------------- isolation
async def test_other_sandboxes_and_the_host_are_invisible(stack: Any, redteam: Any) -> None:
    a = await stack.create()
    b = await stack.create()
    await b.commands.run("echo topsecret > /workspace/answers-b.txt && (sleep 31337 > /dev/null 2>&1 &)")
    r = await sh(b, "ps -o args | grep -c '[s]leep 31337'; cat /workspace/answers-b.txt")
    assert r.out.split() == ["1", "topsecret"], r
    redteam.allowed("sandbox sees its own files and processes")
    r = await sh(a, "ps -o pid,args")
    assert "31337" not in r.out and len(r.out.splitlines()) <= 4, r  # header, agent, sh, ps
    redteam.blocked("see another sandbox's processes")
    r = await sh(a, "find / -xdev -name 'answers-*' 2>/dev/null; ls /workspace")
    assert "answers-b" not in r.out, r
    redteam.blocked("see another sandbox's files")
    r = await sh(a, "cat /proc/mounts /proc/self/mountinfo")
    assert b.sandbox_id not in r.out, r
    hs = stack.handle(b)
    r = await sh(a, f"kill -9 {hs.pid} 2>&1; ls /proc/{hs.pid} 2>&1 | head -1")
    assert r.code == 0 and ("No such" in r.out or "can't kill" in r.out or "not found" in r.out.lower()), r
    assert (await sh(b, "echo b-alive")).out == "b-alive"
    redteam.blocked("signal another sandbox's agent by host pid")
    # No host paths: the data dir, the host's root and containerd state are not reachable.
    r = await sh(a, f"ls {stack.data_dir} /run/containerd /var/lib 2>&1; ls /proc/1/root/ | head -50")
    for p in (stack.data_dir, "/run/containerd", "/var/lib"):
        assert f"ls: {p}: No such file or directory" in r.out, (p, r)
    redteam.blocked("reach host paths")


# ---------------------------------------------------------------------------------- floods
async def test_fork_flood_stays_inside(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    pids_max = stack.backend.pids_max
    a = await stack.create()
    b = await stack.create()
    await push(a, progs, "forkflood")
    t0 = time.monotonic()
    r = await sh(a, "/tmp/forkflood", timeout=120)
    m = re.search(r"forks=(\d+) errno=(\d+)", r.out)
    assert m, r
    forks, err = int(m.group(1)), int(m.group(2))
    assert err == 11 and 0 < forks < pids_max, f"the pids limit ({pids_max}) should stop the flood with EAGAIN: {r}"
    redteam.blocked(f"fork flood (stopped at {forks} forks by pids.max={pids_max})")
    # The host and the neighbour were never starved; the attacker's sandbox recovers.
    assert subprocess.run(["true"]).returncode == 0
    assert (await sh(b, "echo neighbour-ok")).out == "neighbour-ok"
    await until(lambda: _pids_current(a.sandbox_id) < 10, timeout=30, what="the flood's processes to be gone")
    assert (await sh(a, "echo recovered")).out == "recovered"
    assert time.monotonic() - t0 < 120


def _pids_current(sid: str) -> int:
    try:
        return int(Path(f"/sys/fs/cgroup/pids/dsec/{sid}/pids.current").read_text())
    except (OSError, ValueError):
        return 0


async def test_memory_flood_is_killed_inside(stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    a = await stack.create(memory_mb=96)
    b = await stack.create()
    await push(a, progs, "memflood")
    with open("/proc/meminfo") as f:
        avail_before = int(next(ln for ln in f if ln.startswith("MemAvailable:")).split()[1]) // 1024
    r = await sh(a, "/tmp/memflood 4096", timeout=120)
    last = [ln for ln in r.out.splitlines() if ln.isdigit()]
    assert r.code == 137, f"the flood should be OOM-killed (SIGKILL) inside its cgroup: {r.code} {r.out[-200:]}"
    assert last and int(last[-1]) <= 96, f"got past the 96 MiB limit: {last[-1:]}"
    redteam.blocked(f"memory flood (OOM-killed at {last[-1]} MiB of 96)")
    oom = Path(f"/sys/fs/cgroup/memory/dsec/{a.sandbox_id}/memory.oom_control").read_text()
    assert int(re.search(r"oom_kill (\d+)", oom).group(1)) >= 1, oom  # the cgroup's own OOM killer did it
    with open("/proc/meminfo") as f:
        avail_after = int(next(ln for ln in f if ln.startswith("MemAvailable:")).split()[1]) // 1024
    assert avail_after > avail_before - 512, (avail_before, avail_after)
    assert (await sh(b, "echo neighbour-ok")).out == "neighbour-ok"
    assert (await sh(a, "echo survived")).out == "survived"  # only the hog died, not the sandbox


async def test_disk_flood_hits_enospc_at_disk_mb(stack: Any, redteam: Any) -> None:
    sb = await stack.create(disk_mb=64)
    r = await sh(sb, "dd if=/dev/zero of=/workspace/fill bs=1M count=512 2>&1; sync; du -m /workspace/fill | cut -f1", timeout=120)
    assert "No space left on device" in r.out, r
    used = int(r.out.split()[-1])
    assert used <= 64 + 4, f"wrote {used} MiB into a 64 MiB disk"  # ~disk_mb usable; du rounds up
    redteam.blocked(f"disk flood (ENOSPC after {used} MiB of disk_mb=64)")
    r = await sh(sb, "dd if=/dev/zero of=/tmp/more bs=1M count=16 2>&1; du -k /tmp/more | cut -f1")
    assert "No space left on device" in r.out and int(r.out.split()[-1]) < 1024, r
    redteam.blocked("disk flood via /tmp (the same quota)")
    r = await sh(sb, "rm /workspace/fill && echo small > /tmp/small && cat /tmp/small")
    assert r.out == "small", r
    redteam.allowed("writes work again after freeing space")
    assert shutil.disk_usage(stack.data_dir).free > 1 << 30


# ---------------------------------------------------------------------------- guard, audit, KV
async def test_denials_are_reported_as_guard_violations(make_stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    from bus import codec
    from bus import subjects as S
    from bus.messages import GuardViolation

    st = await make_stack(guard=True)
    if st.guard.kernel is None:
        cannot_run("kernel audit not readable here")
    got: list[GuardViolation] = []

    async def on(msg: Any) -> None:
        got.append(codec.EVENT.decode(msg.data))

    sub = await st.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on)
    try:
        sb = await st.create()
        await push(sb, progs, "sysx")
        # Positive control: ordinary work is not reported.
        await sb.commands.run("echo fine > /tmp/ok && ls / > /dev/null && cat /etc/passwd > /dev/null")
        await sysx(sb, nr("mount"), "s:none", "s:/tmp", "s:tmpfs", 0, 0)
        await sh(sb, "echo evil > /var/evil")  # Landlock's (no read-only mount there)
        await sh(sb, "echo 'evil::0:0::/:/bin/sh' >> /etc/passwd")  # the read-only mount's
        await sysx(sb, "-32", I386["unshare"], CLONE_NEWUSER)
        await sysx(sb, nr("ioctl"), f"fd:/workspace/t:{O_RDWR_CREAT}", 0x1_C0C0586D, "cat:/etc/passwd")

        def find(kind: str, pred: Any) -> GuardViolation | None:
            return next((v for v in got if v.kind == kind and v.sandbox_id == sb.sandbox_id and pred(v)), None)

        await until(lambda: find("seccomp", lambda v: v.what == "mount"), timeout=10, what="mount violation")
        await until(lambda: find("landlock", lambda v: "fs.make_reg" in v.what and "/var" in v.what), timeout=10, what="landlock violation")
        await until(lambda: find("fs", lambda v: v.what.endswith(" /etc/passwd")), timeout=10, what="/etc/passwd violation")
        i386_killed = lambda v: v.what.startswith("i386") and v.detail.get("process_killed") == "true"  # noqa: E731
        await until(lambda: find("seccomp", i386_killed), timeout=10, what="i386 violation")
        await until(lambda: find("seccomp", lambda v: v.what == "ioctl"), timeout=10, what="ioctl violation")
        mount = find("seccomp", lambda v: v.what == "mount")
        assert mount is not None and mount.action == "record" and mount.detail["exe"] == "/tmp/sysx" and mount.host_id
        passwd = find("fs", lambda v: v.what.endswith(" /etc/passwd"))
        assert passwd is not None and passwd.detail["errno"] == "EROFS" and passwd.detail["exe"] == "/bin/busybox", passwd
        # (the reader sees the whole host: other stacks' sandboxes may show up too -- not ours to judge)
        assert not [v for v in got if v.sandbox_id == sb.sandbox_id and "/tmp/ok" in v.what], got
        for what in ("mount", "landlock create /var/evil", "read-only mount: append to /etc/passwd", "i386 unshare", "ioctl XFS_IOC_SWAPEXT"):
            redteam.blocked(f"audit: {what} reported with the sandbox id")
    finally:
        await sub.unsubscribe()


async def test_writes_to_read_only_system_paths_are_reported(make_stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    """The read-only mounts refuse these before Landlock sees them; guard's own audit rules report
    them: sandbox, syscall, path (as far as the kernel names it) and errno. A host process that
    gets EROFS is not reported."""
    from bus import codec
    from bus import subjects as S
    from bus.messages import GuardViolation
    from guard import ReadonlyRules

    st = await make_stack(guard=True)
    k = st.guard.kernel
    if k is None or not k.rules.held:
        cannot_run("kernel audit rules not available here")
    assert ReadonlyRules.listed() == k.rules.rules  # installed once, whoever else runs a guard here
    got: list[GuardViolation] = []

    async def on(msg: Any) -> None:
        got.append(codec.EVENT.decode(msg.data))

    sub = await st.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on)
    ro = tempfile.mkdtemp(prefix="dsec-ro-host-")
    try:
        # A host process on a read-only mount of its own, first: by the time the sandbox's reports
        # are in, its record has been read (the kernel delivers them in order).
        subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "dsec-ro-host", ro], check=True)
        ignored = k.fs_ignored
        assert_errno(host_sysx(progs, nr("openat"), -100, f"s:{ro}/host-file", O_WRONLY | O_CREAT, 0o644), EROFS, what="host control")

        sb = await st.create()
        await push(sb, progs, "sysx")
        await sh(sb, "printf '#!/bin/sh\\necho HIJACKED\\n' > /tmp/evil && chmod +x /tmp/evil")
        target = (await sh(sb, "ls /usr/bin | grep '^[a-z]' | head -1")).out
        assert target, "no file under /usr/bin to attack"
        r = await sh(sb, "mv /tmp/evil /workspace/evil && mv /workspace/evil /tmp/evil && echo moved")  # allowed: not reported
        assert r.out.endswith("moved"), r
        attacks = {
            "echo x > /etc/passwd": (lambda: sh(sb, "echo x > /etc/passwd"), ("openat", "open", "creat"), "/etc/passwd", "EROFS"),
            "rm /bin/sh": (lambda: sh(sb, "rm -f /bin/sh"), ("unlink", "unlinkat"), "/bin/", "EROFS"),
            "chmod u+s /bin/busybox": (lambda: sh(sb, "chmod u+s /bin/busybox"), ("chmod", "fchmodat", "fchmodat2"), "/bin/busybox", "EROFS"),
            f"setxattr /usr/bin/{target}": (
                lambda: sysx(sb, nr("setxattr"), f"s:/usr/bin/{target}", "s:user.evil", "s:x", 1, 0), ("setxattr",), f"/usr/bin/{target}", "EROFS"),
            "rename(/tmp/evil, /bin/sh)": (lambda: sysx(sb, nr("rename"), "s:/tmp/evil", "s:/bin/sh"), ("rename",), "/bin/", "EXDEV"),
        }
        for what, (attack, calls, path, err) in attacks.items():
            r = await attack()
            assert r.code != 0, (what, r)

            def found(calls: tuple[str, ...] = calls, path: str = path) -> GuardViolation | None:
                return next((v for v in got if v.sandbox_id == sb.sandbox_id and v.kind == "fs"
                             and v.detail.get("syscall_name") in calls and v.detail.get("path") == path), None)

            await until(found, timeout=10, what=f"violation for {what}")
            v = found()
            assert v is not None and v.what == f"{v.detail['syscall_name']} {path}" and v.detail["errno"] == err, v
            assert v.action == "record" and v.host_id and v.detail["source"] == "guard.kernel", v
            redteam.blocked(f"audit: read-only mount refusal ({what}) reported with the sandbox id")
        # The files API's writes are the agent's, for the host API: recorded, never acted on.
        import sdk

        with pytest.raises(sdk.DsecError):
            await sb.files.write("/etc/passwd", b"HIJACKED")
        await until(lambda: any(v.sandbox_id == sb.sandbox_id and v.kind == "fs" and v.detail.get("process") == "agent" for v in got),
                    timeout=10, what="the agent's refused write")
        assert k.fs_ignored > ignored
        assert not [v for v in got if ro in v.what or ro in v.detail.get("paths", "") or "moved" in v.what], got
        assert not [v for v in got if v.sandbox_id == sb.sandbox_id and "/workspace" in v.detail.get("paths", "")], got
        redteam.allowed("host process on a read-only mount: not reported")
    finally:
        await sub.unsubscribe()
        subprocess.run(["umount", ro], capture_output=True)
        os.rmdir(ro)


async def test_strict_profile_kills_for_writing_a_system_file(make_stack: Any, redteam: Any) -> None:
    st = await make_stack(guard=True)
    if st.guard.kernel is None or not st.guard.kernel.rules.held:
        cannot_run("kernel audit rules not available here")
    strict = await st.create(profile="strict")
    relaxed = await st.create()
    assert (await sh(strict, "echo fine > /tmp/f && cat /tmp/f")).out == "fine"  # positive control
    await sh(relaxed, "echo 'evil::0:0::/:/bin/sh' >> /etc/passwd")
    from sdk import SandboxNotFound

    try:
        await sh(strict, "echo 'evil::0:0::/:/bin/sh' >> /etc/passwd")
    except SandboxNotFound:
        pass  # guard's kill can land before the exec's answer (seen in full runs): the record says why

    async def killed() -> bool:
        return (await _sandbox_record(st, strict.sandbox_id)).state == "gone"

    await until(killed, timeout=20, what="guard to kill the strict sandbox")
    rec = await _sandbox_record(st, strict.sandbox_id)
    assert re.match(r"guard-kill: fs (open|openat|creat) /etc/passwd", rec.end_reason), rec
    redteam.blocked("strict profile: sandbox killed after writing /etc/passwd (read-only mount)")
    assert (await _sandbox_record(st, relaxed.sandbox_id)).state == "running"
    assert (await sh(relaxed, "echo still-here")).out == "still-here"


async def test_strict_profile_kills_on_first_violation(make_stack: Any, progs: dict[str, bytes], redteam: Any) -> None:
    st = await make_stack(guard=True)
    if st.guard.kernel is None:
        cannot_run("kernel audit not readable here")
    strict = await st.create(profile="strict")
    relaxed = await st.create()  # default profile: record only
    await push(strict, progs, "sysx")
    await push(relaxed, progs, "sysx")
    assert (await sh(strict, "echo fine")).out == "fine"  # positive control: normal work is fine
    await sysx(relaxed, nr("bpf"), 0, "buf:128", 128)
    await sysx(strict, nr("bpf"), 0, "buf:128", 128)

    async def killed() -> bool:
        return (await _sandbox_record(st, strict.sandbox_id)).state == "gone"

    await until(killed, timeout=20, what="guard to kill the strict sandbox")
    rec = await _sandbox_record(st, strict.sandbox_id)
    assert rec.end_reason.startswith("guard-kill: seccomp bpf"), rec
    assert strict.sandbox_id not in st.host.live
    redteam.blocked("strict profile: sandbox killed after a refused bpf()")
    assert (await _sandbox_record(st, relaxed.sandbox_id)).state == "running"
    assert (await sh(relaxed, "echo still-here")).out == "still-here"


async def test_denials_of_warm_pool_sandboxes_are_reported_with_the_sandbox_id(make_stack: Any, redteam: Any) -> None:
    """A warm-pool container's id (its cgroup's name, which the kernel's records lead to) is not the
    sandbox's: the sandbox's record names it, and guard reports the Landlock denial under the sandbox's
    id, with its tenant's events. Control: a cold sandbox of the same profile on the same stack."""
    from bus import codec
    from bus import subjects as S
    from bus.messages import GuardViolation

    st = await make_stack(guard=True, warm_pool=1)
    if st.guard.kernel is None:
        cannot_run("kernel audit not readable here")
    got: list[GuardViolation] = []

    async def on(msg: Any) -> None:
        got.append(codec.EVENT.decode(msg.data))

    sub = await st.nc.subscribe(S.EVT_GUARD_VIOLATION, cb=on)
    try:
        cold = await st.create()
        await until(lambda: st.backend.pool.ready() >= 1, timeout=60, what="a warm container for the default profile")
        warm = await st.create()
        wcid = st.handle(warm).extra["cid"]
        assert wcid.startswith("wp-") and st.handle(cold).extra["cid"] == cold.sandbox_id
        assert (await _sandbox_record(st, warm.sandbox_id)).container_id == wcid
        assert (await _sandbox_record(st, cold.sandbox_id)).container_id == ""
        for sb in (cold, warm):
            assert (await sh(sb, "echo fine > /tmp/ok && cat /tmp/ok")).out == "fine"  # positive control
            r = await sh(sb, "echo evil > /var/evil")  # Landlock's (no read-only mount there)
            assert r.code != 0 and "Permission denied" in r.out, r

        def found(sid: str) -> GuardViolation | None:
            return next((v for v in got if v.sandbox_id == sid and v.kind == "landlock" and "/var" in v.what), None)

        await until(lambda: found(cold.sandbox_id), timeout=15, what="the cold sandbox's landlock violation")
        await until(lambda: found(warm.sandbox_id), timeout=15, what="the warm sandbox's landlock violation")
        v = found(warm.sandbox_id)
        assert v is not None and v.action == "record" and v.detail["container_id"] == wcid and "fs.make_reg" in v.what, v
        c = found(cold.sandbox_id)
        assert c is not None and "container_id" not in c.detail, c
        assert not [x for x in got if x.sandbox_id == wcid], got
        redteam.blocked("audit: landlock denial in a warm-pool sandbox reported with the sandbox id")
    finally:
        await sub.unsubscribe()


async def test_strict_profile_sandbox_from_the_warm_pool_is_killed(make_stack: Any, redteam: Any) -> None:
    """A strict sandbox served by a warm container is killed by guard for a Landlock denial, as a cold
    one is (the control: the first strict create, before the pool holds one); a default-profile
    sandbox doing the same lives on."""
    st = await make_stack(guard=True, warm_pool=1)
    if st.guard.kernel is None:
        cannot_run("kernel audit not readable here")
    cold = await st.create(profile="strict")
    assert st.handle(cold).extra["cid"] == cold.sandbox_id
    await until(lambda: any(k.profile == "strict" and e for k, e in st.backend.pool.entries().items()), timeout=60,
                what="a warm container for the strict profile")
    warm = await st.create(profile="strict")
    wcid = st.handle(warm).extra["cid"]
    assert wcid.startswith("wp-")
    relaxed = await st.create()
    from sdk import SandboxNotFound

    for sb in (relaxed, cold, warm):
        assert (await sh(sb, "echo fine")).out == "fine"  # positive control: normal work is fine
        try:
            r = await sh(sb, "echo evil > /var/evil")
            assert r.code != 0 and "Permission denied" in r.out, r
        except SandboxNotFound:
            assert sb is not relaxed  # guard's kill can land before the exec's answer: the record says why

    for sb in (cold, warm):
        async def killed(sid: str = sb.sandbox_id) -> bool:
            return (await _sandbox_record(st, sid)).state == "gone"

        await until(killed, timeout=30, what=f"guard to kill strict sandbox {sb.sandbox_id}")
        rec = await _sandbox_record(st, sb.sandbox_id)
        assert rec.end_reason.startswith("guard-kill: landlock fs.make_reg") and "/var" in rec.end_reason, rec
    assert warm.sandbox_id not in st.host.live
    redteam.blocked("strict profile: a warm-pool sandbox killed by guard after a Landlock denial")
    assert (await _sandbox_record(st, relaxed.sandbox_id)).state == "running"
    assert (await sh(relaxed, "echo still-here")).out == "still-here"


async def _sandbox_record(st: Any, sid: str) -> Any:
    from bus import codec
    from bus import subjects as S

    kv = await st.nc.jetstream().key_value(S.KV_SANDBOXES)
    return codec.SANDBOX_RECORD.decode((await kv.get(sid)).value)


async def test_profiles_come_from_kv(make_stack: Any, redteam: Any) -> None:
    """Guard writes the profiles; the host agent watches them and enforces what it finds."""
    import msgspec

    import sdk
    from bus import codec
    from bus import subjects as S
    from bus.messages import SecurityProfile
    from guard import DEFAULT_VERSION, default_profile

    st = await make_stack(guard=True)
    kv = await st.nc.jetstream().key_value(S.KV_PROFILES)
    dec = msgspec.msgpack.Decoder(SecurityProfile)
    stored = {k: dec.decode((await kv.get(k)).value) for k in ("default", "strict")}
    assert stored["default"].version == DEFAULT_VERSION and stored["strict"].audit.seccomp == "kill"
    # A profile an operator adds: only /workspace writable.
    custom = msgspec.structs.replace(default_profile(), name="ws-only", version=1)
    custom.fs.writable = ["/workspace"]
    await kv.put("ws-only", codec.encode(custom))
    await until(lambda: "ws-only" in st.host.profiles.profiles, timeout=10, what="host agent to see the new profile")
    sb = await st.create(profile="ws-only")
    r = await sh(sb, "echo a > /workspace/a && echo ok; echo b > /tmp/b")
    assert r.out.startswith("ok") and "Permission denied" in r.out, r
    redteam.blocked("custom profile from KV: /tmp not writable")
    with pytest.raises(sdk.DsecError):
        await st.create(profile="no-such-profile", create_timeout=30)
    redteam.blocked("unknown profile refused (no silent fallback)")


async def test_agent_that_cannot_confine_itself_fails_the_create(stack: Any) -> None:
    """Fail closed: an agent that can't apply its confinement exits, and the create fails at once
    with the agent's own words (not after the ready timeout, and never runs unconfined)."""
    import dataclasses
    import uuid

    from bus.errors import CreateFailed
    from bus.messages import SandboxSpec
    from guard import default_profile
    from hostagent._profiles import compile_profile

    broken = dataclasses.replace(compile_profile(default_profile()), agent_args=("--seccomp-bpf", "zz"))
    sid = f"sb-{stack.uid}-broken-{uuid.uuid4().hex[:6]}"
    layers = await stack.host.intake.layers("base")
    t0 = time.monotonic()
    try:
        with pytest.raises(CreateFailed) as ei:
            await stack.backend.create(SandboxSpec(sandbox_id=sid), layers, security=broken)
    finally:
        await stack.backend.destroy(sid)
    assert time.monotonic() - t0 < 10
    assert "--seccomp-bpf" in str(ei.value), ei.value
