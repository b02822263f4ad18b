"""Red team: forged and replayed control messages against a real stack with NATS authentication.

The stack (``make_stack(auth=True)``) is what ``dsec up`` runs: nats-server with the
``bus.auth.AuthConfig`` users file (each service its own user and permissions, each client a
tenant; nothing without credentials), placement and a host agent with the container backend
connected as their roles. Attackers are a client tenant (``stack.client_url``, what an API key
gets), another named client (``issue_client_credential``) and a sandbox-scoped credential
(``issue_sandbox_credential``); tenant against tenant is tests/security/test_tenants.py.

Every attack asserts one specific rejection: a NATS permissions violation for that subject, a typed
dsec error code (an ``ErrorReply`` or a ``failed`` event with its ``code``, or a dead letter with
its ``Dsec-Error-Code``), or provably no effect (the stream, key, or sandbox it aimed at unchanged;
no create ever started on the host). Each group also has a positive control: the principal that is
meant to do the thing can.

Replay. Creates travel on JetStream: the SDK publishes each with ``Nats-Msg-Id = <sandbox id>``, so
a copy within the de-duplication window is dropped by the stream; after the window, placement hands
a request asked for more than half a window ago to its host with ``claim``, and the host claims the
id in KV before it starts anything, so a killed sandbox is never started again; a request past its
``create_deadline`` is refused by placement and by the host with ``timeout``. Kill is idempotent.
Exec (and files) are core request/reply, never stored: replaying one needs a copy of the request,
and nobody but host agents may subscribe to ``dsec.sbx.>`` (asserted below); anyone who may publish
there could send the same request fresh, so exec is not de-duplicated.

The run ends with the red-team tally (``conftest.RedTeam``): the number of attacks blocked.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import nats
import nats.errors
from nats.js.errors import KeyNotFoundError
import pytest

from bus import codec
from bus import subjects as S
from bus.errors import BadRequest
from bus.messages import (
    HandoffReply,
    CreateSandbox,
    Done,
    ExecRequest,
    ExecResult,
    GuardViolation,
    HostEvent,
    HostStatus,
    InfoRequest,
    KillRequest,
    LayerRef,
    PlaceSandbox,
    SandboxEvent,
    SandboxInfo,
    SandboxRecord,
    SandboxSpec,
    SecurityProfile,
    TemplateManifest,
)
from bus.auth import inbox_prefix
from bus.sign import sign_headers
from sdk import AsyncSandbox, build_spec
from tests.conftest import eventually
from tests.conftest import needs
from tests.security.conftest import SKIP_REASON, Principal, RedTeam, SecStack

pytestmark = needs(SKIP_REASON)

DEDUP_S = 3.0  # the replay test's stream de-duplication window (production: 120 s)


# ------------------------------------------------------------------------------------------ helpers
class Events:
    """Every event of some sandboxes, as the stream records them (an admin subscription)."""

    def __init__(self) -> None:
        self.got: list[SandboxEvent] = []
        self.sub: Any = None

    @classmethod
    async def watch(cls, nc: Any, *sids: str) -> "Events":
        ev = cls()

        async def cb(m: Any) -> None:
            e = codec.EVENT.decode(m.data)
            if isinstance(e, SandboxEvent):
                ev.got.append(e)

        ev.sub = [await nc.subscribe(S.evt_sandbox_all(s), cb=cb) for s in sids]
        await nc.flush()
        return ev

    def kinds(self, sid: str) -> list[str]:
        return [e.kind for e in self.got if e.sandbox_id == sid]

    def of(self, sid: str, kind: str) -> list[SandboxEvent]:
        return [e for e in self.got if e.sandbox_id == sid and e.kind == kind]

    async def stop(self) -> None:
        for s in self.sub or []:
            with contextlib.suppress(Exception):
                await s.unsubscribe()


class StartWatch:
    """Proof that the in-process host agent never began creating a sandbox id: sampled every few
    milliseconds, far shorter than any container start (the id sits in ``_creating`` throughout)."""

    def __init__(self, host: Any, sid: str) -> None:
        self.host, self.sid, self.seen = host, sid, False
        self.task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            if self.sid in self.host.intake.creating or self.sid in self.host.live:
                self.seen = True
            await asyncio.sleep(0.002)  # sampling period, not synchronisation

    async def stop(self) -> bool:
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task
        return self.seen


async def stream_count(js: Any, stream: str, subject: str | None = None) -> int:
    info = await js.stream_info(stream, subjects_filter=subject) if subject else await js.stream_info(stream)
    if subject is None:
        return info.state.messages
    return sum((info.state.subjects or {}).values())


def host_taken(stack: SecStack) -> int:
    """Hand-offs the host took (handled, not refused at the door) since it started."""
    return sum(getattr(w, "taken", 0) for w in stack.host.workers)


async def host_idle(stack: SecStack) -> bool:
    """The host holds no hand-off (waiting or running) and creates nothing."""
    return all(w.inflight == 0 for w in stack.host.workers) and not stack.host.intake.creating


async def placement_idle(stack: SecStack) -> bool:
    """Placement's request queue is empty and nothing it took is un-acked."""
    ci = await stack.js_admin.consumer_info(S.STREAM_REQ, S.PLACEMENT_DURABLE)
    return ci.num_pending == 0 and ci.num_ack_pending == 0


