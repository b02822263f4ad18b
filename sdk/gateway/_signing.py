"""Per-sandbox envd access tokens and the signed ``/files`` URLs the e2b SDK makes with them.

The e2b SDK signs a file URL itself (``download_url``/``upload_url``): ``v1_`` + base64(sha256(
``path:operation:user:token[:expiration]``)), the token being the sandbox's ``envdAccessToken``.
Here that token is the API key (what NATS checks when the gateway acts for the caller) followed by
``~`` and an HMAC of the sandbox id under a secret of this gateway process, so a signature made for
one sandbox is worthless on another sandbox of the same key. A signed URL carries no key: the
gateway remembers, per sandbox, the key that its token was handed to (create, connect, get, any
envd call), in memory only, so a URL signed before a gateway restart works again once the sandbox's
owner has used the sandbox through the new process.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets
import time
from collections import OrderedDict

from bus.errors import DsecError

TOKEN_SEP = "~"
REMEMBERED = 100_000  # sandbox -> key entries kept (least recently used dropped)


class BadSignature(DsecError):
    """A signed file URL whose signature is wrong, expired, or cannot be checked."""

    code = "bad_signature"
    http_status = 401


def key_of_token(token: str) -> str:
    """The API key inside an envd access token (a bare key is its own token)."""
    return token.partition(TOKEN_SEP)[0]


def e2b_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """The e2b SDK's v1 file-URL signature (``e2b.sandbox.signature.get_signature``)."""
    raw = f"{path}:{operation}:{user}:{token}" + ("" if expiration is None else f":{expiration}")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


class Signer:
    def __init__(self, secret: bytes | None = None) -> None:
        self.secret = secret or secrets.token_bytes(32)
        self._keys: OrderedDict[str, str] = OrderedDict()

    def token(self, key: str, sid: str) -> str:
        """The envd access token of sandbox ``sid`` for ``key``; remembers the pair for signed URLs."""
        self.remember(sid, key)
        tag = hmac.new(self.secret, f"{sid}\0{key}".encode(), hashlib.sha256).digest()
        return f"{key}{TOKEN_SEP}{base64.urlsafe_b64encode(tag[:18]).decode()}"

    def remember(self, sid: str, key: str) -> None:
        self._keys[sid] = key
        self._keys.move_to_end(sid)
        while len(self._keys) > REMEMBERED:
            self._keys.popitem(last=False)

    def forget(self, sid: str) -> None:
        self._keys.pop(sid, None)

    def check(self, sid: str, method: str, query: dict[str, str]) -> str:
        """The API key a signed ``/files`` request acts as; BadSignature (401) when the signature is
        wrong, expired, or cannot be checked here."""
        sig = query.get("signature", "")
        raw_exp = query.get("signature_expiration")
        expiration: int | None = None
        if raw_exp is not None:
            try:
                expiration = int(raw_exp)
            except ValueError:
                raise BadSignature(f"signature_expiration must be a unix time, got {raw_exp!r}") from None
            if expiration < time.time():
                raise BadSignature("signature is already expired")
        key = self._keys.get(sid)
        if key is None:
            raise BadSignature(f"this gateway cannot check signatures for sandbox {sid} (its owner has not used it here since the gateway started)")
        operation = "read" if method == "GET" else "write"
        want = e2b_signature(query.get("path", ""), operation, query.get("username", ""), self.token(key, sid), expiration)
        if not hmac.compare_digest(want.encode(), sig.encode()):
            raise BadSignature("invalid signature")
        return key


__all__ = ["BadSignature", "Signer", "TOKEN_SEP", "e2b_signature", "key_of_token"]
