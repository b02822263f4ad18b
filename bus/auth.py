"""NATS authentication and per-subject permissions for the control plane.

Each service role gets its own user with only the subjects it needs. Every client identity (an API
key, a named SDK credential) is a **tenant**: its user name is a subject token of its sandboxes'
creates (``dsec.req.<tenant>.create``), ops (``dsec.sbx.<tenant>.<id>.<op>``), events
(``dsec.evt.sandbox.<tenant>.<id>.<kind>``), trajectory logs (``dsec.traj.<tenant>.<id>``), rollout
jobs (``dsec.rollout.<queue>.<tenant>.<job>``, KV ``dsec_rollouts`` key ``<tenant>.<job>``, the model
gateway's ``dsec.model.<tenant>.<job>``) and image requests that change templates or snapshots
(``dsec.img.build.<tenant>``, ``dsec.img.rm.<tenant>``, ``dsec.img.snap.rm.<tenant>``), and
nats-server lets it publish and read only under its own token (:func:`client_permissions`): another
tenant's ops, events, logs, jobs, records and inboxes are refused by the server. Placement binds each create to the tenant of its subject (``spec.client``),
host agents refuse an op whose tenant does not own the sandbox (``hostagent._tenancy``), and the
operator's tenant (``admin``) reaches every sandbox; the rollout workers bind a job to the tenant of
its subject and the image service checks a template's or snapshot's owner against the request's
(``imaged._tenancy``). The rollout workers are a role of their own with only what they use. Sandbox records (KV ``dsec_sandboxes``, with
their envs) are for services and the operator only.

Nothing connects without credentials: there is no ``no_auth_user`` unless a development stack asks
for one (``config_block(anonymous=True)``); ``dsec up --no-auth`` runs NATS without any
authorization at all, for tests.

Every user keeps its reply inboxes under its own prefix, ``_INBOX.u.<user>`` (see
:func:`inbox_prefix`; ``bus.runtime.connect`` sets it from the URL's user name), and only services
may subscribe to other prefixes: a client subscribed to ``_INBOX.>`` would otherwise read the
services' work deliveries (sandbox specs with their envs) and every client's replies. (A deny on
``_INBOX.u.>`` is not enough: the server checks a deny against a JetStream delivery's original
subject, not the inbox it goes to.)
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from . import subjects as S
from .sign import new_control_key, parse_key

# Streams every reader may read whole: hosts and templates (the monitor also reads the event stream,
# the sandbox and snapshot records and the rollout jobs; clients read their own events only, and no
# records: a record's spec holds its sandbox's envs; trajectory logs, with every exec's commands, envs
# and outputs, and rollout jobs, with their conversations and policy URLs, are read per tenant like
# events). A rollout's sandbox is the tenant's that submitted the job, so its trainer reads its steps.
_SHARED_READ_STREAMS = [f"KV_{S.KV_HOSTS}", f"KV_{S.KV_IMAGES}"]
_MONITOR_READ_STREAMS = [S.STREAM_EVT, f"KV_{S.KV_SANDBOXES}", f"KV_{S.KV_SNAPSHOTS}", f"KV_{S.KV_ROLLOUTS}", *_SHARED_READ_STREAMS]


NAMED_INBOXES = "_INBOX.u"
ANONYMOUS_USER = "client"  # nats-server's no_auth_user, on development stacks only (config_block)


def inbox_prefix(user: str) -> str:
    """Where a named NATS user's reply inboxes live; nobody else may subscribe beneath it."""
    return f"{NAMED_INBOXES}.{S._tok(user)}"


def _read_js_api(streams: list[str]) -> list[str]:
    """JetStream API calls that read ``streams`` whole: info, direct gets, ephemeral ordered consumers."""
    allow = ["$JS.API.INFO", "$JS.FC.>"]
    for st in streams:
        allow += [
            f"$JS.API.STREAM.INFO.{st}",
            f"$JS.API.STREAM.MSG.GET.{st}",
            f"$JS.API.DIRECT.GET.{st}",
            f"$JS.API.DIRECT.GET.{st}.>",
            f"$JS.API.CONSUMER.CREATE.{st}",
            f"$JS.API.CONSUMER.CREATE.{st}.>",
            f"$JS.API.CONSUMER.INFO.{st}.>",
            f"$JS.API.CONSUMER.DELETE.{st}.>",
        ]
    return allow


