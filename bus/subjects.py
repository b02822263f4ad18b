"""Every subject, stream, consumer, bucket and header name dsec uses, in one place."""

from __future__ import annotations

import hashlib
import re

PREFIX = "dsec"

# --- streams -----------------------------------------------------------------
STREAM_REQ = "DSEC_REQ"
STREAM_HOST = "DSEC_HOST"  # earlier versions' host work stream, removed at start (bus.streams)
STREAM_EVT = "DSEC_EVT"
STREAM_DLQ = "DSEC_DLQ"

REQ_SUBJECTS = [f"{PREFIX}.req.>"]
EVT_SUBJECTS = [f"{PREFIX}.evt.>"]
DLQ_SUBJECTS = [f"{PREFIX}.dlq.>"]

# --- durable consumers ---------------------------------------------------------
PLACEMENT_DURABLE = "placement"
GUARD_AUDIT_DURABLE = "guard-audit"


# --- KV buckets / object store -----------------------------------------------
KV_HOSTS = "dsec_hosts"
KV_SANDBOXES = "dsec_sandboxes"
KV_IMAGES = "dsec_images"
KV_PROFILES = "dsec_profiles"
KV_QUARANTINE = "dsec_quarantine"  # guard: sandbox id -> the GuardViolation that quarantined it
KV_ROLLOUTS = "dsec_rollouts"
KV_LEASES = "dsec_leases"
KV_SNAPSHOTS = "dsec_snapshots"  # snapshot id -> SnapshotRecord (its layers, parent, provenance)
KV_TENANTS = "dsec_tenants"  # tenant -> TenantLimits (its quotas), written by the operator only; TENANT_DEFAULTS: keys without a record
KV_QUOTA = "dsec_quota"  # tenant -> TenantUsage (the sandboxes its quotas count), written by placement only
TENANT_DEFAULTS = "_default"  # the KV_TENANTS key of the limits of every client tenant without a record of its own
KV_GC = "dsec_gc"  # pin.<layer hex>.<id> (keys a writer reuses), tomb.<key> (keys a collection deletes); see imaged._gc
OBJ_CHUNKS = "dsec_chunks"

# --- headers -------------------------------------------------------------------
HDR_MSG_ID = "Nats-Msg-Id"  # JetStream de-duplication
HDR_ERROR_CODE = "Dsec-Error-Code"
HDR_ERROR = "Dsec-Error"  # dead letters: the human description
HDR_ORIGIN = "Dsec-Origin"  # dead letters: the subject the message came in on
# Placement's HMAC over (subject, payload) of the work it hands a host (bus.sign): a JetStream push
# consumer may deliver stored bytes onto any subject, past the creator's publish permissions.
HDR_SIGNATURE = "Dsec-Signature"

# --- request subjects (JetStream, DSEC_REQ) ----------------------------------
# Services (placement re-queueing, a host re-placing) publish here; the spec keeps its ``client``.
REQ_CREATE = f"{PREFIX}.req.create"
REQ_CREATE_BATCH = f"{PREFIX}.req.create_batch"

# --- status (core request/reply) ---------------------------------------------
STATUS = f"{PREFIX}.status"

# --- metrics (core request/reply; bus.metrics) -------------------------------------
METRICS_SCRAPE = f"{PREFIX}.metrics.scrape"  # every process answers (scatter-gather)
METRICS_ALL = f"{PREFIX}.metrics.>"

# fullmatch, never ``^…$``: ``$`` also matches before a final newline, and a token ending in one
# would end a protocol line early on the connection that publishes it.
_TOKEN = re.compile(r"[A-Za-z0-9_-]{1,128}")
_INBOX = re.compile(r"_INBOX(?:\.[A-Za-z0-9_-]{1,128})+")


def valid_token(token: str) -> bool:
    """True when ``token`` is safe as one subject token (no dots, wildcards or spaces)."""
    return _TOKEN.fullmatch(token) is not None


