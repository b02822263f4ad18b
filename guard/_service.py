"""The guard service: publishes the security profiles and watches for sandboxes that break them.

- At start it writes its built-in profiles to KV ``dsec_profiles`` (idempotent: only a missing
  profile or an older version is replaced; the bucket keeps earlier revisions).
- The audit watcher consumes DSEC_EVT with the durable ``guard-audit`` consumer (sandbox
  lifecycle, violations reported by other components) and, on a host, the kernel's audit records
  of seccomp and Landlock denials and of writes refused by the read-only system paths
  (``KernelAudit``; kind ``fs``, acted on like Landlock's: both enforce the profile's ``fs``).
  Each denial becomes a ``GuardViolation`` on ``dsec.evt.guard.violation``; the sandbox's profile
  says what follows: ``record``, ``kill`` (a core request to ``dsec.sbx.<id>.kill``) or
  ``quarantine`` (kill, and the violation is kept in KV ``dsec_quarantine`` under the sandbox id
  so a trainer can discard the episode).
- ``drops_only``: a guard for one network namespace's dropped packets and nothing else -- a host
  that has a namespace of its own on a machine (``dsec up --hosts``), where the machine's guard
  publishes the profiles, consumes the events and reads the kernel audit (which is the machine's,
  not a namespace's). NFLOG is per network namespace: only a reader inside the host's namespace
  sees what the host's agent logs. It sees no lifecycle events (the audit consumer is the machine
  guard's), so it forgets a sandbox when the sandbox's veth is gone (``SWEEP_S``).

The kernel names a process's cgroup, which is named after its container: a sandbox served by a
warm-pool container or a later generation's runs in one of another name. Its record carries that
name (``SandboxRecord.container_id``); guard watches the records and reports (and acts) under the
sandbox's id. A denial of such a container whose record has not arrived yet waits for it a little.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, get_args

import msgspec
import structlog
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest, DsecError
from bus.messages import (
    WARM_CONTAINER_PREFIX, AuditPolicy, GuardViolation, KillRequest, ReadyMany, SandboxEvent, SandboxRecord, SecurityProfile,
    ViolationAction,
)
from bus.runtime import KV, Service, Watch
from bus.streams import ensure_all

from ._config import GuardConfig
from ._kernel import Denial, KernelAudit
from ._nflog import NflogError, NflogReader
from bus.profiles import builtin_profiles

log = structlog.get_logger("dsec.guard")

_PROFILE_DEC = msgspec.msgpack.Decoder(SecurityProfile)
AGENT_EXE = "/.dsec/bin/dsec-agent"  # the sandbox's own agent: acts for the host API, never killed for it
SOURCE = "guard.kernel"
SWEEP_S = 30.0  # drops_only: how often sandboxes whose veth has gone are forgotten
ACTIONS: tuple[ViolationAction, ...] = get_args(ViolationAction)
ALIAS_WAIT_S = 5.0  # how long a denial of a container named for no sandbox waits for the record naming it
ALIASES_MAX = 100_000  # container -> sandbox entries kept (the oldest go first)
PENDING_MAX = 64  # denials of one such container held while it waits
_GENERATION = re.compile(r"-g\d+$")


def is_alias(cid: str) -> bool:
    """A container id that is not its sandbox's own: a warm-pool container's or a later generation's."""
    return cid.startswith(WARM_CONTAINER_PREFIX) or _GENERATION.search(cid) is not None


def _same(a: SecurityProfile, b: SecurityProfile) -> bool:
    return msgspec.structs.replace(a, updated_at=0.0) == msgspec.structs.replace(b, updated_at=0.0)


