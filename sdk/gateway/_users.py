"""Who a command or file operation runs as, the E2B way.

E2B runs commands with ``/bin/bash -l -c`` as the user named in the ``Authorization: Basic`` header
of an envd request (default ``user``, home ``/home/user``) and resolves relative paths against that
home. dsec honours the named user when the template has the account (``/etc/passwd``; the in-sandbox
agent switches to it; the Python template has ``user``). A template without it — the busybox
``base`` — falls back, documented: no ``user`` account means root with home ``/root`` (or ``/``),
and no ``/bin/bash`` means ``/bin/sh`` runs the command instead.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import posixpath
import shlex
from dataclasses import dataclass, field

from bus.errors import FileNotFound, InvalidArgument

from .._async import AsyncSandbox

DEFAULT_USER = "user"
FACTS_CACHE = 4096


@dataclass
class Account:
    name: str
    uid: int
    gid: int
    home: str


@dataclass
class SandboxFacts:
    """What a template offers, read once per sandbox."""

    bash: bool
    accounts: dict[str, Account] = field(default_factory=dict)
    groups: dict[int, str] = field(default_factory=dict)  # /etc/group: gid -> name


def user_of(authorization: str | None) -> str:
    """The user an envd request names (``Basic base64(user:)``), else E2B's default."""
    if not authorization or not authorization.startswith("Basic "):
        return DEFAULT_USER
    try:
        user = base64.b64decode(authorization[6:], validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise InvalidArgument("Authorization header: not Basic base64(user:)") from None
    return user or DEFAULT_USER


def parse_group(text: str) -> dict[int, str]:
    out: dict[int, str] = {}
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 3 and f[2].isdigit():
            out.setdefault(int(f[2]), f[0])
    return out


def parse_passwd(text: str) -> dict[str, Account]:
    out: dict[str, Account] = {}
    for line in text.splitlines():
        f = line.split(":")
        if len(f) >= 6 and f[2].isdigit() and f[3].isdigit():
            out[f[0]] = Account(name=f[0], uid=int(f[2]), gid=int(f[3]), home=f[5] or "/")
    return out


class Users:
    """Per-sandbox facts (bash, setpriv, accounts), cached; and the account a request runs as."""

    def __init__(self) -> None:
        self._facts: dict[str, SandboxFacts] = {}

    async def facts(self, sb: AsyncSandbox) -> SandboxFacts:
        f = self._facts.get(sb.sandbox_id)
        if f is not None:
            return f

        async def text(path: str) -> str:
            try:
                return str(await sb.files.read(path, length=1 << 20))
            except FileNotFound:
                return ""

        bash, pw, gr = await asyncio.gather(sb.files.exists("/bin/bash"), text("/etc/passwd"), text("/etc/group"))
        f = SandboxFacts(bash=bash, accounts=parse_passwd(pw), groups=parse_group(gr))
        if len(self._facts) >= FACTS_CACHE:
            self._facts.pop(next(iter(self._facts)))
        self._facts[sb.sandbox_id] = f
        return f

    def forget(self, sid: str) -> None:
        self._facts.pop(sid, None)

    async def names(self, sb: AsyncSandbox) -> tuple[dict[int, str], dict[int, str]]:
        """The sandbox's user and group names by id (what an entry's owner and group say)."""
        f = await self.facts(sb)
        users: dict[int, str] = {}
        for a in f.accounts.values():
            users.setdefault(a.uid, a.name)
        return users, f.groups

    async def account(self, sb: AsyncSandbox, user: str) -> Account:
        facts = await self.facts(sb)
        acct = facts.accounts.get(user)
        if acct is None:
            if user != DEFAULT_USER:
                raise InvalidArgument(f"user {user!r} does not exist in sandbox {sb.sandbox_id}")
            root = facts.accounts.get("root")
            home = root.home if root else "/"
            return Account(name="root", uid=0, gid=0, home=home)  # documented fallback (no `user` account)
        return acct

    async def command(self, sb: AsyncSandbox, cmd: str, args: list[str]) -> str:
        """A ``/bin/sh -c`` line that runs ``cmd args`` (the agent runs it as the account)."""
        if cmd == "/bin/bash" and not (await self.facts(sb)).bash:
            cmd = "/bin/sh"  # documented fallback for templates without bash (busybox sh takes -l -c)
        return shlex.join([cmd, *args])


def resolve(path: str, home: str) -> str:
    """A request path made absolute: relative ones start at the user's home (as envd does)."""
    if not isinstance(path, str) or not path:
        raise InvalidArgument("path must be a non-empty string")
    if path.startswith("~"):
        path = home + path[1:]
    return posixpath.normpath(path if path.startswith("/") else posixpath.join(home, path))


__all__ = ["DEFAULT_USER", "Account", "Users", "parse_group", "parse_passwd", "resolve", "user_of"]