def valid_inbox(subject: str) -> bool:
    """True for a reply inbox (``_INBOX.<tokens>``, no wildcards): the only place services send
    a client-named reply, so a spec or request can never aim a service's own permissions at a
    control subject (a host's work, an event, a KV key)."""
    return _INBOX.fullmatch(subject) is not None


def is_stream_delivery(reply: str | None) -> bool:
    """True when a message came from a JetStream consumer (its reply is the ack subject), not from a
    client's core request (whose reply is an inbox)."""
    return reply is not None and reply.startswith("$JS.ACK.")


def incarnation(sandbox_id: str, generation: int) -> str:
    """What de-duplication ids of a sandbox's work and events name: the id, plus the generation once a
    persisted pause was resumed (the same id runs again, and JetStream must not drop it as a duplicate)."""
    return sandbox_id if generation <= 0 else f"{sandbox_id}~g{generation}"


def _tok(token: str) -> str:
    if not valid_token(token):
        raise ValueError(f"not a valid subject token: {token!r}")
    return token


# --- per-host work (core hand-offs, bus.runtime.handoff) -------------------------
def host_create(host_id: str) -> str:
    return f"{PREFIX}.host.{_tok(host_id)}.create"


def host_all(host_id: str) -> str:
    return f"{PREFIX}.host.{_tok(host_id)}.>"


# --- tenants -------------------------------------------------------------------
# Every client identity (NATS user) is a tenant; its sandboxes' ops, events and creates carry it
# as a subject token, so nats-server permissions on ``<prefix>.<tenant>.>`` keep tenants apart
# (bus.auth). A sandbox belongs to ``spec.client``; the operator's tenant reaches every sandbox
# (only the operator and services may publish under it).
OPERATOR_TENANT = "admin"


def tenant(client: str) -> str:
    """The tenant token of a sandbox's ``spec.client`` (empty: made by the operator or a service)."""
    return _tok(client) if client else OPERATOR_TENANT


def req_create(tenant: str) -> str:
    """A client's create request: placement binds the spec to the tenant in the subject."""
    return f"{PREFIX}.req.{_tok(tenant)}.create"


def req_create_batch(tenant: str) -> str:
    return f"{PREFIX}.req.{_tok(tenant)}.create_batch"


def request_tenant(subject: str) -> str | None:
    """The tenant a create request was published under; None for the services' own subjects."""
    t = subject.split(".")
    return t[2] if len(t) == 4 and t[0] == PREFIX and t[1] == "req" and t[3] in ("create", "create_batch") else None


# --- live sandbox ops (core request/reply) -----------------------------------
SBX_OPS = ("exec", "files", "kill", "timeout", "network", "info", "proc", "metrics", "ack", "port", "snapshot", "pause", "resume", "display")


def sbx(sandbox_id: str, op: str, tenant: str = OPERATOR_TENANT) -> str:
    """``dsec.sbx.<tenant>.<id>.<op>``: clients name their own tenant; services and the operator theirs."""
    return f"{PREFIX}.sbx.{_tok(tenant)}.{_tok(sandbox_id)}.{op}"


def sbx_all(sandbox_id: str) -> str:
    """What a host serves for one sandbox: every tenant's ops on it (it refuses a tenant not the owner)."""
    return f"{PREFIX}.sbx.*.{_tok(sandbox_id)}.*"


def sbx_tenant(tenant: str) -> str:
    """Every op of one tenant: what its credential may publish."""
    return f"{PREFIX}.sbx.{_tok(tenant)}.>"


def parse_sbx(subject: str) -> tuple[str, str, str] | None:
    """(tenant, sandbox id, op) of an op subject; None for anything else."""
    t = subject.split(".")
    if len(t) != 5 or t[0] != PREFIX or t[1] != "sbx":
        return None
    return t[2], t[3], t[4]


SBX_WILDCARD = f"{PREFIX}.sbx.*.*.*"