def _tenant_js_api(tenant: str) -> list[str]:
    """A tenant reads its own events and trajectory logs only: a direct get names the subject in the
    API subject, and a consumer create (``CONSUMER.CREATE.<stream>.<name>.<filter>``) its filter, so
    the server can check both against the tenant's prefix. (``STREAM.MSG.GET`` and filterless
    creates carry the subject in the body, out of the server's sight: not allowed.)"""
    allow = []
    for stream, own in ((S.STREAM_EVT, S.evt_tenant(tenant)), (S.STREAM_EVT, S.evt_ready_tenant(tenant)), (S.STREAM_TRAJ, S.traj_tenant(tenant))):
        allow += [f"$JS.API.DIRECT.GET.{stream}.{own}", f"$JS.API.CONSUMER.CREATE.{stream}.*.{own}"]
    return allow


def _tenant_jobs_and_images(tenant: str) -> list[str]:
    """A client tenant's rollout jobs, submitted under its token, looked up while queued by direct
    gets (no consumer on a work queue), their state read by direct gets and listed by a consumer
    filtered in its create subject, and its model gateway calls; and the image service's requests
    that change templates and snapshots (imaged._tenancy checks the owner against the tenant)."""
    jobs, records = S.rollout_tenant(tenant), S.rollout_keys(tenant)
    return [
        jobs, f"$JS.API.DIRECT.GET.{S.STREAM_ROLLOUTS}.{jobs}", S.model_tenant(tenant),
        f"$JS.API.DIRECT.GET.KV_{S.KV_ROLLOUTS}.{records}", f"$JS.API.CONSUMER.CREATE.KV_{S.KV_ROLLOUTS}.*.{records}",
        S.img_build(tenant), S.img_remove(tenant), S.snap_remove(tenant),
    ]


# Leases are the one KV write a client makes (the SDK renews its owner key; hosts only read revisions).
_CLIENT_COMMON_PUBLISH = [
    S.STATUS, S.IMG_LIST, S.IMG_STATS,
    f"$KV.{S.KV_LEASES}.>", f"$JS.API.STREAM.INFO.KV_{S.KV_LEASES}", *_read_js_api(_SHARED_READ_STREAMS),
]


def _bucket_writes(*buckets: str) -> list[str]:
    """Every way to change a bucket's keys: put, delete, purge (whole or one message), drop."""
    out = []
    for b in buckets:
        out += [f"$KV.{b}.>", f"$JS.API.STREAM.PURGE.KV_{b}", f"$JS.API.STREAM.DELETE.KV_{b}", f"$JS.API.STREAM.MSG.DELETE.KV_{b}"]
    return out


# Tenant limits are the operator's alone to write (`dsec api-key create --max-sandboxes ...`), what
# their tenants hold placement's alone: no other service (a compromised host agent, a rollout
# worker running a tenant's code) may raise a tenant's quota or forget what it holds. (Clients may
# not write either: their allow lists do not name them.)
_NOT_LIMITS = {"deny": _bucket_writes(S.KV_TENANTS)}
_NOT_QUOTAS = {"deny": _bucket_writes(S.KV_TENANTS, S.KV_QUOTA)}

ROLLOUTS_ROLE = "rollouts"  # the rollout workers: a service that is also a client tenant of its own (reads no records)
OPERATOR_ROLE = "admin"  # whom the client context (below) speaks for: the operator of a `dsec up` stack
MONITOR_ROLE = "monitor"  # the gateway's /metrics and /dashboard: scrape every service, read hosts, sandboxes, events
ENV_MONITOR_URL = "DSEC_MONITOR_NATS_URL"  # the monitor's NATS URL, handed to the gateway by `dsec up`


