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
import os
import re
import socket
import struct
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("dsec.guard.kernel")

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1
AUDIT_GET = 1000
AUDIT_SET = 1001
AUDIT_STATUS_ENABLED = 0x0001
AUDIT_STATUS_BACKLOG_LIMIT = 0x0010
NLMSG_ERROR = 2
NLM_F_REQUEST, NLM_F_ACK = 1, 4

AUDIT_SYSCALL = 1300
AUDIT_EOE = 1320
AUDIT_SECCOMP = 1326
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424

AUDIT_LOGINUID = 0x64736563  # the agents' marker login uid ("dsec"); see hostagent/_profiles.py
AUDIT_UID_UNSET = 4294967295
ARCH_NAMES = {0xC000003E: "x86_64", 0x40000003: "i386", 0xC00000B7: "aarch64", 0x40000028: "arm"}

_NLMSG = struct.Struct("=IHHII")
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
        elif k in ("comm", "exe", "path", "proctitle", "name") and re.fullmatch(r"(?:[0-9A-F]{2})+", v):
            try:
                v = bytes.fromhex(v).decode(errors="replace").replace("\x00", " ")
            except ValueError:
                pass
        fields.setdefault(k, v)
    return serial, fields


@dataclass
class Denial:
    """One refused operation of a sandboxed process, as the kernel reported it."""

    kind: str  # seccomp | landlock
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
    ) -> None:
        self.on_denial = on_denial
        self.map = sandbox_map or SandboxMap(cgroup_parent)
        self.enable_audit = enable_audit
        self.backlog_limit = backlog_limit
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
        return dict(zip(names, vals))

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
        log.info("kernel_audit_reader_started", audit_enabled=self.audit_enabled)

    async def stop(self) -> None:
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
        for _ in range(1024):
            try:
                data = self._sock.recv(65536)
            except BlockingIOError:
                break
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:
                    log.warning("kernel_audit_overrun", note="records were lost: the reader fell behind")
                    continue
                raise
            pos = 0
            while pos + _NLMSG.size <= len(data):
                length, rtype, _, _, _ = _NLMSG.unpack_from(data, pos)
                if length < _NLMSG.size:
                    break
                text = data[pos + _NLMSG.size:pos + length].rstrip(b"\0").decode(errors="replace")
                self.feed(rtype, text)
                pos += (length + 3) & ~3
        self._schedule_flush()

    def feed(self, rtype: int, text: str) -> None:
        """Take one audit record (also the entry point for tests)."""
        if rtype not in (AUDIT_SECCOMP, AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL, AUDIT_EOE):
            return
        self.records += 1
        serial, f = parse_record(text)
        if rtype == AUDIT_SECCOMP:
            self._seccomp(f)
            return
        if rtype == AUDIT_LANDLOCK_DOMAIN:
            if f.get("status") == "allocated" and f.get("domain") and f.get("pid"):
                sid = self.map.of_pid(f["pid"])
                if sid:
                    self.map.by_domain[f["domain"]] = sid
            if f.get("status") == "deallocated":
                self.map.by_domain.pop(f.get("domain", ""), None)
            if serial in self._pending:
                self._pending[serial].append((rtype, f))
            return
        if rtype == AUDIT_LANDLOCK_ACCESS:
            self._pending.setdefault(serial, []).append((rtype, f))
            return
        if serial not in self._pending:
            return  # a SYSCALL/EOE record of an event that isn't a Landlock denial
        if rtype == AUDIT_EOE:
            self._landlock(self._pending.pop(serial))
        else:
            self._pending[serial].append((rtype, f))

    def _schedule_flush(self) -> None:
        if self._pending and self._flush_handle is None and self._loop is not None:
            self._flush_handle = self._loop.call_later(0.2, self._flush)

    def _flush(self) -> None:
        """Landlock events without an EOE record (tasks without an audit context) after a grace."""
        self._flush_handle = None
        for serial in list(self._pending):
            self._landlock(self._pending.pop(serial))

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

    def _emit(self, d: Denial) -> None:
        try:
            self.on_denial(d)
        except Exception:  # noqa: BLE001 - a bad consumer must not stop the reader
            log.exception("denial_handler_failed")


__all__ = ["AUDIT_LOGINUID", "Denial", "KernelAudit", "SandboxMap", "parse_record"]
