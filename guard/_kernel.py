"""Host-side reader of the kernel audit records that sandbox confinement produces.

Sources (all arrive through the audit netlink *read-only multicast group*, which needs only
CAP_AUDIT_READ, never takes auditd's place and is not rate limited like the printk copy):

- ``type=1326`` SECCOMP: the in-sandbox agent installs its deny filter with
  SECCOMP_FILTER_FLAG_LOG, so every EPERM it returns is audited; a call through a foreign syscall
  ABI (i386 ``int 0x80``, x32) is killed and audited (``code=0x80000000``, ``sig=31``).
- ``type=1423`` LANDLOCK_ACCESS (+ ``1424`` LANDLOCK_DOMAIN, ``1300`` SYSCALL of the same event):
  Landlock (ABI >= 7, kernel >= 6.15) logs denials only while audit is enabled. ``KernelAudit``
  turns audit on when it is off (``AUDIT_SET enabled=1``: no rules, no auditd; measured cost on
  syscalls is within noise) and leaves it on: it is host-wide state other readers on the host
  (another guard, auditd) may rely on by then.
- ``type=1300`` SYSCALL with ``key="dsec-erofs"`` (+ ``1307`` CWD, ``1302`` PATH of the same event):
  a write, unlink, rename, chmod, chown, setxattr, ... refused by a read-only mount. The system
  paths are read-only bind mounts in a sandbox, and the VFS refuses those calls with EROFS (EXDEV
  for a rename or link across the mount's edge) before any LSM hook runs, so Landlock never sees
  them. ``ReadonlyRules`` installs syscall-exit audit rules for exactly those failures; see there
  for their cost and how several guards on one host share them.

Mapping a record to its sandbox, most reliable first:

1. ``auid`` is the agent's marker login uid (``AUDIT_LOGINUID``) and ``ses`` is the sandbox's own
   audit session id, which every process of the sandbox inherits and cannot change: looked up in
   a ses -> sandbox map rebuilt from the agents' ``/proc/<pid>/sessionid`` on a miss. This works
   when the offending process has already exited.
2. ``pid``: ``/proc/<pid>/cgroup`` names ``<cgroup_parent>/<sandbox_id>``.
3. Landlock ``domain``: the ``1424 status=allocated`` record names the domain's creator, the
   sandbox's agent.
Records of processes outside any sandbox are ignored.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import os
import posixpath
import re
import socket
import struct
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from bus.profiles import SYSTEM_PATHS

from ._netlink import NLMSG as _NLMSG
from ._netlink import drain
from ._buckets import SandboxBuckets

log = structlog.get_logger("dsec.guard.kernel")

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_GET = 1000
AUDIT_SET = 1001
AUDIT_STATUS_ENABLED = 0x0001
AUDIT_STATUS_BACKLOG_LIMIT = 0x0010
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4

AUDIT_ADD_RULE = 1011
AUDIT_DEL_RULE = 1012
AUDIT_LIST_RULES = 1013
NLMSG_DONE = 3
NLM_F_DUMP = 0x300

AUDIT_SYSCALL = 1300
AUDIT_PATH = 1302
AUDIT_CWD = 1307
AUDIT_EOE = 1320
AUDIT_SECCOMP = 1326
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424

AUDIT_LOGINUID = 0x64736563  # the agents' marker login uid ("dsec"); see hostagent/_profiles.py
AUDIT_UID_UNSET = 4294967295
ARCH_NAMES = {0xC000003E: "x86_64", 0x40000003: "i386", 0xC00000B7: "aarch64", 0x40000028: "arm"}

# struct audit_rule_data (linux/audit.h): flags, action, field_count, mask[64], fields[64],
# values[64], fieldflags[64], buflen, then the string values (here: the key).
AUDIT_FILTER_EXIT = 0x04
AUDIT_ALWAYS = 2
AUDIT_F_ARCH, AUDIT_F_EXIT, AUDIT_F_FILTERKEY = 11, 103, 210
AUDIT_EQUAL = 0x40000000
_RULE = struct.Struct("=3I64I64I64I64II")
# fields whose value is a string in buf: AUDIT_SUBJ_*/OBJ_* labels, WATCH, DIR, EXE
_STRING_FIELDS = frozenset({13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 105, 107, 112})

READONLY_KEY = "dsec-erofs"
READONLY_LOCK = "/run/dsec-guard-audit-rules.lock"
NATIVE_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
# Every call that modifies a path or an inode and so can fail on a read-only mount. x86_64 numbers
# are spelled out (a stable ABI, and Debian 12's headers lack the newest calls); other
# architectures take theirs from the C headers by name. ioctl: FS_IOC_SETFLAGS/FSSETXATTR
# (chattr); bind: a unix socket's inode.
READONLY_SYSCALLS_X86_64: dict[str, int] = {
    "ioctl": 16, "open": 2, "bind": 49, "truncate": 76, "ftruncate": 77, "rename": 82, "mkdir": 83,
    "rmdir": 84, "creat": 85, "link": 86, "unlink": 87, "symlink": 88, "chmod": 90, "fchmod": 91,
    "chown": 92, "fchown": 93, "lchown": 94, "utime": 132, "mknod": 133, "setxattr": 188,
    "lsetxattr": 189, "fsetxattr": 190, "removexattr": 197, "lremovexattr": 198, "fremovexattr": 199,
    "utimes": 235, "openat": 257, "mkdirat": 258, "mknodat": 259, "fchownat": 260, "futimesat": 261,
    "unlinkat": 263, "renameat": 264, "linkat": 265, "symlinkat": 266, "fchmodat": 268,
    "utimensat": 280, "fallocate": 285, "renameat2": 316, "openat2": 437, "fchmodat2": 452,
    "setxattrat": 463, "removexattrat": 466, "file_setattr": 469,
}
# EXDEV: a rename or link from or onto a read-only mount from another mount. Also what any `mv`
# across two writable mounts gets first, so these are reported only when a path is a system path.
EXDEV_SYSCALLS = ("rename", "renameat", "renameat2", "link", "linkat")
# Which argument holds the directory fd a relative PATH item (by its index) is resolved against.
_DIRFD_ARG = {("symlinkat", 0): "a1", ("renameat", 1): "a2", ("renameat2", 1): "a2", ("linkat", 1): "a2"}
AT_FDCWD = 0xFFFFFF9C


_STATUS = struct.Struct("=11I")
_KV = re.compile(r'(\w+)=("[^"]*"|\S+)')
_HEADER = re.compile(r"audit\((\d+\.\d+):(\d+)\):\s*")
_SANDBOX_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")


def parse_record(text: str) -> tuple[str, dict[str, str]]:
    """``audit(ts:serial): k=v ...`` -> (serial, fields). Quoted values are unquoted; unquoted
    hex values of ``comm``/``exe``/``path``/``proctitle`` (the kernel hex-encodes untrusted
    strings with odd characters) are decoded."""
    m = _HEADER.match(text)
    serial = m.group(2) if m else ""
    body = text[m.end():] if m else text
    fields: dict[str, str] = {}
    for k, v in _KV.findall(body):
        if v.startswith('"') and v.endswith('"'):
            v = v[1:-1]
        elif k in ("comm", "exe", "path", "proctitle", "name", "cwd") and re.fullmatch(r"(?:[0-9A-F]{2})+", v):
            try:
                v = bytes.fromhex(v).decode(errors="replace").replace("\x00", " ")
            except ValueError:
                pass
        fields.setdefault(k, v)
    return serial, fields


@dataclass
class Denial:
    """One refused operation of a sandboxed process, as the kernel reported it."""

    kind: str  # seccomp | landlock | fs (a read-only mount refused it) | network
    sandbox_id: str
    what: str  # e.g. "mount", "i386 syscall 21", "fs.write_file /etc/passwd"
    killed: bool = False
    detail: dict[str, str] = field(default_factory=dict)


def _syscall_names(header: str) -> dict[int, str]:
    try:
        out = subprocess.run(
            ["gcc", "-dM", "-E", "-x", "c", "-"], input=f"#include <{header}>\n".encode(), capture_output=True, timeout=10,
        ).stdout.decode()
    except (OSError, subprocess.SubprocessError):
        return {}
    return {int(n): name for name, n in re.findall(r"#define __NR_(\w+) (\d+)\b", out)}


class SandboxMap:
    """pid / audit session / Landlock domain -> sandbox id, from /proc and the cgroup tree."""

    def __init__(self, cgroup_parent: str = "/dsec", proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> None:
        self.parent = "/" + cgroup_parent.strip("/")
        self.proc = Path(proc)
        self.cgroup_root = Path(cgroup_root)
        self._cg_re = re.compile(re.escape(self.parent) + r"/([A-Za-z0-9_-]{1,128})(?:/|$)")
        self.by_ses: dict[str, str] = {}
        self.by_domain: dict[str, str] = {}
        self._rescanned = 0.0

    def of_pid(self, pid: str | int) -> str | None:
        try:
            text = (self.proc / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        for line in text.splitlines():
            m = self._cg_re.search(line.split(":", 2)[-1])
            if m:
                return m.group(1)
        return None

    def _sandbox_dirs(self) -> list[Path]:
        for sub in ("pids", "memory", "cpu", "unified", "systemd", ""):
            d = self.cgroup_root / sub / self.parent.lstrip("/") if sub else self.cgroup_root / self.parent.lstrip("/")
            if d.is_dir():
                return [p for p in d.iterdir() if p.is_dir() and _SANDBOX_ID.fullmatch(p.name)]
        return []

    def rescan(self) -> None:
        """Rebuild ses -> sandbox from the first process of every sandbox cgroup."""
        now = time.monotonic()
        if now - self._rescanned < 0.05:
            return
        self._rescanned = now
        found: dict[str, str] = {}
        for d in self._sandbox_dirs():
            for name in ("cgroup.procs", "tasks"):
                try:
                    pids = (d / name).read_text().split()
                    break
                except OSError:
                    pids = []
            for pid in pids[:4]:
                try:
                    ses = (self.proc / pid / "sessionid").read_text().strip()
                except OSError:
                    continue
                if ses and ses != str(AUDIT_UID_UNSET):
                    found[ses] = d.name
                    break
        self.by_ses.update(found)

    def of_session(self, ses: str) -> str | None:
        if not ses or ses == str(AUDIT_UID_UNSET):
            return None
        sid = self.by_ses.get(ses)
        if sid is None:
            self.rescan()
            sid = self.by_ses.get(ses)
        return sid

    def forget(self, sandbox_id: str) -> None:
        for m in (self.by_ses, self.by_domain):
            for k in [k for k, v in m.items() if v == sandbox_id]:
                del m[k]

    def resolve(self, f: dict[str, str]) -> str | None:
        sid = None
        if f.get("auid") == str(AUDIT_LOGINUID):
            sid = self.of_session(f.get("ses", ""))
        if sid is None and f.get("pid"):
            sid = self.of_pid(f["pid"])
            if sid and f.get("auid") == str(AUDIT_LOGINUID) and f.get("ses"):
                self.by_ses[f["ses"]] = sid
        return sid


def audit_rule(arch: int, numbers: Iterable[int], exit_errno: int, key: str) -> bytes:
    """``-a always,exit -F exit=-<exit_errno> -F arch=<arch> -S <numbers> -k <key>`` as the kernel
    takes it. The exit value comes first: it is what rejects nearly every call."""
    mask = [0] * 64
    for n in numbers:
        mask[n // 32] |= 1 << (n % 32)
    k = key.encode()
    fields = [AUDIT_F_EXIT, AUDIT_F_ARCH, AUDIT_F_FILTERKEY]
    values = [-exit_errno & 0xFFFFFFFF, arch, len(k)]
    pad = [0] * (64 - len(fields))
    return _RULE.pack(
        AUDIT_FILTER_EXIT, AUDIT_ALWAYS, len(fields), *mask, *fields, *pad, *values, *pad, *[AUDIT_EQUAL] * len(fields), *pad, len(k),
    ) + k


def rule_key(rule: bytes) -> str:
    """The key of a ``struct audit_rule_data`` ("" without one)."""
    v = _RULE.unpack_from(rule)
    count, fields, values = v[2], v[67:131], v[131:195]
    off = 0
    for i in range(min(count, 64)):
        # string-valued fields keep their text in buf, in field order; only the key is ours to read
        if fields[i] == AUDIT_F_FILTERKEY:
            return rule[_RULE.size + off:_RULE.size + off + values[i]].decode(errors="replace")
        if fields[i] in _STRING_FIELDS:
            off += values[i]
    return ""


def readonly_syscalls(machine: str | None = None) -> dict[str, int]:
    machine = machine or os.uname().machine
    if machine == "x86_64":
        return dict(READONLY_SYSCALLS_X86_64)
    return {name: nr for nr, name in _syscall_names("sys/syscall.h").items() if name in READONLY_SYSCALLS_X86_64}


def readonly_rules(machine: str | None = None, key: str = READONLY_KEY) -> list[bytes]:
    machine = machine or os.uname().machine
    arch = NATIVE_ARCH.get(machine)
    table = readonly_syscalls(machine) if arch is not None else {}
    if arch is None or not table:
        return []
    exdev = [table[n] for n in EXDEV_SYSCALLS if n in table]
    return [audit_rule(arch, sorted(table.values()), errno.EROFS, key), audit_rule(arch, sorted(exdev), errno.EXDEV, key)]


class ReadonlyRules:
    """The kernel audit rules that report calls a read-only mount refused: EROFS from any call in
    ``READONLY_SYSCALLS_*``, EXDEV from rename/link, native ABI only (the agent's seccomp filter
    kills every other ABI), tagged ``READONLY_KEY``.

    Cost, measured on this kernel (6.18, x86_64) with audit enabled either way: while *any* syscall
    rule is loaded, the kernel keeps a full audit context for every syscall of every task that has
    one (all started after audit was enabled), not just the listed calls: getpid 80 -> 110 ns,
    stat 390 -> 500 ns, open+close 565 -> 785 ns, a failing unlink 285 -> 485 ns. Records are
    built only for the calls that fail with those errnos, mostly sandboxes hitting their system
    paths, and a flood of them costs what a flood of Landlock denials costs (the backlog is
    bounded; a per-sandbox bucket in ``KernelAudit`` bounds the reports). Narrowing the rule to the
    sandboxes' login uid would not lower that cost and would blind the guard to sandboxes whose
    agent could not take it; a ``never,task`` rule for host processes would, but it would also
    switch off auditing that others on the host (auditd) rely on. ``Guard(readonly_audit=False)``
    leaves the rules out.

    The rules are host-wide and every guard installs byte-identical ones, so a second add is
    EEXIST. Sharing: each guard holds a shared flock on ``lock_path`` while it relies on them. On
    stop it asks for the lock exclusively without waiting, which it gets only when no other guard
    holds it, and only then deletes the rules, still holding the lock, so a guard that starts
    meanwhile waits and adds them after the delete. A guard that dies drops its lock with its fd;
    its rules stay until the last guard stops. Holders re-add missing rules (``ensure``) now and
    then: someone may delete them (``auditctl -D``, a guard in a container whose /run is its own).
    """

    def __init__(self, lock_path: str = READONLY_LOCK, rules: list[bytes] | None = None) -> None:
        self.lock_path = lock_path
        self.rules = readonly_rules() if rules is None else rules
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def install(self) -> None:
        if self._fd is not None:
            return
        if not self.rules:
            raise OSError(errno.ENOTSUP, f"no audit rules for architecture {os.uname().machine}")
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a last guard deletes the rules
            self.ensure()
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd

    def ensure(self) -> int:
        """Add the rules that are missing; returns how many were."""
        added = 0
        for r in self.rules:
            err, _ = KernelAudit._request(AUDIT_ADD_RULE, r)
            if err == 0:
                added += 1
            elif err != errno.EEXIST:
                raise OSError(err, f"AUDIT_ADD_RULE: {os.strerror(err)}")
        return added

    def remove(self) -> bool:
        """Let go of the rules; deletes them if no other guard holds them. True if deleted."""
        fd, self._fd = self._fd, None
        if fd is None:
            return False
        try:
            try:
                # Not atomic (flock drops the shared lock first), which costs nothing here: a guard
                # that slips in keeps the rules, as it should.
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            for r in self.rules:
                err, _ = KernelAudit._request(AUDIT_DEL_RULE, r)
                if err not in (0, errno.ENOENT):
                    log.warning("audit_rule_not_deleted", error=os.strerror(err))
            return True
        finally:
            os.close(fd)

    @staticmethod
    def listed(key: str | None = READONLY_KEY) -> list[bytes]:
        """The rules the kernel has (with ``key``; None: all), as ``struct audit_rule_data``."""
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        out: list[bytes] = []
        try:
            s.settimeout(2.0)
            s.bind((0, 0))
            s.send(_NLMSG.pack(_NLMSG.size, AUDIT_LIST_RULES, NLM_F_REQUEST | NLM_F_DUMP, 1, 0))
            while True:
                data = s.recv(1 << 20)
                pos = 0
                while pos + _NLMSG.size <= len(data):
                    length, rtype, _, _, _ = _NLMSG.unpack_from(data, pos)
                    if length < _NLMSG.size:
                        return out
                    body = data[pos + _NLMSG.size:pos + length]
                    if rtype == NLMSG_DONE:
                        return out
                    if rtype == NLMSG_ERROR:
                        err = -struct.unpack_from("=i", body)[0]
                        if err:
                            raise OSError(err, f"AUDIT_LIST_RULES: {os.strerror(err)}")
                        return out
                    if rtype == AUDIT_LIST_RULES and (key is None or rule_key(body) == key):
                        out.append(body)
                    pos += (length + 3) & ~3
        finally:
            s.close()


def _under(path: str, prefixes: Iterable[str]) -> bool:
    p = path.rstrip("/") or "/"
    return any(p == pre or p.startswith(pre.rstrip("/") + "/") for pre in prefixes)


_AT_CALLS = frozenset({
    "openat", "openat2", "mkdirat", "mknodat", "fchownat", "futimesat", "unlinkat", "renameat", "linkat", "symlinkat",
    "fchmodat", "utimensat", "renameat2", "fchmodat2", "setxattrat", "removexattrat", "file_setattr",
})


class KernelAudit:
    """Reads audit records from the kernel and reports sandbox denials to ``on_denial``."""

    def __init__(
        self,
        on_denial: Callable[[Denial], None],
        *,
        cgroup_parent: str = "/dsec",
        enable_audit: bool = True,
        backlog_limit: int = 8192,
        sandbox_map: SandboxMap | None = None,
        readonly_audit: bool = True,
        readonly_rules: ReadonlyRules | None = None,
        system_paths: Iterable[str] = SYSTEM_PATHS,
        fs_rate_per_s: float = 5.0,
        fs_burst: int = 20,
        reassert_s: float = 10.0,
    ) -> None:
        self.on_denial = on_denial
        self.map = sandbox_map or SandboxMap(cgroup_parent)
        self.enable_audit = enable_audit
        self.backlog_limit = backlog_limit
        self.readonly_audit = readonly_audit
        self.rules = readonly_rules or ReadonlyRules()
        self.system_paths = tuple(system_paths)
        self.fs_rate_per_s = fs_rate_per_s
        self.fs_burst = fs_burst
        self.reassert_s = reassert_s
        self._ro_pending: dict[str, list[tuple[int, dict[str, str]]]] = {}
        # `rm -rf /usr` is one refusal per directory, each with its own path: the per-denial folding
        # cannot fold those, a per-sandbox bucket bounds them.
        self._fs_limit = SandboxBuckets(fs_rate_per_s, fs_burst)
        self._keep_task: asyncio.Task[None] | None = None
        self.fs_ignored = 0  # read-only refusals of processes outside any sandbox
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._we_enabled = False
        self._pending: dict[str, list[tuple[int, dict[str, str]]]] = {}
        self._flush_handle: asyncio.TimerHandle | None = None
        self._names: dict[str, dict[int, str]] = {}
        self.records = 0
        self.audit_enabled = False

    # --- netlink --------------------------------------------------------------------------
    @staticmethod
    def _request(msg_type: int, payload: bytes = b"") -> tuple[int, bytes]:
        s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        try:
            s.settimeout(2.0)
            s.bind((0, 0))
            s.send(_NLMSG.pack(_NLMSG.size + len(payload), msg_type, NLM_F_REQUEST | NLM_F_ACK, 1, 0) + payload)
            reply = b""
            status = 0
            for _ in range(4):
                data = s.recv(65536)
                length, rtype, _, _, _ = _NLMSG.unpack_from(data)
                if rtype == NLMSG_ERROR:
                    status = -struct.unpack_from("=i", data, _NLMSG.size)[0]
                    if msg_type != AUDIT_GET or status:
                        return status, reply
                    continue
                if rtype == msg_type:
                    reply = data[_NLMSG.size:length]
                    if msg_type == AUDIT_GET:
                        return 0, reply
            return status, reply
        finally:
            s.close()

    @classmethod
    def audit_status(cls) -> dict[str, int]:
        err, data = cls._request(AUDIT_GET)
        if err:
            raise OSError(err, os.strerror(err))
        names = ("mask", "enabled", "failure", "pid", "rate_limit", "backlog_limit", "lost", "backlog")
        vals = _STATUS.unpack_from(data.ljust(_STATUS.size, b"\0"))
        return dict(zip(names, vals, strict=False))  # newer kernels report more fields than we name

    @classmethod
    def _set(cls, mask: int, enabled: int = 0, backlog_limit: int = 0) -> None:
        payload = _STATUS.pack(mask, enabled, 0, 0, 0, backlog_limit, 0, 0, 0, 0, 0)
        err, _ = cls._request(AUDIT_SET, payload)
        if err:
            raise OSError(err, os.strerror(err))

    def _ensure_enabled(self) -> None:
        st = self.audit_status()
        if st["enabled"] == 0 and self.enable_audit:
            self._set(AUDIT_STATUS_ENABLED, enabled=1)
            self._we_enabled = True
            log.info("kernel_audit_enabled", note="Landlock denials are audited only while audit is enabled")
            st = self.audit_status()
        if self.backlog_limit and st["backlog_limit"] < self.backlog_limit and (self._we_enabled or st["pid"] == 0):
            try:
                self._set(AUDIT_STATUS_BACKLOG_LIMIT, backlog_limit=self.backlog_limit)
            except OSError as exc:
                log.warning("audit_backlog_not_raised", error=str(exc))
        self.audit_enabled = st["enabled"] != 0

    # --- lifecycle --------------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            sock.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
        except OSError:
            sock.close()
            raise
        self._sock = sock
        try:
            await asyncio.to_thread(self._ensure_enabled)
        except OSError as exc:
            log.warning("kernel_audit_status_unavailable", error=str(exc), note="seccomp records still arrive; Landlock ones need audit enabled")
        self._loop.add_reader(sock.fileno(), self._readable)
        if self.readonly_audit and self.audit_enabled:
            try:
                await asyncio.to_thread(self.rules.install)
                self._keep_task = asyncio.create_task(self._keep_rules(), name="guard-audit-rules")
            except OSError as exc:
                log.warning("readonly_audit_rules_unavailable", error=str(exc),
                            note="writes refused by read-only system paths go unreported (needs CAP_AUDIT_CONTROL)")
        log.info("kernel_audit_reader_started", audit_enabled=self.audit_enabled, readonly_rules=self.rules.held)

    async def _keep_rules(self) -> None:
        while True:
            await asyncio.sleep(self.reassert_s)
            try:
                if await asyncio.to_thread(self.rules.ensure):
                    log.warning("readonly_audit_rules_restored", note="someone deleted them")
            except OSError as exc:
                log.warning("readonly_audit_rules_check_failed", error=str(exc))

    def forget(self, sandbox_id: str) -> None:
        self.map.forget(sandbox_id)
        self._fs_limit.forget(sandbox_id)

    async def stop(self) -> None:
        if self._keep_task is not None:
            self._keep_task.cancel()
            try:
                await self._keep_task
            except asyncio.CancelledError:
                pass
            self._keep_task = None
        if self.rules.held:
            try:
                removed = await asyncio.to_thread(self.rules.remove)
                log.info("readonly_audit_rules_released", deleted=removed)
            except OSError as exc:
                log.warning("readonly_audit_rules_release_failed", error=str(exc))
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._flush()

    # --- records ------------------------------------------------------------------------------
    def _readable(self) -> None:
        assert self._sock is not None
        drain(
            self._sock, lambda rtype, body: self.feed(rtype, body.rstrip(b"\0").decode(errors="replace")),
            batches=1024, overrun="kernel_audit_overrun", note="records were lost: the reader fell behind",
        )
        self._schedule_flush()

    def feed(self, rtype: int, text: str) -> None:
        """Take one audit record (also the entry point for tests)."""
        if rtype not in _WANTED:
            return
        if rtype in (AUDIT_PATH, AUDIT_CWD) and not self._ro_pending and not self._pending:
            return
        self.records += 1
        serial, f = parse_record(text)
        if rtype == AUDIT_SECCOMP:
            self._seccomp(f)
            return
        if rtype == AUDIT_LANDLOCK_DOMAIN:
            self._landlock_domain(serial, f)
            return
        if rtype == AUDIT_LANDLOCK_ACCESS:
            self._pending.setdefault(serial, []).append((rtype, f))
            return
        if serial in self._pending:
            if rtype == AUDIT_EOE:
                self._landlock(self._pending.pop(serial))
            else:
                self._pending[serial].append((rtype, f))
            return
        self._readonly_record(rtype, serial, f)

    def _landlock_domain(self, serial: str, f: dict[str, str]) -> None:
        """A Landlock domain came or went: which sandbox a domain id belongs to."""
        if f.get("status") == "allocated" and f.get("domain") and f.get("pid"):
            sid = self.map.of_pid(f["pid"])
            if sid:
                self.map.by_domain[f["domain"]] = sid
        if f.get("status") == "deallocated":
            self.map.by_domain.pop(f.get("domain", ""), None)
        if serial in self._pending:
            self._pending[serial].append((AUDIT_LANDLOCK_DOMAIN, f))

    def _readonly_record(self, rtype: int, serial: str, f: dict[str, str]) -> None:
        """The records of a call our read-only-mount rule caught, collected until its EOE."""
        if rtype == AUDIT_SYSCALL:
            # A Landlock EXDEV (refer) also matches our EXDEV rule; its Landlock records came
            # first, so it went to the Landlock branch and is reported once, as Landlock's.
            if f.get("key") == READONLY_KEY:
                self._ro_pending[serial] = [(rtype, f)]
            return
        if serial not in self._ro_pending:
            return  # a record of an event that is no denial of ours
        if rtype == AUDIT_EOE:
            self._readonly(self._ro_pending.pop(serial))
        else:
            self._ro_pending[serial].append((rtype, f))

    def _schedule_flush(self) -> None:
        if (self._pending or self._ro_pending) and self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_later(0.2, self._flush)

    def _flush(self) -> None:
        """Events whose EOE record hasn't come (or never comes) after a grace."""
        self._flush_handle = None
        for serial in list(self._pending):
            self._landlock(self._pending.pop(serial))
        for serial in list(self._ro_pending):
            self._readonly(self._ro_pending.pop(serial))

    def _syscall_name(self, arch: int, nr: int) -> str:
        key = "i386" if arch == 0x40000003 else "native"
        if key not in self._names:
            self._names[key] = _syscall_names("asm/unistd_32.h" if key == "i386" else "sys/syscall.h")
        return self._names[key].get(nr, f"syscall {nr}")

    def _seccomp(self, f: dict[str, str]) -> None:
        sid = self.map.resolve(f)
        if sid is None:
            return
        try:
            arch = int(f.get("arch", "0"), 16)
            nr = int(f.get("syscall", "-1"))
        except ValueError:
            arch, nr = 0, -1
        code = f.get("code", "")
        killed = f.get("sig", "0") not in ("0", "")  # KILL_PROCESS/KILL_THREAD: SIGSYS
        name = self._syscall_name(arch, nr)
        native = arch in (0xC000003E, 0xC00000B7)
        what = name if native else f"{ARCH_NAMES.get(arch, hex(arch))} {name}"
        detail = {
            "pid": f.get("pid", ""), "comm": f.get("comm", ""), "exe": f.get("exe", ""), "syscall": str(nr),
            "arch": ARCH_NAMES.get(arch, f.get("arch", "")), "code": code, "ses": f.get("ses", ""),
        }
        if killed:
            detail["signal"] = f.get("sig", "")
        self._emit(Denial(kind="seccomp", sandbox_id=sid, what=what, killed=killed, detail=detail))

    def _landlock(self, recs: list[tuple[int, dict[str, str]]]) -> None:
        access = [f for t, f in recs if t == AUDIT_LANDLOCK_ACCESS]
        sysc = next((f for t, f in recs if t == AUDIT_SYSCALL), {})
        if not access:
            return
        a = access[0]
        sid = self.map.resolve(sysc) if sysc else None
        if sid is None:
            sid = self.map.by_domain.get(a.get("domain", ""))
        if sid is None:
            return
        blockers = a.get("blockers", "")
        target = a.get("path") or a.get("name") or a.get("opid") or ""
        what = f"{blockers} {target}".strip()
        detail = {
            "blockers": blockers, "path": target, "domain": a.get("domain", ""), "dev": a.get("dev", ""),
            "pid": sysc.get("pid", ""), "comm": sysc.get("comm", ""), "exe": sysc.get("exe", ""),
            "syscall": sysc.get("syscall", ""), "ses": sysc.get("ses", ""),
        }
        self._emit(Denial(kind="landlock", sandbox_id=sid, what=what, detail=detail))

    def _readonly(self, recs: list[tuple[int, dict[str, str]]]) -> None:
        sysc = recs[0][1]
        sid = self.map.resolve(sysc)
        if sid is None:
            self.fs_ignored += 1  # a host process: read-only mounts refuse them too
            return
        try:
            arch = int(sysc.get("arch", "0"), 16)
            nr = int(sysc.get("syscall", "-1"))
            err = -int(sysc.get("exit", "0"))
        except ValueError:
            return
        name = _READONLY_NAMES.get(nr) if arch == NATIVE_ARCH["x86_64"] else None
        name = name or self._syscall_name(arch, nr)
        cwd = next((f.get("cwd", "") for t, f in recs if t == AUDIT_CWD), "")
        items = sorted((f for t, f in recs if t == AUDIT_PATH), key=lambda f: int(f.get("item", "0") or 0))
        named = [(p, f) for p, f in ((self._path(name, i, f.get("name", ""), cwd, sysc), f) for i, f in enumerate(items)) if p]
        paths = [p for p, _ in named]
        system = [(p, f) for p, f in named if _under(p, self.system_paths)]
        if err == errno.EXDEV and not system:
            return  # a rename/link between two other mounts: what every `mv` across mounts tries first
        path, item = (system or named or [("", {})])[0]
        if not self._fs_limit.take(sid):
            return
        detail = {
            "syscall": str(nr), "syscall_name": name, "errno": errno.errorcode.get(err, str(err)), "path": path,
            "paths": ", ".join(paths), "cwd": cwd, "pid": sysc.get("pid", ""), "comm": sysc.get("comm", ""),
            "exe": sysc.get("exe", ""), "ses": sysc.get("ses", ""),
        }
        if item.get("nametype") == "PARENT":
            detail["path_is_parent"] = "true"  # the kernel names only the directory of a name it never looked up
        held = self._fs_limit.held_back(sid)
        if held:
            detail["held_back"] = str(held)
        self._emit(Denial(kind="fs", sandbox_id=sid, what=f"{name} {path}".strip(), detail=detail))

    @property
    def fs_held(self) -> int:
        """Read-only refusals the per-sandbox buckets held back."""
        return self._fs_limit.held

    @staticmethod
    def _path(syscall: str, item: int, name: str, cwd: str, sysc: dict[str, str]) -> str:
        """A PATH record's name as the sandbox sees it: relative ones are joined to the cwd when
        they were resolved against it (not against some other directory fd)."""
        if not name or name == "(null)":
            return ""
        if name.startswith("/"):
            return name
        if syscall in _AT_CALLS:
            try:
                dirfd = int(sysc.get(_DIRFD_ARG.get((syscall, item), "a0"), "0"), 16) & 0xFFFFFFFF
            except ValueError:
                dirfd = 0
            if dirfd != AT_FDCWD:
                return name
        if not cwd.startswith("/"):
            return name
        joined = posixpath.normpath(posixpath.join(cwd, name))
        return joined + "/" if name.endswith("/") and joined != "/" else joined

    def _emit(self, d: Denial) -> None:
        try:
            self.on_denial(d)
        except Exception:  # noqa: BLE001 - a bad consumer must not stop the reader
            log.exception("denial_handler_failed")


_WANTED = frozenset({AUDIT_SECCOMP, AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL, AUDIT_EOE, AUDIT_PATH, AUDIT_CWD})
_READONLY_NAMES = {nr: name for name, nr in READONLY_SYSCALLS_X86_64.items()}

__all__ = [
    "AUDIT_LOGINUID", "READONLY_KEY", "Denial", "KernelAudit", "ReadonlyRules", "SandboxMap", "audit_rule", "parse_record",
    "readonly_rules",
]
