"""NATS authentication and per-subject permissions for the control plane.

Each service role gets its own user with only the subjects it needs; anything that connects
without credentials is the ``client`` role (``no_auth_user``), which can ask for sandboxes and talk
to them but can neither publish placement work, events or KV writes nor consume work queues.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from . import subjects as S

# JetStream API calls a read-only client needs: stream/KV info, direct gets, and ephemeral ordered
# consumers on the event stream and the KV buckets it may read (never on the work queues).
_CLIENT_READ_STREAMS = [S.STREAM_EVT, f"KV_{S.KV_HOSTS}", f"KV_{S.KV_IMAGES}", f"KV_{S.KV_SANDBOXES}"]


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


ROLE_PERMISSIONS: dict[str, dict] = {
    # Services are trusted processes of the control plane.
    "placement": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "$KV.>", "dsec.>"]}},
    "hostagent": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True},
    "imaged": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "$O.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>", "$O.>"]}, "allow_responses": True},
    "guard": {"publish": {"allow": ["dsec.>", "$JS.>", "$KV.>", "_INBOX.>"]}, "subscribe": {"allow": ["_INBOX.>", "dsec.>", "$KV.>"]}, "allow_responses": True},
    "admin": {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}},
    # What the SDK and the CLI get without credentials.
    "client": {
        "publish": {"allow": [S.REQ_CREATE, S.REQ_CREATE_BATCH, S.SBX_WILDCARD, S.STATUS, "dsec.img.>", *_client_js_api()]},
        "subscribe": {"allow": ["_INBOX.>", S.EVT_SANDBOX_ALL]},
    },
}

SERVICE_ROLES = ("placement", "hostagent", "imaged", "guard", "admin")


def sandbox_permissions(sandbox_id: str) -> dict:
    """A credential handed to code inside a sandbox reaches only that sandbox's own subjects."""
    return {
        "publish": {"allow": [S.sbx(sandbox_id, "*")]},
        "subscribe": {"allow": [f"_INBOX_{sandbox_id}.>"]},
    }


@dataclass
class AuthConfig:
    """Users and passwords of one deployment; stored 0600 under the data dir."""

    passwords: dict[str, str] = field(default_factory=dict)
    sandbox_users: dict[str, str] = field(default_factory=dict)

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> "AuthConfig":
        p = Path(path)
        if p.exists():
            d = json.loads(p.read_text())
            cfg = cls(passwords=d.get("passwords", {}), sandbox_users=d.get("sandbox_users", {}))
        else:
            cfg = cls()
        changed = False
        for role in SERVICE_ROLES:
            if role not in cfg.passwords:
                cfg.passwords[role] = secrets.token_urlsafe(24)
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
            json.dump({"passwords": self.passwords, "sandbox_users": self.sandbox_users}, f)
        os.replace(tmp, p)

    def issue_sandbox_credential(self, sandbox_id: str) -> tuple[str, str]:
        user = f"sbx-{sandbox_id}"
        pw = self.sandbox_users.get(user) or secrets.token_urlsafe(24)
        self.sandbox_users[user] = pw
        return user, pw

    def config_block(self) -> str:
        """The ``authorization`` block for nats-server's config file."""
        users = [{"user": role, "password": pw, "permissions": ROLE_PERMISSIONS[role]} for role, pw in self.passwords.items() if role in ROLE_PERMISSIONS]
        users.append({"user": "client", "password": secrets.token_urlsafe(24), "permissions": ROLE_PERMISSIONS["client"]})
        for user, pw in self.sandbox_users.items():
            users.append({"user": user, "password": pw, "permissions": sandbox_permissions(user.removeprefix("sbx-"))})
        # nats-server's config format accepts JSON values.
        return "authorization {\n  users: " + json.dumps(users) + "\n}\nno_auth_user: client\n"

    def url_for(self, role: str, base_url: str) -> str:
        parts = urlsplit(base_url)
        netloc = f"{quote(role, safe='')}:{quote(self.passwords[role], safe='')}@{parts.hostname}:{parts.port}"
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