def _rollouts_permissions() -> dict[str, Any]:
    """What a rollout worker uses, and no more: creates and ops as the tenant ``rollouts`` (a job's
    sandbox is its submitter's, with the workers as its ``delegate``: bind_tenant; host agents refuse
    the workers' ops on any other sandbox), the events and trajectory logs of the jobs' sandboxes,
    which are under their owners' tenants (read, and the policy's turns written), leases, the rollout
    stream and its consumers, the jobs' records, dead letters, and the model gateway's requests
    (answered on their reply subjects)."""
    rollouts, records = S.STREAM_ROLLOUTS, f"KV_{S.KV_ROLLOUTS}"
    any_log, any_evt = f"{S.PREFIX}.traj.*.*", f"{S.PREFIX}.evt.sandbox.*.*.*"
    publish = [
        S.req_create(ROLLOUTS_ROLE), S.req_create_batch(ROLLOUTS_ROLE), S.sbx_tenant(ROLLOUTS_ROLE), S.fn_tenant(ROLLOUTS_ROLE), any_log,
        *_CLIENT_COMMON_PUBLISH,
        f"$JS.API.DIRECT.GET.{S.STREAM_TRAJ}.{any_log}", f"$JS.API.CONSUMER.CREATE.{S.STREAM_TRAJ}.*.{any_log}",
        f"$JS.API.DIRECT.GET.{S.STREAM_EVT}.{any_evt}", f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}.*.{S.evt_tenant(ROLLOUTS_ROLE)}",
        # the batch ready events of the jobs' sandboxes (a lost reply's slow path: sdk._async), under their owners' tenants
        f"$JS.API.CONSUMER.CREATE.{S.STREAM_EVT}.*.{S.evt_ready_tenant()}",
        f"{S.PREFIX}.dlq.>",
        f"$KV.{S.KV_ROLLOUTS}.>", *_read_js_api([records]), f"$JS.API.STREAM.CREATE.{records}", f"$JS.API.STREAM.UPDATE.{records}",
        f"$JS.API.STREAM.INFO.{rollouts}", f"$JS.API.STREAM.CREATE.{rollouts}", f"$JS.API.STREAM.UPDATE.{rollouts}",
        f"$JS.API.CONSUMER.CREATE.{rollouts}.>", f"$JS.API.CONSUMER.DURABLE.CREATE.{rollouts}.>", f"$JS.API.CONSUMER.INFO.{rollouts}.>",
        f"$JS.API.CONSUMER.MSG.NEXT.{rollouts}.>", f"$JS.ACK.{rollouts}.>",
    ]
    subscribe = [f"{inbox_prefix(ROLLOUTS_ROLE)}.>", S.MODEL_WILDCARD, S.METRICS_SCRAPE, f"{S.PREFIX}.metrics.{ROLLOUTS_ROLE}.*"]
    return {"publish": {"allow": publish}, "subscribe": {"allow": subscribe}, "allow_responses": True}


ROLE_PERMISSIONS: dict[str, dict[str, Any]] = {
    # Services are trusted processes of the control plane.
    "placement": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"], **_NOT_LIMITS}, "subscribe": {"allow": ["_INBOX.>", "$KV.>", "dsec.>"]}},
    "hostagent": {
        "publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"], **_NOT_QUOTAS}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]},
        "allow_responses": True,
    },
    "imaged": {
        "publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "$O.>", "_INBOX.>"], **_NOT_QUOTAS}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>", "$O.>"]},
        "allow_responses": True,
    },
    # Rollout workers: a client of sandboxes (their own tenant) that also takes jobs from the rollout
    # queues, keeps their state and answers the model gateway.
    ROLLOUTS_ROLE: _rollouts_permissions(),
    "guard": {
        "publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"], **_NOT_QUOTAS}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]},
        "allow_responses": True,
    },
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
    # Read-only: asks for metrics (the services answer its inbox), reads KV and the event stream, hears events.
    MONITOR_ROLE: {
        "publish": {"allow": [S.METRICS_SCRAPE, *_read_js_api(_MONITOR_READ_STREAMS)]},
        "subscribe": {"allow": [f"{NAMED_INBOXES}.{MONITOR_ROLE}.>", S.EVT_ALL]},
    },
}

