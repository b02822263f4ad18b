"""NATS authentication and per-subject permissions for the control plane.

Each service role gets its own user with only the subjects it needs; anything that connects
without credentials is the ``client`` role (``no_auth_user``), which can ask for sandboxes and talk
to them but can neither publish placement work, events or KV writes nor consume work queues.

Every user keeps its reply inboxes under its own prefix, ``_INBOX.u.<user>`` (see
:func:`inbox_prefix`; ``bus.runtime.connect`` sets it from the URL's user name, ``client`` without
one), and only services may subscribe to other prefixes: an anonymous connection subscribed to
``_INBOX.>`` would otherwise read the services' work deliveries (sandbox specs with their envs) and
every client's replies. (A deny on ``_INBOX.u.>`` is not enough: the server checks a deny against
a JetStream delivery's original subject, not the inbox it goes to.) Anonymous clients still share
one inbox space with each other (a dev stack's single user); a client that needs its own issues a
credential (:meth:`AuthConfig.issue_client_credential`).
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit, urlunsplit

from . import subjects as S
from .sign import new_control_key, parse_key

# JetStream API calls a read-only client needs: stream/KV info, direct gets, and ephemeral ordered
# consumers on the event stream and the KV buckets it may read (never on the work queues).
_CLIENT_READ_STREAMS = [
    S.STREAM_EVT, f"KV_{S.KV_HOSTS}", f"KV_{S.KV_IMAGES}", f"KV_{S.KV_SANDBOXES}", f"KV_{S.KV_SNAPSHOTS}", S.STREAM_TRAJ, f"KV_{S.KV_ROLLOUTS}",
]


NAMED_INBOXES = "_INBOX.u"
ANONYMOUS_USER = "client"  # nats-server's no_auth_user


def inbox_prefix(user: str) -> str:
    """Where a named NATS user's reply inboxes live; nobody else may subscribe beneath it."""
    return f"{NAMED_INBOXES}.{S._tok(user)}"


def _client_js_api() -> list[str]:
    allow = ["$JS.API.INFO", "$JS.FC.>"]
    for st in _CLIENT_READ_STREAMS:
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


# Leases are the one KV write a client makes (the SDK renews its owner key; hosts only read revisions).
_CLIENT_PUBLISH = [
    S.REQ_CREATE, S.REQ_CREATE_BATCH, S.SBX_WILDCARD, S.FN_CALL_WILDCARD, S.STATUS, "dsec.img.>", f"$KV.{S.KV_LEASES}.>",
    f"$JS.API.STREAM.INFO.KV_{S.KV_LEASES}", *_client_js_api(),
    # rollout jobs: submitted, and looked up while queued (direct gets only: no consumer on a work queue)
    f"{S.PREFIX}.rollout.>", f"{S.PREFIX}.model.>", f"$JS.API.STREAM.MSG.GET.{S.STREAM_ROLLOUTS}", f"$JS.API.DIRECT.GET.{S.STREAM_ROLLOUTS}.>",
]

OPERATOR_ROLE = "admin"  # whom the client context (below) speaks for: the operator of a `dsec up` stack
MONITOR_ROLE = "monitor"  # the gateway's /metrics and /dashboard: scrape every service, read hosts, sandboxes, events
ENV_MONITOR_URL = "DSEC_MONITOR_NATS_URL"  # the monitor's NATS URL, handed to the gateway by `dsec up`

