"""Host side of guard's security profiles: watch and cache KV ``dsec_profiles``, turn a profile
into what this host enforces at sandbox start.

Guard decides (it writes ``SecurityProfile`` documents to the KV bucket); the host agent enforces,
and never asks guard anything: ``ProfileCache`` keeps every profile from a KV watch in memory and
falls back to the built-in profiles in ``bus.profiles`` while the bucket has none,
so a create never waits on guard and keeps working while guard restarts.

``compile_profile`` produces an ``Enforcement``:

- ``seccomp``: the OCI ``linux.seccomp`` object for runc (an allow-list; only the native syscall
  ABI, so i386 ``int 0x80`` and x32 calls are killed by the architecture check).
- ``capabilities``, ``masked_paths``, ``readonly_paths``, ``no_new_privileges`` for the OCI spec.
  A profile without ``no_new_privileges`` (``e2b``: its ``user`` runs ``sudo``) also gets
  ``setup_capabilities``: CAP_SYS_ADMIN, which the agent starts with because installing its
  seccomp filter without no_new_privs needs it, and drops from every set, the bounding set
  included, before it serves anything (``--allow-setuid --setup-cap 21``; it exits if it cannot,
  so no command ever runs with it).
  ``readonly_paths`` become read-only mounts (runc's ``linux.readonlyPaths``); a profile whose
  read-only mount would cover one of its writable or device paths is refused.
- ``agent_args``: the in-sandbox agent's command-line options: its Landlock rules and a second,
  audited seccomp filter (classic BPF compiled here) holding the profile's ``deny`` rules. The
  agent installs both on itself before it serves anything, so every command inherits them.

Why a second filter: runc 1.1 cannot set ``SECCOMP_FILTER_FLAG_LOG``, so refusals of its filter are
invisible to the kernel audit log; the agent's filter carries that flag. It is also where the ioctl
rules really hold: libseccomp drops a conditional rule for a syscall that also has an unconditional
allow rule (``ioctl`` must stay allowed), while the BPF here compares exactly the low 32 bits of the
request, as the kernel does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import platform
import re
import struct
import subprocess
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import msgspec
import structlog

from bus import subjects as S
from bus.errors import InvalidArgument
from bus.messages import FsPolicy, SecurityProfile, SyscallArg, SyscallPolicy

from bus.profiles import builtin_profiles

from ._tasks import cancel_and_wait

log = structlog.get_logger("dsec.hostagent.profiles")

# Audit login uid the agent takes (see dsec-agent --audit-loginuid): marks the audit records of
# sandboxed processes and gives each sandbox its own audit session id. "dsec" in ASCII.
AUDIT_LOGINUID = 0x64736563

_PROFILE_DEC = msgspec.msgpack.Decoder(SecurityProfile)

# linux/capability.h, in number order
CAP_NUMBERS = {name: n for n, name in enumerate((
    "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_DAC_READ_SEARCH", "CAP_FOWNER", "CAP_FSETID", "CAP_KILL", "CAP_SETGID", "CAP_SETUID",
    "CAP_SETPCAP", "CAP_LINUX_IMMUTABLE", "CAP_NET_BIND_SERVICE", "CAP_NET_BROADCAST", "CAP_NET_ADMIN", "CAP_NET_RAW", "CAP_IPC_LOCK",
    "CAP_IPC_OWNER", "CAP_SYS_MODULE", "CAP_SYS_RAWIO", "CAP_SYS_CHROOT", "CAP_SYS_PTRACE", "CAP_SYS_PACCT", "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT", "CAP_SYS_NICE", "CAP_SYS_RESOURCE", "CAP_SYS_TIME", "CAP_SYS_TTY_CONFIG", "CAP_MKNOD", "CAP_LEASE",
    "CAP_AUDIT_WRITE", "CAP_AUDIT_CONTROL", "CAP_SETFCAP", "CAP_MAC_OVERRIDE", "CAP_MAC_ADMIN", "CAP_SYSLOG", "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND", "CAP_AUDIT_READ", "CAP_PERFMON", "CAP_BPF", "CAP_CHECKPOINT_RESTORE",
))}

# --- syscall numbers and architectures ------------------------------------------------------------
_ARCH = {
    # machine: (OCI/libseccomp name, AUDIT_ARCH_*, x32 bit to refuse or 0)
    "x86_64": ("SCMP_ARCH_X86_64", 0xC000003E, 0x40000000),
    "amd64": ("SCMP_ARCH_X86_64", 0xC000003E, 0x40000000),
    "aarch64": ("SCMP_ARCH_AARCH64", 0xC00000B7, 0),
    "arm64": ("SCMP_ARCH_AARCH64", 0xC00000B7, 0),
}
_syscall_table: dict[str, int] | None = None


def native_arch() -> tuple[str, int, int]:
    m = platform.machine()
    if m not in _ARCH:
        raise RuntimeError(f"no seccomp support for machine {m!r}")
    return _ARCH[m]


def syscall_numbers() -> dict[str, int]:
    """name -> number for this machine's native ABI, from the C library's headers (gcc is needed
    anyway to build the sandbox agent)."""
    global _syscall_table
    if _syscall_table is None:
        out = subprocess.run(
            ["gcc", "-dM", "-E", "-x", "c", "-"], input=b"#include <sys/syscall.h>\n", capture_output=True, check=True,
        ).stdout.decode()
        table = {m.group(1): int(m.group(2)) for m in re.finditer(r"#define __NR_(\w+) (\d+)\b", out)}
        if not table:
            raise RuntimeError("could not read syscall numbers from <sys/syscall.h>")
        _syscall_table = table
    return _syscall_table


# --- classic BPF -----------------------------------------------------------------------------------
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_ALU_AND_K = 0x54  # BPF_ALU | BPF_AND | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
SECCOMP_RET_KILL_PROCESS = 0x80000000
SECCOMP_RET_ERRNO = 0x00050000
SECCOMP_RET_ALLOW = 0x7FFF0000
_OFF_NR, _OFF_ARCH, _OFF_ARGS = 0, 4, 16
_INSN = struct.Struct("=HBBI")
BPF_MAXINSNS = 4096


def _insn(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> tuple[int, int, int, int]:
    return (code, jt, jf, k & 0xFFFFFFFF)


def _arg_checks(args: list[SyscallArg], fail: int) -> list[tuple[int, int, int, int]] | None:
    """Instructions that fall through when every comparison holds and jump ``fail`` instructions
    past their own end otherwise (the caller puts the refusal right after them). None for an
    operator this compiler doesn't handle (the runtime's filter still enforces the rule)."""
    out: list[tuple[str, int]] = []  # ("ld" | "and" | "jne", operand) until the jumps are resolved
    for a in args:
        if not 0 <= a.index < 6:
            return None
        if a.op == "masked_eq":
            mask, value = a.mask & (2**64 - 1), a.value & (2**64 - 1)
        elif a.op == "eq":
            mask, value = 2**64 - 1, a.value & (2**64 - 1)
        else:
            return None
        # little-endian: low word first. A mask within 32 bits ignores the high word entirely.
        for word, off in ((mask >> 32, 4), (mask & 0xFFFFFFFF, 0)):
            if not word:
                continue
            expect = (value >> 32 if off else value) & word
            out.append(("ld", _OFF_ARGS + 8 * a.index + off))
            if word != 0xFFFFFFFF:
                out.append(("and", word))
            out.append(("jne", expect))
    # resolve jumps now that the length is known: "jne" jumps to `fail` past the block's end
    n = len(out)
    code: list[tuple[int, int, int, int]] = []
    for i, op in enumerate(out):
        if op[0] == "ld":
            code.append(_insn(_LD_W_ABS, op[1]))
        elif op[0] == "and":
            code.append(_insn(_ALU_AND_K, op[1]))
        else:
            jf = n - i - 1 + fail
            if jf > 255:
                return None
            code.append(_insn(_JEQ_K, op[1], 0, jf))
    return code


def compile_log_filter(policy: SyscallPolicy, table: dict[str, int] | None = None, arch: tuple[str, int, int] | None = None) -> bytes:
    """The audited seccomp filter for the agent: the profile's ``deny`` rules (EPERM) and, with
    ``native_only``, the architecture check (kill). Everything else is allowed here; the
    runtime's allow-list filter decides the rest."""
    table = table if table is not None else syscall_numbers()
    _, audit_arch, x32_bit = arch or native_arch()
    prog: list[tuple[int, int, int, int]] = [_insn(_LD_W_ABS, _OFF_ARCH)]
    if policy.native_only:
        prog += [_insn(_JEQ_K, audit_arch, 1, 0), _insn(_RET_K, SECCOMP_RET_KILL_PROCESS)]
    else:
        prog += [_insn(_JEQ_K, audit_arch, 1, 0), _insn(_RET_K, SECCOMP_RET_ALLOW)]
    prog.append(_insn(_LD_W_ABS, _OFF_NR))
    if policy.native_only and x32_bit:
        prog += [_insn(_JGE_K, x32_bit, 0, 1), _insn(_RET_K, SECCOMP_RET_KILL_PROCESS)]
    for rule in policy.deny:
        ret = _insn(_RET_K, SECCOMP_RET_ERRNO | (rule.errno & 0xFFFF))
        for name in rule.names:
            nr = table.get(name)
            if nr is None:
                continue  # not a syscall on this architecture
            if not rule.args:
                prog += [_insn(_JEQ_K, nr, 0, 1), ret]
                continue
            # jeq nr ? fall into block : skip it;  block = checks, ret errno, reload nr
            checks = _arg_checks(rule.args, fail=1)
            if checks is None:
                log.warning("seccomp_rule_not_audited", syscall=name, args=str(rule.args))
                continue
            block = [*checks, ret, _insn(_LD_W_ABS, _OFF_NR)]
            prog += [_insn(_JEQ_K, nr, 0, len(block)), *block]
    prog.append(_insn(_RET_K, SECCOMP_RET_ALLOW))
    if len(prog) > BPF_MAXINSNS:
        raise ValueError(f"seccomp filter of {len(prog)} instructions exceeds {BPF_MAXINSNS}")
    return b"".join(_INSN.pack(*i) for i in prog)