SERVICE_ROLES = ("placement", "hostagent", "imaged", "guard", "admin", MONITOR_ROLE, ROLLOUTS_ROLE)
SANDBOX_USER_PREFIX = "sbx-"
CLIENT_USER_PREFIX = "cli-"


def sandbox_permissions(sandbox_id: str, tenant: str = S.OPERATOR_TENANT) -> dict[str, Any]:
    """A credential handed to code inside a sandbox reaches only that sandbox's own subjects."""
    return {
        "publish": {"allow": [S.sbx(sandbox_id, "*", tenant)]},
        "subscribe": {"allow": [f"{inbox_prefix(SANDBOX_USER_PREFIX + sandbox_id)}.>"]},
    }


def client_permissions(user: str) -> dict[str, Any]:
    """A tenant (the NATS user ``user``): creates, ops, fn calls, events, logs, rollout jobs, image
    requests and inboxes under its own token only."""
    return {
        "publish": {"allow": [
            S.req_create(user), S.req_create_batch(user), S.sbx_tenant(user), S.fn_tenant(user), *_CLIENT_COMMON_PUBLISH, *_tenant_js_api(user),
            *_tenant_jobs_and_images(user),
        ]},
        "subscribe": {"allow": [f"{inbox_prefix(user)}.>"]},
    }


def bind_tenant(subject: str, specs: list[Any]) -> None:
    """Placement's binding of a client's create to its tenant: a client create names the tenant in
    its subject (the only create subject its credential may publish), and that is the owner of its
    sandboxes whatever its spec says (and no ``delegate``); the operator's creates keep the ``client``
    they name. The rollout workers' creates are the exception: a job's sandbox is the tenant's that
    submitted it (the worker bound the job to the tenant of its subject, sdk.rollouts), named as its
    ``client``, with the workers as its ``delegate`` (host agents serve them its ops)."""
    t = S.request_tenant(subject)
    for spec in specs:
        if t == ROLLOUTS_ROLE and spec.client and spec.client not in (S.OPERATOR_TENANT, ROLLOUTS_ROLE) and S.valid_token(spec.client):
            spec.delegate = ROLLOUTS_ROLE  # a job's sandbox: its submitter's (quota, records, events, logs), operated by the workers
        elif t is not None and t != S.OPERATOR_TENANT:
            spec.client, spec.delegate = t, ""
        elif not spec.client:
            spec.client = S.OPERATOR_TENANT