async def exec_ok(nc: Any, sid: str, cmd: str = "echo alive", tenant: str = S.OPERATOR_TENANT) -> str:
    msg = await nc.request(S.sbx(sid, "exec", tenant), codec.encode(ExecRequest(cmd=cmd, timeout_s=20)), timeout=30)
    res = codec.decode_reply(msg.data, ExecResult)
    assert res.exit_code == 0, res
    return res.stdout.decode()


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    st = await make_stack(auth=True, dedup_window_s=DEDUP_S)
    st.js_admin = st.nc.jetstream()  # type: ignore[attr-defined]
    return st


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


# ------------------------------------------------------------------------------------------ forgery
async def test_client_cannot_forge_control_plane_traffic(stack: SecStack, redteam: RedTeam) -> None:
    """Host work, events, KV state, work-queue consumers and stream admin are out of a client's reach."""
    tn = stack.client_user
    victim = await stack.create(template="base")  # positive control: a client creates and execs
    assert "alive" in await exec_ok(stack.nc, victim.sandbox_id)
    redteam.allowed("client: create + exec through the SDK")
    host, vid, fake = stack.host_id, victim.sandbox_id, f"forged-{stack.uid}-{uuid.uuid4().hex[:6]}"
    js = stack.js_admin  # type: ignore[attr-defined]
    kv_hosts, kv_sbx, kv_img, kv_prof = [await js.key_value(b) for b in (S.KV_HOSTS, S.KV_SANDBOXES, S.KV_IMAGES, S.KV_PROFILES)]
    before = {
        "host_taken": host_taken(stack),
        "hosts": (await kv_hosts.get(host)).revision,
        "record": (await kv_sbx.get(vid)).revision,
        "base": (await kv_img.get("base")).revision,
        "profile": await _revision(kv_prof, "default"),
    }
    cli = await Principal.open(stack.client_url, "client")
    try:
        spec = SandboxSpec(sandbox_id=fake, pool="default", requested_at=time.time(), create_deadline=time.time() + 60)
        place = codec.encode(PlaceSandbox(spec=spec, host_id=host))
        await cli.denied_publish(redteam, S.host_create(host), place, "hand a create straight to a host (skip placement)")
        await cli.denied_publish(redteam, f"dsec.host.{host}.kill", place, "other work on a host's subject")
        now = time.time()
        await cli.denied_publish(
            redteam, S.evt_sandbox(fake, "ready", tn), codec.encode(SandboxEvent(sandbox_id=fake, kind="ready", at=now, host_id=host)), "fake 'ready' event"
        )
        await cli.denied_publish(
            redteam, S.evt_sandbox(vid, "killed", stack.client_user), codec.encode(SandboxEvent(sandbox_id=vid, kind="killed", at=now)),
            "fake 'killed' (dead) event for a live sandbox",
        )
        await cli.denied_publish(redteam, S.evt_host(host, "down"), codec.encode(HostEvent(host_id=host, kind="down", at=now)), "fake HostEvent 'down'")
        await cli.denied_publish(
            redteam, S.EVT_GUARD_VIOLATION,
            codec.encode(GuardViolation(sandbox_id=vid, at=now, kind="control-plane", what="forged", action="quarantine")),
            "fake guard violation (quarantine a victim)",
        )
        await cli.denied_publish(
            redteam, kv_subject(S.KV_HOSTS, host),
            codec.encode(HostStatus(host_id=host, backend="container", at=now, state="down")), "write a host's status (mark it down)",
        )
        await cli.denied_publish(
            redteam, kv_subject(S.KV_HOSTS, fake),
            codec.encode(HostStatus(host_id=fake, backend="container", at=now, cpu_total=1e6, mem_total_mb=10**9)), "register a fake host with huge capacity",
        )
        await cli.denied_publish(
            redteam, kv_subject(S.KV_SANDBOXES, vid),
            codec.encode(SandboxRecord(spec=SandboxSpec(sandbox_id=vid), state="killed", host_id=host)), "rewrite a sandbox record",
        )
        weak = SecurityProfile(name="default", version=999)
        weak.fs.landlock = False
        await cli.denied_publish(redteam, kv_subject(S.KV_PROFILES, "default"), codec.encode(weak), "replace the default security profile")
        await cli.denied_publish(
            redteam, kv_subject(S.KV_IMAGES, "base"),
            codec.encode(TemplateManifest(name="base", layers=[LayerRef(role="base", digest="sha256:" + "1" * 64, kind="dir", path="/")])),
            "replace a template (rootfs = host /)",
        )
        await cli.denied_publish(
            redteam, "$JS.API.STREAM.CREATE.snoop", b'{"name":"snoop","subjects":["dsec.host.>"]}',
            "make a stream that records hosts' hand-offs (to replay one later)",
        )
        await cli.denied_publish(redteam, f"$JS.API.CONSUMER.DURABLE.CREATE.{S.STREAM_REQ}.thief", b"{}", "create a durable on the request queue")
        await cli.denied_publish(redteam, f"$JS.API.CONSUMER.MSG.NEXT.{S.STREAM_REQ}.{S.PLACEMENT_DURABLE}", b'{"batch":10}', "pull placement's work")
        await cli.denied_publish(redteam, f"$JS.ACK.{S.STREAM_REQ}.{S.PLACEMENT_DURABLE}.1.1.1.0.0", b"+ACK", "ack (drop) someone else's work")
        await cli.denied_publish(
            redteam, f"{inbox_prefix('placement')}.handoff.1", codec.encode(HandoffReply(state="done")),
            "answer a hand-off for the host (make placement drop a request the host never did)",
        )
        await cli.denied_publish(redteam, f"$JS.API.STREAM.DELETE.{S.STREAM_EVT}", b"", "delete the audit event stream")
        await cli.denied_publish(redteam, f"$JS.API.STREAM.MSG.DELETE.{S.STREAM_EVT}", b'{"seq":1}', "erase one audit event")
        await cli.denied_publish(redteam, S.dlq("x"), b"forged", "write the dead-letter stream")
        await cli.denied_subscribe(redteam, "dsec.sbx.>", "capture live-sandbox requests (to replay an exec)")
        await cli.denied_subscribe(redteam, "dsec.host.>", "watch host work")
        await cli.denied_subscribe(redteam, S.host_all(host), "take a host's hand-offs (steal its creates)")
        await cli.denied_subscribe(redteam, "$KV.>", "watch KV writes")
        await cli.denied_subscribe(redteam, "dsec.evt.guard.>", "watch guard's verdicts")

        # None of it had an effect.
        assert host_taken(stack) == before["host_taken"]
        assert await stream_count(js, S.STREAM_EVT, S.evt_sandbox(fake, "ready", stack.client_user)) == 0
        assert await stream_count(js, S.STREAM_EVT, S.evt_sandbox(vid, "killed", stack.client_user)) == 0
        assert await stream_count(js, S.STREAM_EVT, S.EVT_GUARD_VIOLATION) == 0
        assert (await kv_sbx.get(vid)).revision == before["record"]
        assert (await kv_img.get("base")).revision == before["base"]
        with pytest.raises(KeyNotFoundError):
            await kv_hosts.get(fake)
        assert fake not in stack.placement.table.hosts and stack.placement.table.hosts[host].status.state == "ready"
        assert await _revision(kv_prof, "default") == before["profile"]
        assert fake not in stack.host.live and vid in stack.host.live
        assert "alive" in await exec_ok(stack.nc, vid)

        # Positive controls: each legitimate principal can do what the client could not.
        hp = await Principal.open(stack.url_as("hostagent"), "hostagent")
        pl = await Principal.open(stack.url_as("placement"), "placement")
        gd = await Principal.open(stack.url_as("guard"), "guard")
        try:
            probe = f"probe-{stack.uid}-{uuid.uuid4().hex[:6]}"
            await hp.nc.jetstream().publish(S.evt_sandbox(probe, "ready", tn), codec.encode(SandboxEvent(sandbox_id=probe, kind="ready", at=time.time())))
            redteam.allowed("hostagent: publish a sandbox event")
            await hp.nc.jetstream().publish(kv_subject(S.KV_SANDBOXES, probe), codec.encode(SandboxRecord(spec=SandboxSpec(sandbox_id=probe), state="failed")))
            redteam.allowed("hostagent: write a sandbox record")
            with pytest.raises(nats.errors.NoRespondersError):  # allowed to publish there; no host of that name
                await pl.nc.request(S.host_create(probe), b"probe", timeout=10)
            redteam.allowed("placement: hand work to a host")
            await gd.nc.jetstream().publish(kv_subject(S.KV_PROFILES, probe), codec.encode(SecurityProfile(name=probe)))
            redteam.allowed("guard: write a security profile")
        finally:
            for p in (hp, pl, gd):
                await p.close()
    finally:
        await cli.close()