# --- OCI seccomp -------------------------------------------------------------------------------------
_OCI_OPS = {
    "eq": "SCMP_CMP_EQ", "ne": "SCMP_CMP_NE", "lt": "SCMP_CMP_LT", "le": "SCMP_CMP_LE",
    "gt": "SCMP_CMP_GT", "ge": "SCMP_CMP_GE", "masked_eq": "SCMP_CMP_MASKED_EQ",
}


def _oci_arg(a: SyscallArg) -> dict[str, Any]:
    op = _OCI_OPS.get(a.op)
    if op is None:
        raise InvalidArgument(f"unknown syscall argument operator {a.op!r}")
    if a.op == "masked_eq":
        return {"index": a.index, "value": a.mask, "valueTwo": a.value, "op": op}
    return {"index": a.index, "value": a.value, "op": op}


def compile_oci_seccomp(policy: SyscallPolicy, arch: tuple[str, int, int] | None = None) -> dict[str, Any]:
    """The OCI ``linux.seccomp`` object: default EPERM, the profile's allow rules, explicit denials."""
    oci_arch = (arch or native_arch())[0]
    unconditional_deny = {n for r in policy.deny if not r.args for n in r.names}
    allow = [n for n in dict.fromkeys(policy.allow) if n not in unconditional_deny and n not in policy.enosys]
    conditional_allow = {n for r in policy.allow_if for n in r.names}
    rules: list[dict[str, Any]] = [{"names": allow, "action": "SCMP_ACT_ALLOW"}]
    for r in policy.allow_if:
        names = [n for n in r.names if n not in unconditional_deny]
        if names:
            rules.append({"names": names, "action": "SCMP_ACT_ALLOW", "args": [_oci_arg(a) for a in r.args]})
    for r in policy.deny:
        if not r.args:
            rules.append({"names": list(r.names), "action": "SCMP_ACT_ERRNO", "errnoRet": r.errno})
            continue
        # A conditional denial of a call that is otherwise unlisted is what the default does
        # already; next to an unconditional allow libseccomp would drop it (the agent's filter
        # holds it); next to conditional allows it is their complement. Only emit it alone.
        names = [n for n in r.names if n not in allow and n not in conditional_allow]
        if names:
            rules.append({"names": names, "action": "SCMP_ACT_ERRNO", "errnoRet": r.errno, "args": [_oci_arg(a) for a in r.args]})
    if policy.enosys:
        rules.append({"names": list(policy.enosys), "action": "SCMP_ACT_ERRNO", "errnoRet": 38})
    return {
        "defaultAction": "SCMP_ACT_ERRNO",
        "defaultErrnoRet": policy.default_errno,
        "architectures": [oci_arch] if policy.native_only else [],
        "syscalls": rules,
    }