ROLE_PERMISSIONS: dict[str, dict] = {
    # Services are trusted processes of the control plane.
    "placement": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "$KV.>", "dsec.>"]}},
    "hostagent": {
        "publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True,
    },
    "imaged": {
        "publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "$O.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>", "$O.>"]},
        "allow_responses": True,
    },
    # Rollout workers: a client of sandboxes that also takes jobs from the rollout queues and keeps their state.
    "rollouts": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}},
    "guard": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True},
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
    # Read-only: asks for metrics (the services answer its inbox), reads KV and the event stream, hears events.
    MONITOR_ROLE: {
        "publish": {"allow": [S.METRICS_SCRAPE, *_client_js_api()]},
        "subscribe": {"allow": [f"{NAMED_INBOXES}.{MONITOR_ROLE}.>", S.EVT_ALL]},
    },
    # What the SDK and the CLI get without credentials (connected through bus.runtime.connect, which
    # puts their inboxes under _INBOX.u.client).
    "client": {
        "publish": {"allow": _CLIENT_PUBLISH},
        "subscribe": {"allow": [f"{NAMED_INBOXES}.{ANONYMOUS_USER}.>", S.EVT_SANDBOX_ALL]},
    },
}

SERVICE_ROLES = ("placement", "hostagent", "imaged", "guard", "admin", MONITOR_ROLE, "rollouts")
SANDBOX_USER_PREFIX = "sbx-"
CLIENT_USER_PREFIX = "cli-"


def sandbox_permissions(sandbox_id: str) -> dict:
    """A credential handed to code inside a sandbox reaches only that sandbox's own subjects."""
    return {
        "publish": {"allow": [S.sbx(sandbox_id, "*")]},
        "subscribe": {"allow": [f"{inbox_prefix(SANDBOX_USER_PREFIX + sandbox_id)}.>"]},
    }


def client_permissions(user: str) -> dict:
    """A named SDK client: what the anonymous client may do, with replies only under its own inbox prefix."""
    return {
        "publish": {"allow": list(_CLIENT_PUBLISH)},
        "subscribe": {"allow": [f"{inbox_prefix(user)}.>", S.EVT_SANDBOX_ALL]},
    }


@dataclass
class AuthConfig:
    """Users and passwords of one deployment; stored 0600 under the data dir."""

    passwords: dict[str, str] = field(default_factory=dict)
    sandbox_users: dict[str, str] = field(default_factory=dict)
    client_users: dict[str, str] = field(default_factory=dict)
    # Hex HMAC key placement signs host work with (bus.sign); only placement and host agents get it.
    control_key: str = ""

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
                control_key=d.get("control_key", ""),
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
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(
                {"passwords": self.passwords, "sandbox_users": self.sandbox_users, "client_users": self.client_users, "control_key": self.control_key}, f
            )
        os.replace(tmp, p)

    def issue_sandbox_credential(self, sandbox_id: str) -> tuple[str, str]:
        user = SANDBOX_USER_PREFIX + S._tok(sandbox_id)
        pw = self.sandbox_users.get(user) or secrets.token_urlsafe(24)
        self.sandbox_users[user] = pw
        return user, pw

    def issue_client_credential(self, name: str) -> tuple[str, str]:
        """A named SDK client's user and password (nats-server must reload its config to know it)."""
        user = CLIENT_USER_PREFIX + S._tok(name)
        pw = self.client_users.get(user) or secrets.token_urlsafe(24)
        self.client_users[user] = pw
        return user, pw

    def config_block(self) -> str:
        """The ``authorization`` block for nats-server's config file."""
        users = [{"user": role, "password": pw, "permissions": ROLE_PERMISSIONS[role]} for role, pw in self.passwords.items() if role in ROLE_PERMISSIONS]
        users.append({"user": ANONYMOUS_USER, "password": secrets.token_urlsafe(24), "permissions": ROLE_PERMISSIONS["client"]})
        for user, pw in self.sandbox_users.items():
            users.append({"user": user, "password": pw, "permissions": sandbox_permissions(user.removeprefix(SANDBOX_USER_PREFIX))})
        for user, pw in self.client_users.items():
            users.append({"user": user, "password": pw, "permissions": client_permissions(user)})
        # nats-server's config format accepts JSON values.
        return "authorization {\n  users: " + json.dumps(users) + "\n}\nno_auth_user: " + ANONYMOUS_USER + "\n"

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


def _write_private(path: Path, obj: dict) -> None:
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
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


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