async def _revision(kv: Any, key: str) -> int:
    try:
        return (await kv.get(key)).revision
    except Exception:  # noqa: BLE001 - no such key
        return 0


async def _has_key(kv: Any, key: str) -> bool:
    try:
        await kv.get(key)
        return True
    except Exception:  # noqa: BLE001 - no such key
        return False


# ------------------------------------------------------------------------------------------ inboxes
async def test_inboxes_are_private_to_their_principal(stack: SecStack, redteam: RedTeam) -> None:
    """Nobody but services listens beyond its own inbox prefix: a client's inbox space carries
    neither the services' deliveries (specs with their envs) nor another client's replies."""
    user, _ = stack.auth.issue_client_credential(f"alice{stack.uid}")
    await asyncio.to_thread(stack.nats.reload, stack.auth.config_block())
    secret = uuid.uuid4().hex
    snooped: list[bytes] = []
    snoop = await Principal.open(stack.client_url, "client")
    alice = await Principal.open(stack.auth.url_for(user, stack.url), "named client")
    try:
        async def cb(m: Any) -> None:
            snooped.append(m.subject.encode() + b" " + m.data)

        await snoop.denied_subscribe(redteam, "_INBOX.>", "listen on every inbox (services' work deliveries, others' replies)")
        await snoop.denied_subscribe(redteam, "_INBOX.u.hostagent.>", "listen on the host agent's inboxes")
        await snoop.denied_subscribe(redteam, "_INBOX.u.placement.>", "listen on placement's inboxes")
        await snoop.denied_subscribe(redteam, f"_INBOX.u.{user}.>", "listen on a named client's inboxes")
        await snoop.nc.subscribe(f"_INBOX.u.{stack.client_user}.>", cb=cb)  # the snooping tenant's own space
        await snoop.nc.flush()
        # The named client creates through the SDK (its replies under _INBOX.u.<user>) and reads its secret back.
        sb = await AsyncSandbox.create(nats_url=stack.auth.url_for(user, stack.url), envs={"DSEC_SECRET": secret}, lease=60)
        stack.sandboxes.append(sb)
        out = await sb.commands.run("echo got-$DSEC_SECRET", on_stdout=lambda s: None)
        assert secret in out.stdout
        redteam.allowed("named client: create (with a lease) + streamed exec under its own inbox prefix")
        # Positive control: the snooper's own inbox works (a KV read is a request/reply to its inbox).
        assert (await (await snoop.nc.jetstream().key_value(S.KV_IMAGES)).get("base")).value
        redteam.allowed("client: its own replies")
        await eventually(lambda: host_idle(stack), what="the host to ack its work")
        assert not [m for m in snooped if secret.encode() in m], "a client read another's sandbox envs or output"
        redteam.blocked("client: read a named client's create, envs or exec output in its own inbox space [never delivered there]")

        await alice.denied_subscribe(redteam, "_INBOX.>", "listen on every inbox")
        await alice.denied_subscribe(redteam, "_INBOX.u.hostagent.>", "listen on the host agent's inboxes")
        await alice.denied_subscribe(redteam, "_INBOX.u.cli-bob.>", "listen on another named client's inboxes")
        await alice.denied_publish(redteam, S.host_create(stack.host_id), b"x", "hand work to a host")
    finally:
        await snoop.close()
        await alice.close()