# --- Landlock ------------------------------------------------------------------------------------------
def landlock_args(fs: FsPolicy) -> list[str]:
    if not fs.landlock:
        return []
    args: list[str] = []
    for flag, paths in (("--landlock-ro", fs.read_only), ("--landlock-rw", fs.writable), ("--landlock-dev", fs.devices)):
        for p in paths:
            if not p.startswith("/"):
                raise InvalidArgument(f"profile path {p!r} is not absolute")
            args += [flag, os.path.normpath(p)]
    if not fs.read_only and not fs.writable and not fs.devices:
        args += ["--landlock-rw", "/"]  # Landlock on, nothing restricted: keeps the rest uniform
    if fs.required:
        args.append("--landlock-required")
    return args


def readonly_mounts(fs: FsPolicy) -> tuple[str, ...]:
    """``fs.readonly_paths`` checked: absolute, and none covering a writable or device path (a
    read-only mount takes everything beneath it, so /tmp under a read-only / would stop working)."""
    out: list[str] = []
    for p in fs.readonly_paths:
        if not p.startswith("/"):
            raise InvalidArgument(f"read-only mount path {p!r} is not absolute")
        p = os.path.normpath(p)
        for w in (*fs.writable, *fs.devices):
            w = os.path.normpath(w)
            if w == p or w.startswith(p.rstrip("/") + "/"):
                raise InvalidArgument(f"read-only mount {p!r} would cover writable path {w!r}")
        out.append(p)
    return tuple(dict.fromkeys(out))