# --- FnCall (core request/reply, queue group per template) -----------------------------
FN_QUEUE = "fn"  # the queue group of every host serving a template's calls


def fn_call(template: str, tenant: str = OPERATOR_TENANT) -> str:
    """``dsec.fn.<tenant>.<template>.call``: a stateless call of ``template`` by ``tenant`` (the
    caller's own token: its credential may publish under no other, ``fn_tenant``). Every host with a
    warm pool of it serves ``fn_call_all`` in queue group ``FN_QUEUE``, so NATS hands each call to
    one of them (no placement round trip), and refuses a tenant the template is private from."""
    return f"{PREFIX}.fn.{_tok(tenant)}.{_tok(template)}.call"


def fn_call_all(template: str) -> str:
    """What a host with a pool of ``template`` serves: every tenant's calls of it."""
    return f"{PREFIX}.fn.*.{_tok(template)}.call"


def fn_tenant(tenant: str) -> str:
    """Every call of one tenant: what its credential may publish."""
    return f"{PREFIX}.fn.{_tok(tenant)}.*.call"


def parse_fn(subject: str) -> tuple[str, str] | None:
    """(tenant, template) of a call's subject; None for anything else."""
    t = subject.split(".")
    if len(t) != 5 or t[0] != PREFIX or t[1] != "fn" or t[4] != "call":
        return None
    return t[2], t[3]


FN_CALL_WILDCARD = f"{PREFIX}.fn.*.*.call"


# --- events (JetStream, DSEC_EVT) ----------------------------------------------
def evt_sandbox(sandbox_id: str, kind: str, tenant: str) -> str:
    return f"{PREFIX}.evt.sandbox.{_tok(tenant)}.{_tok(sandbox_id)}.{kind}"


def evt_sandbox_all(sandbox_id: str, tenant: str = "*") -> str:
    return f"{PREFIX}.evt.sandbox.{tenant if tenant == '*' else _tok(tenant)}.{_tok(sandbox_id)}.>"


def evt_tenant(tenant: str) -> str:
    """Every event of one tenant's sandboxes: what its credential may read."""
    return f"{PREFIX}.evt.sandbox.{_tok(tenant)}.>"


EVT_SANDBOX_ALL = f"{PREFIX}.evt.sandbox.>"
EVT_ALL = EVT_SUBJECTS[0]


# A host batch's ready sandboxes, one event for the members of one tenant (bus.messages.ReadyMany):
# ``dsec.evt.ready.<tenant>.<host>``. Not under ``dsec.evt.sandbox.``: a per-sandbox replay reads it
# beside the sandbox's own subject, and a consumer's filters must not overlap.
def evt_ready(tenant: str, host_id: str) -> str:
    return f"{PREFIX}.evt.ready.{_tok(tenant)}.{_tok(host_id)}"


def evt_ready_tenant(tenant: str = "*") -> str:
    """Every batch ready event of one tenant (``*``: of every tenant)."""
    return f"{PREFIX}.evt.ready.{tenant if tenant == '*' else _tok(tenant)}.>"


EVT_READY_ALL = f"{PREFIX}.evt.ready.>"


def evt_host(host_id: str, kind: str) -> str:
    return f"{PREFIX}.evt.host.{_tok(host_id)}.{kind}"


def evt_snapshot(snapshot_id: str, kind: str) -> str:
    """Snapshot provenance (created, restored, forked, removed)."""
    return f"{PREFIX}.evt.snapshot.{_tok(snapshot_id)}.{kind}"


EVT_GUARD_VIOLATION = f"{PREFIX}.evt.guard.violation"

# --- dropped sandbox packets (host agent's nftables -> guard, through the kernel) ---------
# The host agent logs each packet its egress rules refuse to this NFLOG group, prefixed
# "<NFLOG_PREFIX> <rule>"; guard listens on the group. Only one listener can hold a group per
# network namespace, so two stacks on one machine (tests) must use different groups.
NFLOG_GROUP = 7301
NFLOG_PREFIX = "dsec-drop"