# ------------------------------------------------------------------------------------------ sandbox credential
async def test_sandbox_credential_reaches_only_its_own_sandbox(stack: SecStack, redteam: RedTeam) -> None:
    mine, other = await stack.create(), await stack.create()
    user, _ = stack.auth.issue_sandbox_credential(mine.sandbox_id, stack.client_user)
    await asyncio.to_thread(stack.nats.reload, stack.auth.config_block())
    sbx = await Principal.open(stack.auth.url_for(user, stack.url), "sandbox credential")
    try:
        # Positive control: its own sandbox answers (replies come back under _INBOX.u.sbx-<id>).
        assert "alive" in await exec_ok(sbx.nc, mine.sandbox_id, tenant=stack.client_user)
        redteam.allowed("sandbox credential: exec in its own sandbox")
        info = await sbx.nc.request(S.sbx(mine.sandbox_id, "info", stack.client_user), codec.encode(InfoRequest()), timeout=10)
        assert codec.decode_reply(info.data, SandboxInfo).sandbox_id == mine.sandbox_id
        redteam.allowed("sandbox credential: info on its own sandbox")

        oid = other.sandbox_id
        await sbx.denied_publish(redteam, S.sbx(oid, "exec", stack.client_user), codec.encode(ExecRequest(cmd="id")), "exec in another sandbox")
        await sbx.denied_publish(redteam, S.sbx(oid, "kill", stack.client_user), codec.encode(KillRequest()), "kill another sandbox")
        await sbx.denied_publish(redteam, S.sbx(oid, "files", stack.client_user), b"x", "files API of another sandbox")
        spec = build_spec("base", sandbox_id=f"escape-{stack.uid}")
        await sbx.denied_publish(redteam, S.req_create(stack.client_user), codec.encode(CreateSandbox(spec=spec)), "create a sandbox")
        await sbx.denied_publish(redteam, S.req_create_batch(stack.client_user), b"x", "create a batch")
        await sbx.denied_publish(redteam, S.evt_sandbox(mine.sandbox_id, "ready", stack.client_user), b"x", "publish an event about itself")
        await sbx.denied_publish(redteam, kv_subject(S.KV_SANDBOXES, mine.sandbox_id), b"x", "rewrite its own record")
        await sbx.denied_publish(redteam, f"$JS.API.DIRECT.GET.KV_{S.KV_SANDBOXES}.$KV.{S.KV_SANDBOXES}.{oid}", b"", "read another sandbox's record (envs)")
        await sbx.denied_publish(redteam, "$JS.API.INFO", b"", "use the JetStream API at all")
        await sbx.denied_publish(redteam, S.STATUS, b"", "cluster status")
        await sbx.denied_publish(redteam, S.IMG_BUILD, b"x", "build an image")
        await sbx.denied_subscribe(redteam, "dsec.evt.>", "watch events")
        await sbx.denied_subscribe(redteam, "_INBOX.>", "listen on every inbox")
        await sbx.denied_subscribe(redteam, f"_INBOX.u.sbx-{oid}.>", "listen on the other sandbox's inboxes")
        await sbx.denied_subscribe(redteam, S.sbx_all(mine.sandbox_id), "impersonate its own host agent")
        assert "alive" in await exec_ok(stack.nc, oid)  # the other sandbox never noticed
    finally:
        await sbx.close()