async def publish_profiles(kv: KeyValue, profiles: Iterable[SecurityProfile]) -> dict[str, str]:
    """Write each profile unless the bucket already holds it at the same or a newer version.

    Returns what happened per profile: created, updated, kept. Safe with several guards racing.
    """
    done: dict[str, str] = {}
    for p in profiles:
        for _ in range(5):
            try:
                entry = await kv.get(p.name)
            except KeyNotFoundError:
                entry = None
            doc = msgspec.structs.replace(p, updated_at=time.time())
            try:
                if entry is None or not entry.value:
                    await kv.create(p.name, codec.encode(doc))
                    done[p.name] = "created"
                    break
                try:
                    cur = _PROFILE_DEC.decode(entry.value)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    cur = None
                if cur is not None and cur.version >= p.version:
                    if cur.version == p.version and not _same(cur, p):
                        log.warning("profile_differs_at_same_version", profile=p.name, version=p.version,
                                    note="kept the stored one; bump the version to replace it")
                    done[p.name] = "kept"
                    break
                await kv.update(p.name, codec.encode(doc), last=entry.revision)
                done[p.name] = "updated"
                break
            except KeyWrongLastSequenceError:
                continue  # another guard wrote meanwhile: look again
    return done


class Guard(Service):
    name = "guard"

    def __init__(self, nats_url: str | None = None, *, config: GuardConfig | None = None, **settings: Any) -> None:
        """``config`` as ``python -m guard`` builds it from its flags; ``settings`` replace single fields of it."""
        cfg = replace(config or GuardConfig(), **settings)
        if nats_url is not None:
            cfg = replace(cfg, nats_url=nats_url)
        super().__init__(cfg.nats_url, grace_s=cfg.grace_s)
        self.config = cfg
        self.host_id = cfg.host_id or socket.gethostname().split(".")[0]
        self.kernel_audit = cfg.kernel_audit
        self.enable_audit = cfg.enable_audit
        self.cgroup_parent = cfg.cgroup_parent
        self.builtin = cfg.profiles if cfg.profiles is not None else builtin_profiles()
        self.report_interval_s = cfg.report_interval_s
        self.stream_options = cfg.stream_options
        self.kernel: KernelAudit | None = None
        self.readonly_audit = cfg.readonly_audit  # audit rules for calls refused by read-only mounts (see ReadonlyRules)
        self.drops_only = cfg.drops_only
        self.nflog_group = cfg.nflog()  # None: don't read dropped packets (run one per sandbox host)
        self.net_report_rate_per_s = cfg.net_report_rate_per_s
        self.net_report_burst = cfg.net_report_burst
        self.nflog: NflogReader | None = None
        self.profiles: dict[str, SecurityProfile] = {}
        self.published: dict[str, str] = {}
        self.violations = 0
        self._violations = self.metrics.counter("dsec_guard_violations_total", "Violations guard reported, by kind and action taken", ["kind", "action"])
        self._kv_profiles: KeyValue | None = None
        self._kv_sbx: KV[SandboxRecord] | None = None
        self._kv_quarantine: KV[GuardViolation] | None = None
        self._profiles_watch: Watch[SecurityProfile] | None = None
        self._records_watch: Watch[SandboxRecord] | None = None
        self._by_container: dict[str, str] = {}  # container id -> sandbox id, for containers not named after theirs
        self._container_of: dict[str, str] = {}  # the reverse (a deleted record drops its entry)
        self._alias_seen = asyncio.Event()  # set (and replaced) whenever an entry arrives
        self._unresolved: dict[str, list[Denial]] = {}  # denials of a container waiting for its record
        self._sandbox_profile: dict[str, tuple[str, str]] = {}  # sandbox -> (profile, host id), from its record
        self._enforced: set[str] = set()
        self._gone: dict[str, float] = {}
        self._last: dict[tuple[str, str, str, bool], tuple[float, int]] = {}

    # --- lifecycle --------------------------------------------------------------------------
    async def setup(self) -> None:
        assert self.js is not None
        await ensure_all(self.js, self.stream_options)
        profiles_kv = await KV.open(self.js, S.KV_PROFILES, SecurityProfile)
        self._kv_profiles = profiles_kv.raw
        self._kv_sbx = await KV.open(self.js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
        self._kv_quarantine = await KV.open(self.js, S.KV_QUARANTINE, GuardViolation)
        if not self.drops_only:
            self.published = await publish_profiles(self._kv_profiles, self.builtin.values())
            log.info("profiles_published", **self.published)
        # not self.spawn(): it runs until teardown, which shutdown reaches only after spawned work ends
        self._profiles_watch = await profiles_kv.watch(self._on_profile, self._on_profile_gone)
        if self.drops_only:
            await self._start_nflog()
            if self.nflog is not None:
                self.spawn(self._sweep_loop(), name="guard-sweep")
            return
        self._records_watch = await self._kv_sbx.watch(self._on_record, self._on_record_gone)
        # The audit consumer starts at new events when first created (no replay of old history).
        await self.add_worker(
            stream=S.STREAM_EVT, durable=S.GUARD_AUDIT_DURABLE, filter_subject=f"{S.PREFIX}.evt.>",
            handler=self._on_event, capacity=64, ack_wait_s=30.0, deliver_policy=DeliverPolicy.NEW, name="guard-audit",
        )
        if self.kernel_audit:
            k = KernelAudit(
                self._on_denial, cgroup_parent=self.cgroup_parent, enable_audit=self.enable_audit, readonly_audit=self.readonly_audit,
            )
            try:
                await k.start()
                self.kernel = k
            except OSError as exc:
                log.warning("kernel_audit_unavailable", error=str(exc), note="needs root (CAP_AUDIT_READ) on the host")
            await self._start_nflog()  # the same host-side duty as the audit reader

    async def _start_nflog(self) -> None:
        if self.nflog_group is None:
            return
        r = NflogReader(self._on_denial, group=self.nflog_group, rate_per_s=self.net_report_rate_per_s, burst=self.net_report_burst)
        try:
            await r.start()
            self.nflog = r
        except NflogError as exc:
            log.warning("nflog_unavailable", error=str(exc), note="needs CAP_NET_ADMIN in the host netns; dropped packets go unreported")

    async def _sweep_loop(self) -> None:
        while not await self.pause(SWEEP_S):
            if self.nflog is not None:
                for sid in self.nflog.sweep():  # a look-up per cached veth: a few sandboxes' worth
                    self._forget_reports(sid)

    async def teardown(self) -> None:
        if self.kernel is not None:
            await self.kernel.stop()
        if self.nflog is not None:
            await self.nflog.stop()
        if self._profiles_watch is not None:
            await self._profiles_watch.stop()
        if self._records_watch is not None:
            await self._records_watch.stop()

    def _on_profile(self, name: str, p: SecurityProfile, _rev: int) -> None:
        self.profiles[name] = p

    def _on_profile_gone(self, name: str) -> None:
        self.profiles.pop(name, None)

    # --- which sandbox a container serves ---------------------------------------------------------
    def _on_record(self, sid: str, rec: SandboxRecord, _rev: int) -> None:
        cid = rec.container_id
        if not cid or cid == sid:
            return
        # Kept after the sandbox ended: a late record of its last process still names its sandbox.
        if self._container_of.get(sid) not in (None, cid):
            self._by_container.pop(self._container_of[sid], None)
        self._container_of[sid] = cid
        self._by_container.pop(cid, None)  # re-inserted last: the oldest entries go first
        self._by_container[cid] = sid
        while len(self._by_container) > ALIASES_MAX:
            old = next(iter(self._by_container))
            self._container_of.pop(self._by_container.pop(old), None)
        self._alias_seen.set()
        self._alias_seen = asyncio.Event()

    def _on_record_gone(self, sid: str) -> None:
        cid = self._container_of.pop(sid, None)
        if cid is not None:
            self._by_container.pop(cid, None)

    def sandbox_of(self, container_id: str) -> str | None:
        """The sandbox a container serves, when the container is not named after it (None: unknown)."""
        return self._by_container.get(container_id)

    async def _resolve_later(self, cid: str) -> None:
        """Waits for the record naming container ``cid`` (a warm container's record is written when it
        is claimed, and the watch may lag), then reports what it held back; under the container's id
        when none comes (a warm container serving no sandbox yet)."""
        deadline = time.monotonic() + ALIAS_WAIT_S
        try:
            if not cid.startswith(WARM_CONTAINER_PREFIX) and self._kv_sbx is not None and await self._kv_sbx.get(cid) is not None:
                deadline = 0.0  # a sandbox's own id that merely looks like a generation's
            while cid not in self._by_container and (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(self._alias_seen.wait(), left)
                except asyncio.TimeoutError:
                    break
        except Exception as exc:  # noqa: BLE001 - the KV away: what is known now decides
            log.warning("container_lookup_failed", container=cid, error=str(exc))
        sid = self._by_container.get(cid)
        if sid is None:
            log.warning("container_of_no_sandbox", container=cid, note="reported under the container's id")
        for d in self._unresolved.pop(cid, []):
            self._report(d if sid is None else self._as_sandbox(d, sid))

    @staticmethod
    def _as_sandbox(d: Denial, sid: str) -> Denial:
        return replace(d, sandbox_id=sid, detail={**d.detail, "container_id": d.sandbox_id})

    # --- policy ---------------------------------------------------------------------------------
    async def _sandbox(self, sid: str) -> tuple[str, str]:
        """The sandbox's profile name and the host it runs on, from its record (read once). The host
        is the record's: one machine may run several hosts (``dsec up --hosts``) under one guard
        reading the kernel's audit, whose own host id names none of them."""
        known = self._sandbox_profile.get(sid)
        if known is None:
            rec = await self._kv_sbx.get(sid) if self._kv_sbx is not None else None  # missing or undecodable: the default profile
            known = ((rec.spec.profile if rec is not None else "") or "default", (rec.host_id if rec is not None else "") or self.host_id)
            if self._kv_sbx is not None:
                self._sandbox_profile[sid] = known
        return known

    async def _audit_policy(self, sid: str) -> AuditPolicy:
        return self._policy_named((await self._sandbox(sid))[0])

    def _policy_named(self, name: str) -> AuditPolicy:
        p = self.profiles.get(name) or self.builtin.get(name) or self.builtin.get("default")
        return p.audit if p is not None else AuditPolicy()

    @staticmethod
    def _action(policy: AuditPolicy, kind: str) -> ViolationAction:
        # "fs": the read-only mounts and Landlock enforce one filesystem policy (the system paths
        # are in both, and the mount refuses first), so one action for both.
        kind = "landlock" if kind == "fs" else kind
        a = getattr(policy, kind, None) if kind in ("seccomp", "landlock") else policy.other
        # A profile is data (KV): an action this guard does not know is recorded, never guessed at.
        return next((x for x in ACTIONS if x == a), "record")

    # --- kernel denials ---------------------------------------------------------------------------
    def _on_denial(self, d: Denial) -> None:
        """Called by the kernel reader for every denial, named by its container: reported under the
        sandbox that container serves (see the module's doc)."""
        sid = self._by_container.get(d.sandbox_id)
        if sid is not None:
            d = self._as_sandbox(d, sid)
        elif is_alias(d.sandbox_id):
            held = self._unresolved.get(d.sandbox_id)
            if held is None:
                self._unresolved[d.sandbox_id] = [d]
                self.spawn(self._resolve_later(d.sandbox_id))
            elif len(held) < PENDING_MAX:
                held.append(d)
            return
        self._report(d)

    def _report(self, d: Denial) -> None:
        """The same denial of the same sandbox is reported at most once per ``report_interval_s``
        (the next report counts the repeats). The first report also carries out the policy, so
        folding repeats never skips a kill."""
        if d.sandbox_id in self._gone:
            return
        by_agent = d.detail.get("exe") == AGENT_EXE
        key = (d.sandbox_id, d.kind, d.what, by_agent)
        now = time.monotonic()
        last, suppressed = self._last.get(key, (0.0, 0))
        if now - last < self.report_interval_s:
            self._last[key] = (last, suppressed + 1)
            return
        self._last[key] = (now, 0)
        self.violations += 1  # counted when decided, so a test can tell when every report is out
        self.spawn(self._handle_denial(d, by_agent, suppressed))

    async def _handle_denial(self, d: Denial, by_agent: bool, suppressed: int) -> None:
        profile, host_id = await self._sandbox(d.sandbox_id)  # one record read for both
        policy = self._policy_named(profile)
        action = "record" if by_agent else self._action(policy, d.kind)  # the agent works for the host API
        detail = {k: v for k, v in d.detail.items() if v}
        detail["source"] = SOURCE
        if d.killed:
            detail["process_killed"] = "true"
        if by_agent:
            detail["process"] = "agent"
        if suppressed:
            detail["suppressed"] = str(suppressed)
        v = GuardViolation(
            sandbox_id=d.sandbox_id, at=time.time(), kind=d.kind, what=d.what, action=action,
            host_id=host_id, detail=detail,
        )
        log.info("guard_violation", sandbox_id=d.sandbox_id, kind=d.kind, what=d.what, action=action)
        self._violations.inc(kind=d.kind, action=action)
        assert self.publisher is not None
        try:
            await self.publisher.store(S.EVT_GUARD_VIOLATION, codec.encode(v))
        except Exception as exc:  # noqa: BLE001
            log.warning("violation_publish_failed", error=str(exc))
        if action != "record":
            await self._enforce(v)

    async def _enforce(self, v: GuardViolation) -> None:
        sid = v.sandbox_id
        if sid in self._enforced:
            return
        self._enforced.add(sid)
        if v.action == "quarantine" and self._kv_quarantine is not None:
            try:
                await self._kv_quarantine.put(sid, v)
            except Exception as exc:  # noqa: BLE001
                log.warning("quarantine_record_failed", sandbox_id=sid, error=str(exc))
        assert self.nc is not None
        reason = f"guard-{v.action}: {v.kind} {v.what}"[:200]
        try:
            reply = await self.nc.request(S.sbx(sid, "kill"), codec.encode(KillRequest(reason=reason)), timeout=15)
            codec.decode_reply(reply.data, codec.REPLY_TYPES["kill"])
            log.info("sandbox_killed_by_guard", sandbox_id=sid, reason=reason)
        except DsecError as exc:
            log.warning("guard_kill_refused", sandbox_id=sid, code=exc.code, error=str(exc))
        except Exception as exc:  # noqa: BLE001 - no responders, timeout
            log.warning("guard_kill_failed", sandbox_id=sid, error=repr(exc))

    # --- DSEC_EVT --------------------------------------------------------------------------------
    async def _on_event(self, msg: Msg) -> None:
        try:
            ev = codec.EVENT.decode(msg.data)
        except BadRequest:
            await msg.ack()
            return
        try:
            if isinstance(ev, SandboxEvent):
                if ev.kind in ("killed", "failed", "timeout", "lost"):
                    self._forget(ev.sandbox_id)
                elif ev.kind in ("ready", "recovered"):
                    self._gone.pop(ev.sandbox_id, None)
            elif isinstance(ev, ReadyMany):  # a host batch's members, ready together
                for sid in ev.sandbox_ids:
                    self._gone.pop(sid, None)
            elif isinstance(ev, GuardViolation) and ev.detail.get("source") != SOURCE and ev.sandbox_id not in self._gone:
                # Reported by another component (say, the network filter): apply the profile.
                action = self._action(await self._audit_policy(ev.sandbox_id), ev.kind)
                if action != "record" and ev.action == "record":
                    await self._enforce(msgspec.structs.replace(ev, action=action))
        except Exception:  # noqa: BLE001 - one bad event must not wedge the consumer
            log.exception("audit_event_failed", subject=msg.subject)
        await msg.ack()

    def _forget(self, sid: str) -> None:
        self._gone[sid] = time.monotonic()
        self._forget_reports(sid)
        if self.kernel is not None:
            self.kernel.forget(sid)
            cid = self._container_of.get(sid)
            if cid is not None:
                self.kernel.forget(cid)  # the kernel reader knows it by its container's name
        if self.nflog is not None:
            self.nflog.forget(sid)
        if len(self._gone) > 10000:  # bounded memory: drop the oldest
            for old in sorted(self._gone, key=self._gone.__getitem__)[:5000]:
                del self._gone[old]

    def _forget_reports(self, sid: str) -> None:
        self._sandbox_profile.pop(sid, None)
        self._enforced.discard(sid)
        for k in [k for k in self._last if k[0] == sid]:
            del self._last[k]


__all__ = ["Guard", "publish_profiles"]