def evt_image(name: str, kind: str) -> str:
    return f"{PREFIX}.evt.image.{_tok(name)}.{kind}"


# --- dead letters ---------------------------------------------------------------
def dlq(origin_subject: str) -> str:
    return f"{PREFIX}.dlq.{origin_subject.replace('.', '_')}"


def metrics(service: str, instance: str) -> str:
    """One process's metrics: ``dsec.metrics.<service>.<instance>``."""
    return f"{PREFIX}.metrics.{_tok(service)}.{_tok(instance)}"


# --- image service (core request/reply) ---------------------------------------
# Requests that change templates or snapshots carry the tenant as their last token (``img_build``,
# ``img_remove``, ``snap_remove``): a client credential may publish only its own (bus.auth) and the
# image service checks ownership against it (imaged._tenancy). The bare subjects are the services'
# and the operator's (a client credential may not publish them).
IMG_BUILD = f"{PREFIX}.img.build"
IMG_LIST = f"{PREFIX}.img.list"
IMG_REMOVE = f"{PREFIX}.img.rm"
IMG_STATS = f"{PREFIX}.img.stats"


def img_build(tenant: str) -> str:
    return f"{IMG_BUILD}.{_tok(tenant)}"


def img_remove(tenant: str) -> str:
    return f"{IMG_REMOVE}.{_tok(tenant)}"


def img_request_tenant(subject: str, base: str) -> str:
    """The tenant of an image request on ``base`` (``IMG_BUILD``, ``IMG_REMOVE``, ``SNAP_REMOVE``) or
    its tenant form; the bare subject is the operator's."""
    tail = subject[len(base):] if subject.startswith(base) else ""
    return _tok(tail[1:]) if tail.startswith(".") else OPERATOR_TENANT


def pull_cache_template(ref: str, platform: str = "") -> str:
    """The template (a KV ``dsec_images`` key) a ``FROM <ref>`` build pulls a registry image into:
    named by the reference, so it is shared whoever pulls it (imaged._tenancy)."""
    return "img-" + hashlib.sha256("\0".join((ref, platform)).encode("utf-8", "surrogateescape")).hexdigest()[:24]


def host_img_stats(host_id: str) -> str:
    return f"{PREFIX}.img.host.{_tok(host_id)}.stats"


# Snapshots: clients remove them through the image service (which owns the blob store's garbage).
SNAP_REMOVE = f"{PREFIX}.img.snap.rm"


def snap_remove(tenant: str) -> str:
    return f"{SNAP_REMOVE}.{_tok(tenant)}"


def host_pack(host_id: str) -> str:
    """The host's lazy loader packs a host directory (a sandbox's upper-dir diff) into a layer in the
    blob store. Outside ``dsec.img.>`` on purpose: clients may publish there, and a client-chosen path
    on the host must never be packed."""
    return f"{PREFIX}.imaged.{_tok(host_id)}.pack"


# --- trajectories (JetStream, DSEC_TRAJ) ------------------------------------------------
# Every logged operation on a sandbox, in the order its host answered them (bus.messages.TrajStep).
STREAM_TRAJ = "DSEC_TRAJ"
TRAJ_SUBJECTS = [f"{PREFIX}.traj.>"]


def traj(sandbox_id: str, tenant: str) -> str:
    """``dsec.traj.<tenant>.<id>``: a sandbox's log under its owner's tenant (``tenant(spec.client)``),
    so a client credential reads its own sandboxes' logs only (bus.auth)."""
    return f"{PREFIX}.traj.{_tok(tenant)}.{_tok(sandbox_id)}"


def traj_any(sandbox_id: str) -> str:
    """A sandbox's log whoever owns it: what the operator reads (a fork has its parent's owner)."""
    return f"{PREFIX}.traj.*.{_tok(sandbox_id)}"