# ------------------------------------------------------------------------------------------ replay
async def test_replayed_create_makes_one_sandbox_and_never_resurrects(stack: SecStack, redteam: RedTeam) -> None:
    js_admin = stack.js_admin  # type: ignore[attr-defined]
    cli = await Principal.open(stack.client_url, "client")
    spec = build_spec("base", sandbox_id=f"rp-{stack.uid}-{uuid.uuid4().hex[:6]}")
    sid = spec.sandbox_id
    spec.reply_to = cli.nc.new_inbox()
    ev = await Events.watch(stack.nc, sid)
    data, hdr = codec.encode(CreateSandbox(spec=spec)), {S.HDR_MSG_ID: sid}
    js = cli.nc.jetstream()
    created0 = stack.host.created
    try:
        first = await js.publish(S.req_create(stack.client_user), data, headers=hdr)
        again = await js.publish(S.req_create(stack.client_user), data, headers=hdr)
        assert not first.duplicate and again.duplicate and again.seq == first.seq
        await eventually(lambda: ev.of(sid, "ready"), timeout=60, what="the sandbox to be ready")
        redteam.allowed("client: create by a raw JetStream publish")
        redteam.blocked("replayed create (same Nats-Msg-Id, while creating) [JetStream duplicate]")
        # The same create with a fresh Nats-Msg-Id while it runs: the host already runs that id.
        await js.publish(S.req_create(stack.client_user), data, headers={S.HDR_MSG_ID: f"{sid}-tampered"})
        # Placement takes the copy and hands it to the host, which runs the id already: it says ready again
        # (de-duplicated in the stream by its msg-id) and starts nothing.
        # (stored, so placement's consumer counts it pending until it has taken and acked it)
        await eventually(lambda: placement_idle(stack), timeout=20, what="placement to take and ack the copy")
        await eventually(lambda: host_idle(stack), timeout=30, what="the host to ack the copy")
        assert len(stack.host.live) == 1 and stack.host.created == created0 + 1
        assert await stream_count(js_admin, S.STREAM_EVT, S.evt_sandbox(sid, "ready", stack.client_user)) == 1
        redteam.blocked("replayed create with a fresh Nats-Msg-Id while running [the host runs the id already: one sandbox, its ready said again]")

        msg = await cli.nc.request(S.sbx(sid, "kill", stack.client_user), codec.encode(KillRequest()), timeout=30)
        assert codec.decode_reply(msg.data, Done).detail == "killed"
        await eventually(lambda: ev.of(sid, "killed"), what="the killed event")
        # A replayed kill: nobody serves the id any more; the SDK's kill is a no-op; one killed event.
        with pytest.raises(nats.errors.NoRespondersError):
            await cli.nc.request(S.sbx(sid, "kill", stack.client_user), codec.encode(KillRequest()), timeout=10)
        await AsyncSandbox(sid, cli.nc).kill()
        assert len(ev.of(sid, "killed")) == 1 and await stream_count(js_admin, S.STREAM_EVT, S.evt_sandbox(sid, "killed", stack.client_user)) == 1
        redteam.blocked("replayed kill [no responders: idempotent, one killed event]")

        watch = StartWatch(stack.host, sid)
        try:
            dup = await js.publish(S.req_create(stack.client_user), data, headers=hdr)
            assert dup.duplicate
            redteam.blocked("replayed create after kill, inside the dedup window [JetStream duplicate]")
            # Replay until the stream stops de-duplicating it: the first copy it stores is the attack.

            async def stored() -> bool:
                return not (await js.publish(S.req_create(stack.client_user), data, headers=hdr)).duplicate

            await eventually(stored, timeout=DEDUP_S * 4, interval=0.25, what="the dedup window to close")
            # Placement takes it and hands it to the host, which claims the id in KV before starting it.
            await eventually(lambda: placement_idle(stack), timeout=20, what="placement to take the replay")
            await eventually(lambda: host_idle(stack), timeout=30, what="the host to ack the replay")
        finally:
            started = await watch.stop()
        assert not started, "a replayed create started a killed sandbox again"
        rec = codec.SANDBOX_RECORD.decode((await (await js_admin.key_value(S.KV_SANDBOXES)).get(sid)).value)
        assert rec.state == "gone" and stack.host.created == created0 + 1
        assert await stream_count(js_admin, S.STREAM_EVT, S.evt_sandbox(sid, "ready", stack.client_user)) == 1
        redteam.blocked("replayed create after kill, after the dedup window [host claims the id in KV first: nothing started]")
    finally:
        await ev.stop()
        await cli.close()