@dataclass
class AuthConfig:
    """Users and passwords of one deployment; stored 0600 under the data dir."""

    passwords: dict[str, str] = field(default_factory=dict)
    sandbox_users: dict[str, str] = field(default_factory=dict)
    client_users: dict[str, str] = field(default_factory=dict)
    # Hex HMAC key placement signs host work with (bus.sign); only placement and host agents get it.
    control_key: str = ""
    sandbox_tenants: dict[str, str] = field(default_factory=dict)  # sandbox user -> the tenant owning its sandbox
    client_info: dict[str, dict[str, Any]] = field(default_factory=dict)  # client user -> {name, created_at, limits} (api-key ls)
    # The limits of every client tenant without its own (TenantLimits' fields; empty: none). Placement
    # reads these and each key's ``limits`` from KV dsec_tenants, which `dsec api-key` keeps in step.
    default_limits: dict[str, Any] = field(default_factory=dict)

    @property
    def control_key_bytes(self) -> bytes:
        return parse_key(self.control_key)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> "AuthConfig":
        p = Path(path)
        if p.exists():
            d = json.loads(p.read_text())
            cfg = cls(
                passwords=d.get("passwords", {}), sandbox_users=d.get("sandbox_users", {}), client_users=d.get("client_users", {}),
                control_key=d.get("control_key", ""), sandbox_tenants=d.get("sandbox_tenants", {}), client_info=d.get("client_info", {}),
                default_limits=d.get("default_limits", {}),
            )
        else:
            cfg = cls()
        changed = False
        for role in SERVICE_ROLES:
            if role not in cfg.passwords:
                cfg.passwords[role] = secrets.token_urlsafe(24)
                changed = True
        if not cfg.control_key:
            cfg.control_key = new_control_key()
            changed = True
        if changed or not p.exists():
            cfg.save(p)
        return cfg

    def save(self, path: str | os.PathLike[str]) -> None:
        _write_private(Path(path), {
            "passwords": self.passwords, "sandbox_users": self.sandbox_users, "client_users": self.client_users, "control_key": self.control_key,
            "sandbox_tenants": self.sandbox_tenants, "client_info": self.client_info, "default_limits": self.default_limits,
        })

    def issue_sandbox_credential(self, sandbox_id: str, tenant: str = S.OPERATOR_TENANT) -> tuple[str, str]:
        """A credential for code inside ``sandbox_id`` (owned by ``tenant``): its own ops only."""
        user = SANDBOX_USER_PREFIX + S._tok(sandbox_id)
        pw = self.sandbox_users.get(user) or secrets.token_urlsafe(24)
        self.sandbox_users[user] = pw
        self.sandbox_tenants[user] = S._tok(tenant)
        return user, pw

    def issue_client_credential(self, name: str, password: str | None = None, label: str = "") -> tuple[str, str]:
        """A named SDK client's user and password: a tenant (nats-server must reload its config to know it)."""
        user = CLIENT_USER_PREFIX + S._tok(name)
        pw = self.client_users.get(user) or password or secrets.token_urlsafe(24)
        self.client_users[user] = pw
        self.client_info.setdefault(user, {"name": label or name, "created_at": time.time()})
        return user, pw

    def revoke_client(self, user: str) -> bool:
        """Forget a client's credential (after a reload nats-server drops its connections); False if unknown."""
        self.client_info.pop(user, None)
        return self.client_users.pop(user, None) is not None

    def config_block(self, *, anonymous: bool = False) -> str:
        """The ``authorization`` block for nats-server's config file. ``anonymous`` (development only)
        makes a connection without credentials the tenant ``client``."""
        users = [{"user": role, "password": pw, "permissions": ROLE_PERMISSIONS[role]} for role, pw in self.passwords.items() if role in ROLE_PERMISSIONS]
        for user, pw in self.sandbox_users.items():
            tenant = self.sandbox_tenants.get(user, S.OPERATOR_TENANT)
            users.append({"user": user, "password": pw, "permissions": sandbox_permissions(user.removeprefix(SANDBOX_USER_PREFIX), tenant)})
        for user, pw in self.client_users.items():
            users.append({"user": user, "password": pw, "permissions": client_permissions(user)})
        if anonymous:
            users.append({"user": ANONYMOUS_USER, "password": secrets.token_urlsafe(24), "permissions": client_permissions(ANONYMOUS_USER)})
        # nats-server's config format accepts JSON values.
        return "authorization {\n  users: " + json.dumps(users) + "\n}\n" + (f"no_auth_user: {ANONYMOUS_USER}\n" if anonymous else "")

    def url_for(self, role: str, base_url: str) -> str:
        """``base_url`` with the credentials of a service role, a named client or a sandbox user."""
        pw = self.passwords.get(role) or self.client_users.get(role) or self.sandbox_users[role]
        return with_credentials(base_url, role, pw)


# --- the client context ------------------------------------------------------------------------
# `dsec up` writes the operator's URL and credential to <data-dir>/client.json (0600) and a pointer
# to it at a well-known place, so that `dsec ...` and the SDK on the same machine reach the stack
# as the operator without flags. DSEC_NATS_URL overrides the whole context, DSEC_NATS_CREDS its
# credential; DSEC_CONTEXT names another pointer (or context) file.
CONTEXT_ENV = "DSEC_CONTEXT"
CLIENT_CONTEXT_FILE = "client.json"