def traj_tenant(tenant: str) -> str:
    """Every log of one tenant's sandboxes: what its credential may read."""
    return f"{PREFIX}.traj.{_tok(tenant)}.>"


def traj_msg_id(sandbox_id: str, client_id: str, step: int) -> str:
    """De-duplication id of one logged step: a host logging a step again (a retried publish) stores it once."""
    return f"{sandbox_id}:{client_id}:{step}"


# --- rollouts (JetStream work queue, DSEC_ROLLOUTS; job state in KV dsec_rollouts) ------------------
# A job is its tenant's: submitted on ``dsec.rollout.<queue>.<tenant>.<job>``, its state under the KV
# key ``<tenant>.<job>``, its model gateway on ``dsec.model.<tenant>.<job>``; a client credential may
# publish and read under its own tenant token only (bus.auth), and the workers bind a job to the
# tenant of its subject (sdk.rollouts._worker).
STREAM_ROLLOUTS = "DSEC_ROLLOUTS"
ROLLOUT_SUBJECTS = [f"{PREFIX}.rollout.>"]
ROLLOUT_QUEUE = "default"  # a queue is one subject and one durable consumer its workers share


def rollout_queue(queue: str) -> str:
    return f"{PREFIX}.rollout.{_tok(queue)}"


def rollout_job(queue: str, tenant: str, job_id: str) -> str:
    """A job as submitted: the tenant's token before its id."""
    return f"{rollout_queue(queue)}.{_tok(tenant)}.{_tok(job_id)}"


def rollout_tenant(tenant: str) -> str:
    """Every job of one tenant, in any queue: what its credential may submit and look up."""
    return f"{PREFIX}.rollout.*.{_tok(tenant)}.*"


def parse_rollout(subject: str) -> tuple[str, str, str] | None:
    """(queue, tenant, job id) of a submitted job's subject; None for anything else."""
    t = subject.split(".")
    if len(t) != 5 or t[0] != PREFIX or t[1] != "rollout":
        return None
    return t[2], t[3], t[4]


def rollout_key(tenant: str, job_id: str) -> str:
    """The job's key in KV ``dsec_rollouts``."""
    return f"{_tok(tenant)}.{_tok(job_id)}"


def rollout_keys(tenant: str) -> str:
    """The KV subjects of every job of one tenant."""
    return f"$KV.{KV_ROLLOUTS}.{_tok(tenant)}.>"


def rollout_durable(queue: str) -> str:
    return f"rollouts-{_tok(queue)}"


# --- the model gateway (core request/reply; rollout workers answer in queue group ROLLOUT_WORKERS) ---
ROLLOUT_WORKERS = "rollout-workers"
MODEL_WILDCARD = f"{PREFIX}.model.*.*"


def model_call(job_id: str, tenant: str) -> str:
    """A chat-completions request for a rollout's policy, forwarded and logged by a rollout worker."""
    return f"{PREFIX}.model.{_tok(tenant)}.{_tok(job_id)}"


def model_tenant(tenant: str) -> str:
    return f"{PREFIX}.model.{_tok(tenant)}.*"


def parse_model(subject: str) -> tuple[str, str] | None:
    """(tenant, job id) of a model gateway request's subject."""
    t = subject.split(".")
    if len(t) != 4 or t[0] != PREFIX or t[1] != "model":
        return None
    return t[2], t[3]


# --- memory reclaim (core publish, per host; hostagent.reclaim) --------------------------------
def reclaim_targets(host_id: str) -> str:
    """The host agent tells its host's reclaim service which sandboxes it runs (each heartbeat)."""
    return f"{PREFIX}.reclaim.{_tok(host_id)}.targets"


def reclaim_report(host_id: str) -> str:
    """The reclaim service's figures per sandbox and for the host (each pass)."""
    return f"{PREFIX}.reclaim.{_tok(host_id)}.report"