# --- enforcement -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Enforcement:
    """What the host applies to one sandbox, compiled from its profile."""

    profile: str
    version: int
    seccomp: dict[str, Any] | None
    capabilities: tuple[str, ...]
    masked_paths: tuple[str, ...]
    readonly_paths: tuple[str, ...]
    no_new_privileges: bool
    agent_args: tuple[str, ...]
    landlock_required: bool
    setup_capabilities: tuple[str, ...] = ()

    @cached_property
    def fingerprint(self) -> str:
        """Digest of everything that shapes the container: a warm container started for one
        fingerprint must never serve a sandbox whose profile compiles to another (a profile can
        change under the same name and version)."""
        doc = [self.seccomp, self.capabilities, self.masked_paths, self.readonly_paths, self.no_new_privileges,
               self.agent_args, self.landlock_required, self.setup_capabilities]
        return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:32]


def compile_profile(p: SecurityProfile) -> Enforcement:
    caps = tuple(c if c.startswith("CAP_") else f"CAP_{c}" for c in (x.upper() for x in p.capabilities))
    bpf = compile_log_filter(p.syscalls)
    args = [*landlock_args(p.fs), "--seccomp-bpf", bpf.hex(), "--audit-loginuid", str(AUDIT_LOGINUID)]
    setup: tuple[str, ...] = ()
    if not p.no_new_privileges:
        # Without no_new_privs a seccomp filter (and Landlock) can only be installed holding
        # CAP_SYS_ADMIN: lent to the agent outside the bounding set, dropped by it before it serves.
        setup = tuple(c for c in ("CAP_SYS_ADMIN",) if c not in caps)
        args += ["--allow-setuid", *(a for c in setup for a in ("--setup-cap", str(CAP_NUMBERS[c])))]
    return Enforcement(
        profile=p.name,
        version=p.version,
        seccomp=compile_oci_seccomp(p.syscalls),
        capabilities=caps,
        masked_paths=tuple(p.fs.masked_paths),
        readonly_paths=readonly_mounts(p.fs),
        no_new_privileges=p.no_new_privileges,
        agent_args=tuple(args),
        landlock_required=p.fs.landlock and p.fs.required,
        setup_capabilities=setup,
    )


