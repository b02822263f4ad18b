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
from urllib.parse import quote, urlsplit, urlunsplit

from . import subjects as S
from .sign import new_control_key, parse_key

# JetStream API calls a read-only client needs: stream/KV info, direct gets, and ephemeral ordered
# consumers on the event stream and the KV buckets it may read (never on the work queues).
_CLIENT_READ_STREAMS = [S.STREAM_EVT, f"KV_{S.KV_HOSTS}", f"KV_{S.KV_IMAGES}", f"KV_{S.KV_SANDBOXES}", f"KV_{S.KV_SNAPSHOTS}"]


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
    S.REQ_CREATE, S.REQ_CREATE_BATCH, S.SBX_WILDCARD, S.STATUS, "dsec.img.>", f"$KV.{S.KV_LEASES}.>",
    f"$JS.API.STREAM.INFO.KV_{S.KV_LEASES}", *_client_js_api(),
]

ROLE_PERMISSIONS: dict[str, dict] = {
    # Services are trusted processes of the control plane.
    "placement": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "$KV.>", "dsec.>"]}},
    "hostagent": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True},
    "imaged": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "$O.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>", "$O.>"]}, "allow_responses": True},
    "guard": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True},
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
    # What the SDK and the CLI get without credentials (connected through bus.runtime.connect, which
    # puts their inboxes under _INBOX.u.client).
    "client": {
        "publish": {"allow": _CLIENT_PUBLISH},
        "subscribe": {"allow": [f"{NAMED_INBOXES}.{ANONYMOUS_USER}.>", S.EVT_SANDBOX_ALL]},
    },
}

SERVICE_ROLES = ("placement", "hostagent", "imaged", "guard", "admin")
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
        parts = urlsplit(base_url)
        netloc = f"{quote(role, safe='')}:{quote(pw, safe='')}@{parts.hostname}:{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