async def test_expired_create_is_refused_and_never_started(stack: SecStack, redteam: RedTeam) -> None:
    cli = await Principal.open(stack.client_url, "client")
    replies: list[SandboxEvent] = []

    async def on_reply(m: Any) -> None:
        replies.append(codec.EVENT.decode(m.data))

    inbox = cli.nc.new_inbox()
    await cli.nc.subscribe(inbox, cb=on_reply)
    old = build_spec("base", sandbox_id=f"ex-{stack.uid}-{uuid.uuid4().hex[:6]}", create_timeout=5)
    old.requested_at -= 60  # asked for a minute ago; its deadline passed 55 s ago
    old.create_deadline -= 60
    old.reply_to = inbox
    late = build_spec("base", sandbox_id=f"ex-{stack.uid}-{uuid.uuid4().hex[:6]}", create_timeout=5)
    late.create_deadline = time.time() - 1
    late.reply_to = inbox
    ev = await Events.watch(stack.nc, old.sandbox_id, late.sandbox_id)
    watches = [StartWatch(stack.host, s.sandbox_id) for s in (old, late)]
    pl = await Principal.open(stack.url_as("placement"), "placement")
    try:
        # A replayed (or long-delayed) client request: placement refuses it with its stable code.
        await cli.nc.jetstream().publish(S.req_create(stack.client_user), codec.encode(CreateSandbox(spec=old)), headers={S.HDR_MSG_ID: old.sandbox_id})
        await eventually(lambda: any(r.sandbox_id == old.sandbox_id for r in replies), timeout=20, what="placement's answer")
        r = next(r for r in replies if r.sandbox_id == old.sandbox_id)
        assert r.kind == "failed" and r.code == "timeout", r
        redteam.blocked("create replayed after its create_deadline [placement: failed, code timeout]")
        # A hand-off that waited in the host's queue past the deadline (or was replayed there): the host refuses it.
        place = PlaceSandbox(spec=late, host_id=stack.host_id, placed_by="test", placed_at=time.time())
        data = codec.encode(place)  # signed as placement signs its hand-offs
        hdr = sign_headers(stack.control_key, S.host_create(stack.host_id), data)
        answer = await pl.nc.request(S.host_create(stack.host_id), data, headers=hdr, timeout=20)
        assert codec.HANDOFF_REPLY.decode(answer.data).state == "done"  # taken: its outcome (failed) is stored
        await eventually(lambda: ev.of(late.sandbox_id, "failed"), timeout=20, what="the host's failed event")
        f = ev.of(late.sandbox_id, "failed")[0]
        assert f.code == "timeout" and f.host_id == stack.host_id, f
        assert any(r.sandbox_id == late.sandbox_id and r.code == "timeout" for r in replies)
        redteam.blocked("hand-off past its create_deadline at the host [host: failed, code timeout]")
        await eventually(lambda: host_idle(stack), timeout=30, what="the host to finish")
    finally:
        seen = [await w.stop() for w in watches]
        await ev.stop()
        await pl.close()
        await cli.close()
    assert seen == [False, False], "an expired create was started"
    kv = await stack.js_admin.key_value(S.KV_SANDBOXES)  # type: ignore[attr-defined]
    for s in (old, late):
        assert not await _has_key(kv, s.sandbox_id)
    # Positive control: a create inside its deadline works.
    sb = await stack.create(create_timeout=60)
    assert "alive" in await exec_ok(stack.nc, sb.sandbox_id)
    redteam.allowed("create inside its deadline")