@dataclass(frozen=True)
class ClientContext:
    nats_url: str  # without credentials
    user: str = ""
    password: str = ""
    data_dir: str = ""
    path: str = ""  # the file it was read from

    @property
    def url(self) -> str:
        """The URL with the credential in it, unless DSEC_NATS_CREDS supplies one."""
        if not self.user or os.environ.get("DSEC_NATS_CREDS"):
            return self.nats_url
        return with_credentials(self.nats_url, self.user, self.password)


def default_context_path() -> Path:
    if os.environ.get(CONTEXT_ENV):
        return Path(os.environ[CONTEXT_ENV])
    # /run is root's and gone at reboot, with the stack it points to.
    return Path("/run/dsec/context.json") if os.geteuid() == 0 else Path.home() / ".config" / "dsec" / "context.json"


def _write_private(path: Path, obj: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def write_client_context(data_dir: str | os.PathLike[str], nats_url: str, user: str, password: str, pointer: Path | None = None) -> Path:
    """Write ``<data_dir>/client.json`` and point ``pointer`` (default: :func:`default_context_path`) at it."""
    ctx = Path(data_dir) / CLIENT_CONTEXT_FILE
    _write_private(ctx, {"nats_url": nats_url, "user": user, "password": password, "data_dir": str(data_dir)})
    _write_private(pointer or default_context_path(), {"context": str(ctx)})
    return ctx


def remove_client_context(data_dir: str | os.PathLike[str], pointer: Path | None = None) -> None:
    """Remove the pointer if it still names this data dir's context (another stack may have taken it)."""
    p = pointer or default_context_path()
    try:
        if json.loads(p.read_text()).get("context") == str(Path(data_dir) / CLIENT_CONTEXT_FILE):
            p.unlink()
    except (OSError, ValueError, AttributeError):
        pass


_ctx_cache: dict[tuple[str, int, int], ClientContext | None] = {}


def load_client_context(path: Path | None = None) -> ClientContext | None:
    """The context a pointer (or context) file names; None when there is none this user may read."""
    p = path or default_context_path()
    try:
        st = p.stat()
    except OSError:
        return None
    key = (str(p), st.st_mtime_ns, st.st_size)
    if key not in _ctx_cache:  # nats_url() asks on every connect: read the file only when it changed
        _ctx_cache.clear()
        _ctx_cache[key] = _read_context(p)
    return _ctx_cache[key]


def _read_context(p: Path, follow: bool = True) -> ClientContext | None:
    try:
        d = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict):
        return None
    if follow and isinstance(d.get("context"), str):
        return _read_context(Path(d["context"]), follow=False)
    if not isinstance(d.get("nats_url"), str):
        return None
    return ClientContext(d["nats_url"], str(d.get("user", "")), str(d.get("password", "")), str(d.get("data_dir", "")), str(p))


def with_credentials(url: str, user: str, password: str) -> str:
    """``url`` with ``user``:``password``; a seed list (comma-separated, a NATS cluster's nodes) gets
    them on every URL, since a reconnect to another node presents that node's URL's credentials."""
    out = []
    for u in split_urls(url):
        parts = urlsplit(u)
        netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
        out.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))
    return ",".join(out)


def split_urls(url: str) -> list[str]:
    """The URLs of a seed list: ``nats://a:4222, nats://b:4222`` (one URL is a list of one)."""
    return [u.strip() for u in url.split(",") if u.strip()]


def redact_url(url: str) -> str:
    """``url`` (or a comma-separated list) with any password replaced: for printing."""
    out = []
    for u in url.split(","):
        parts = urlsplit(u)
        if parts.password is None:
            out.append(u)
            continue
        netloc = f"{quote(unquote(parts.username or ''), safe='')}:***@{parts.hostname}:{parts.port}"
        out.append(urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment)))
    return ",".join(out)