class UnknownProfile(InvalidArgument):
    pass


class ProfileCache:
    """Every profile in KV ``dsec_profiles``, kept current by a watch; built-ins fill the gaps."""

    def __init__(self, builtin: dict[str, SecurityProfile] | None = None) -> None:
        self.builtin = builtin if builtin is not None else builtin_profiles()
        self.profiles: dict[str, SecurityProfile] = {}
        self._compiled: dict[tuple[str, int, bytes], Enforcement] = {}
        self._watcher: Any = None
        self._task: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()

    async def start(self, js: Any, *, initial_timeout_s: float = 5.0) -> None:
        """Watch the bucket; returns once what it holds now is loaded (or after the timeout)."""
        from bus.streams import ensure_kv

        kv = await ensure_kv(js, S.KV_PROFILES)
        self._watcher = await kv.watchall()
        self._task = asyncio.create_task(self._run(), name="profiles-watch")
        try:
            await asyncio.wait_for(self.synced.wait(), initial_timeout_s)
        except asyncio.TimeoutError:
            log.warning("profiles_initial_sync_timeout", builtin=sorted(self.builtin))

    async def stop(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:  # noqa: BLE001 - connection may be gone
                pass
            self._watcher = None

    async def _run(self) -> None:
        assert self._watcher is not None
        async for entry in self._watcher:
            if entry is None:
                self.synced.set()
                continue
            if entry.operation in ("DEL", "PURGE"):
                self.profiles.pop(entry.key, None)
                log.info("profile_removed", profile=entry.key)
                continue
            try:
                p = _PROFILE_DEC.decode(entry.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("bad_profile", profile=entry.key, error=str(exc))
                continue
            try:
                compile_profile(p)  # refuse what we could not enforce, keep the last good one
            except Exception as exc:  # noqa: BLE001
                log.warning("profile_not_enforceable", profile=entry.key, error=str(exc))
                continue
            self.profiles[entry.key] = p
            log.info("profile_loaded", profile=entry.key, version=p.version, revision=entry.revision)

    def get(self, name: str) -> SecurityProfile:
        p = self.profiles.get(name) or self.builtin.get(name)
        if p is None:
            raise UnknownProfile(f"unknown security profile {name!r}")
        return p

    def enforcement(self, name: str) -> Enforcement:
        p = self.get(name or "default")
        key = (p.name, p.version, msgspec.msgpack.encode(p))
        enf = self._compiled.get(key)
        if enf is None:
            enf = self._compiled[key] = compile_profile(p)
        return enf


__all__ = [
    "AUDIT_LOGINUID",
    "CAP_NUMBERS",
    "Enforcement",
    "ProfileCache",
    "UnknownProfile",
    "compile_log_filter",
    "compile_oci_seccomp",
    "compile_profile",
    "landlock_args",
    "native_arch",
    "readonly_mounts",
    "syscall_numbers",
]