# ------------------------------------------------------------------------------------------ malformed
async def test_forged_payloads_get_typed_errors_and_services_keep_running(stack: SecStack, redteam: RedTeam) -> None:
    """What a client may publish, filled with forgeries: each answered with a stable code or
    dead-lettered with one; no service's own permissions are lent to the client (confused deputy)."""
    tn = stack.client_user
    js_admin = stack.js_admin  # type: ignore[attr-defined]
    victim = await stack.create()
    vid = victim.sandbox_id
    cli = await Principal.open(stack.client_url, "client")
    kv_img = await js_admin.key_value(S.KV_IMAGES)
    base_rev = (await kv_img.get("base")).revision
    taken = host_taken(stack)
    try:
        # reply_to aimed at subjects only services may write: placement refuses the spec.
        for target, what in (
            (kv_subject(S.KV_IMAGES, "base"), "overwrite the base template"),
            (S.host_create(stack.host_id), "inject host work"),
            (S.evt_sandbox(vid, "killed", stack.client_user), "fake a victim's death"),
            (S.sbx(vid, "kill", stack.client_user), "kill a victim"),
            ("_INBOX.>", "a wildcard inbox"),
        ):
            spec = build_spec("base", sandbox_id=f"rt-{stack.uid}-{uuid.uuid4().hex[:6]}")
            spec.reply_to = target
            ev = await Events.watch(stack.nc, spec.sandbox_id)
            try:
                await cli.nc.jetstream().publish(S.req_create(tn), codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: spec.sandbox_id})
                await eventually(lambda ev=ev, sid=spec.sandbox_id: ev.of(sid, "failed"), timeout=20, what="the failed event")
                assert ev.of(spec.sandbox_id, "failed")[0].code == "invalid_argument"
                assert spec.sandbox_id not in stack.host.live
            finally:
                await ev.stop()
            redteam.blocked(f"create with reply_to={target} to {what} via a service [failed, code invalid_argument]")
        # Ids that are not one subject token would address other sandboxes' subjects: dead-lettered, not placed.
        for bad in ("a.b", "*", ">", ""):
            spec = SandboxSpec(sandbox_id=bad, requested_at=time.time(), create_deadline=time.time() + 60)
            marker = uuid.uuid4().hex
            spec.metadata = {"m": marker}
            await cli.nc.jetstream().publish(S.req_create(stack.client_user), codec.encode(CreateSandbox(spec=spec)), headers={S.HDR_MSG_ID: marker})

            async def dead(marker: str = marker) -> bool:
                try:
                    m = await js_admin.get_last_msg(S.STREAM_DLQ, S.dlq(S.req_create(stack.client_user)))
                except Exception:  # noqa: BLE001 - none yet
                    return False
                return marker.encode() in m.data and (m.headers or {}).get(S.HDR_ERROR_CODE) == "invalid_argument"

            await eventually(dead, timeout=20, what=f"the create for id {bad!r} to be dead-lettered")
            redteam.blocked(f"create with sandbox_id {bad!r} [dead-lettered, code invalid_argument]")
        # Live-sandbox subjects: a typed error reply, the sandbox unharmed.
        for subject, payload, what in (
            (S.sbx(vid, "exec", stack.client_user), b"\xc1garbage", "garbage exec"),
            (S.sbx(vid, "kill", stack.client_user), codec.encode(SandboxEvent(sandbox_id=vid, kind="killed", at=0.0)), "an event where a kill request goes"),
            (
                S.sbx(vid, "exec", tn), codec.encode(ExecRequest(cmd="echo x", stream_to=S.sbx(vid, "kill", tn))),
                "exec output streamed onto the victim's kill subject",
            ),
            (S.sbx(vid, "exec", tn), codec.encode(ExecRequest(cmd="echo x", stream_to=kv_subject(S.KV_IMAGES, "base"))), "exec output streamed into KV"),
            (S.sbx(vid, "nope", stack.client_user), b"", "an unknown operation"),
        ):
            m = await cli.nc.request(subject, payload, timeout=20)
            with pytest.raises(BadRequest):
                codec.decode_reply(m.data, ExecResult)
            redteam.blocked(f"{what} [error reply, code bad_request]")
        assert (await kv_img.get("base")).revision == base_rev
        assert host_taken(stack) == taken  # no hand-off reached the host through a service
        assert vid in stack.host.live and await stream_count(js_admin, S.STREAM_EVT, S.evt_sandbox(vid, "killed", stack.client_user)) == 0
        # Positive control: services are still up and a legitimate create works.
        sb = await stack.create()
        assert "alive" in await exec_ok(stack.nc, sb.sandbox_id)
        redteam.allowed("create + exec after the forgeries")
    finally:
        await cli.close()



# ------------------------------------------------------------------------------------------ consumer delivery
async def test_consumer_delivery_and_other_services_cannot_forge_host_work(stack: SecStack, redteam: RedTeam) -> None:
    """NATS does not check a push consumer's ``deliver_subject`` against its creator's publish
    permissions: a client may create a consumer on what it may read (its own events; the host, image
    and snapshot KVs) that delivers onto a host's work subject or onto ``dsec.sbx.<tenant>.<id>.kill``.
    The server delivers only while some subscription names that subject literally (a wildcard
    subscriber, like the host agent's ``dsec.host.<host>.>`` or ``dsec.sbx.<id>.*``, is not enough), and
    then every subscription on that subject gets it, the host agent's hand-off inbox and op subscription
    too, with the stored message's own subject and an ack subject as its reply: both refuse it as such.
    The test makes the literal interest itself and puts the forged bytes into a readable KV itself
    (the worst case, should any service ever store client bytes there); the host agent must refuse.
    Host work is also signed by placement, so no other credential (here imaged's, which may publish
    on ``dsec.>``) can hand a host work: it goes to the dead-letter stream with ``bad_signature``."""
    victim = await stack.create(template="base")  # positive control: a legit create through placement
    assert "alive" in await exec_ok(stack.nc, victim.sandbox_id)
    redteam.allowed("client: create through placement (signed hand-off runs)")
    host, vid, fake = stack.host_id, victim.sandbox_id, f"forged-{stack.uid}-{uuid.uuid4().hex[:6]}"
    js = stack.js_admin  # type: ignore[attr-defined]
    now = time.time()
    spec = SandboxSpec(sandbox_id=fake, pool="default", requested_at=now, create_deadline=now + 60)
    forged_place = codec.encode(PlaceSandbox(spec=spec, host_id=host, placed_at=now))
    forged_kill = codec.encode(KillRequest(reason="forged"))
    # A client may consume only its own events (a named consumer filtered on its tenant's prefix):
    # the forged bytes are stored there (by the admin: the worst case, client bytes in its own events).
    tenant = stack.client_user
    kp, kk = S.evt_sandbox(f"zz-place-{stack.uid}", "x", tenant), S.evt_sandbox(vid, "kill", tenant)
    cli = await Principal.open(stack.client_url, "client")
    img = await Principal.open(stack.url_as("imaged"), "imaged credential")
    cjs = cli.nc.jetstream()
    watch = StartWatch(stack.host, fake)
    seen: dict[str, list[Any]] = {"create": [], "kill": []}
    subs: list[Any] = []
    consumers: list[tuple[str, str]] = []
    dlq_subject = S.dlq(S.host_create(host))
    taken0 = host_taken(stack)
    try:
        # The lease bucket is the one KV a client writes, but it may not consume from it.
        lease_subject = kv_subject(S.KV_LEASES, f"forged-{stack.uid}")
        await cli.nc.request(lease_subject, forged_place, timeout=10)
        await cli.denied_publish(
            redteam, f"$JS.API.CONSUMER.CREATE.KV_{S.KV_LEASES}",
            f'{{"stream_name":"KV_{S.KV_LEASES}","config":{{"deliver_subject":"{S.host_create(host)}"}}}}'.encode(),
            "deliver its own lease bytes onto a host's work subject (consumer on the lease stream)",
        )
        await js.purge_stream(f"KV_{S.KV_LEASES}", subject=lease_subject)

        for key, data in ((kp, forged_place), (kk, forged_kill)):
            await js.publish(key, data)

        async def on_create(m: Any) -> None:
            seen["create"].append(m)

        async def on_kill(m: Any) -> None:
            seen["kill"].append(m)

        subs.append(await stack.nc.subscribe(S.host_create(host), cb=on_create))
        subs.append(await stack.nc.subscribe(S.sbx(vid, "kill", stack.client_user), cb=on_kill))
        await stack.nc.flush()
        stream = S.STREAM_EVT
        for key, target in ((kp, S.host_create(host)), (kk, S.sbx(vid, "kill", stack.client_user))):
            name = f"fwd-{uuid.uuid4().hex[:8]}"
            ci = await cjs.add_consumer(stream, name=name, deliver_subject=target, filter_subject=key, ack_policy="none", inactive_threshold=30.0)
            consumers.append((stream, ci.name))
        # The server accepted both consumers and delivered: the primitive is real.
        await eventually(lambda: seen["create"] and seen["kill"], what="the server to deliver onto the host's and the sandbox's subjects")
        assert all(S.is_stream_delivery(m.reply) for m in seen["create"] + seen["kill"])
        assert seen["kill"][0].subject == kk

        assert seen["create"][0].subject == kp

        # The forged kill reached the victim's host agent before this exec (one subscription, in order).
        assert "alive" in await exec_ok(stack.nc, vid)
        await eventually(lambda: not stack.host.ops.inflight, what="the host's ops to finish")
        assert vid in stack.host.live
        assert await stream_count(js, S.STREAM_EVT, S.evt_sandbox(vid, "killed", stack.client_user)) == 0
        redteam.blocked("client: KillRequest delivered onto dsec.sbx.<victim>.kill by a push consumer [refused: reply is a JetStream ack]")

        # Another service's credential may publish on dsec.host.>, but only placement holds the key.
        answer = codec.HANDOFF_REPLY.decode((await img.nc.request(S.host_create(host), forged_place, timeout=20)).data)
        assert answer.state == "refused" and answer.code == "permission_denied", answer

        async def refused() -> bool:
            try:
                m = await js.get_last_msg(S.STREAM_DLQ, dlq_subject)
            except Exception:  # noqa: BLE001 - not there yet
                return False
            return (m.headers or {}).get(S.HDR_ERROR_CODE) == "bad_signature" and m.data == forged_place

        await eventually(refused, timeout=20, what="the unsigned create in the dead-letter stream with bad_signature")
        await eventually(lambda: host_idle(stack), what="the host to finish with the unsigned work")
        assert not await watch.stop(), "the host agent started a forged create"
        assert fake not in stack.host.live
        # one hand-off reached the host (imaged's, refused); the push consumer's delivery was not taken
        assert host_taken(stack) == taken0 + 1
        assert sum(getattr(w, "stream_deliveries", 0) for w in stack.host.workers) >= 1
        redteam.blocked(
            "client: forged PlaceSandbox delivered onto a host's work subject by a push consumer [a JetStream delivery: not taken, not answered]"
        )
        redteam.blocked("imaged credential: unsigned PlaceSandbox straight onto a host's work subject [dead letter, code bad_signature]")

        # Positive control: placement's signed hand-offs still run.
        sb = await stack.create()
        assert "alive" in await exec_ok(stack.nc, sb.sandbox_id)
        redteam.allowed("create + exec after the forged deliveries")
    finally:
        with contextlib.suppress(Exception):
            await watch.stop()
        for stream, name in consumers:
            with contextlib.suppress(Exception):
                await js.delete_consumer(stream, name)
        for s in subs:
            with contextlib.suppress(Exception):
                await s.unsubscribe()
        for key in (kp, kk):
            with contextlib.suppress(Exception):
                await js.purge_stream(S.STREAM_EVT, subject=key)
        with contextlib.suppress(Exception):
            await js.purge_stream(S.STREAM_DLQ, subject=dlq_subject)
        await cli.close()
        await img.close()
