"""Authenticating the work placement hands to host agents.

NATS checks a client's publish permissions on what it publishes, but not a push consumer's
``deliver_subject`` against its creator's: an anonymous client that may create a consumer on a stream
can have the server deliver that stream's messages onto a host's work subject (under their stored
subject, which the host's hand-off subscription does not match; a literal subscriber would see them).
Work that never went through placement (spec validation, capacity, quotas) must not run, so
placement signs each hand-off with the deployment's control key (``dsec up`` generates it next to
the NATS users, :class:`bus.auth.AuthConfig`) and a host agent with a key refuses anything without a
valid signature. Without a key (a dev stack without auth) nothing is
signed or checked.

Two things stay open on purpose: placement's intake (``dsec.req.create``) can be fed by such a delivery
too, but a client may ask for sandboxes anyway, so that gains nothing; and sandbox ops delivered
this way are refused by their reply subject (``subjects.is_stream_delivery``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Mapping

from . import subjects as S

ENV_CONTROL_KEY = "DSEC_CONTROL_KEY"  # hex
ERR_BAD_SIGNATURE = "bad_signature"  # Dsec-Error-Code of refused work in the dead-letter stream
KEY_BYTES = 32


def new_control_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def parse_key(text: str) -> bytes:
    key = bytes.fromhex(text.strip())
    if len(key) < 16:
        raise ValueError("control key too short (at least 16 bytes, hex encoded)")
    return key


def load_control_key(path: str | os.PathLike[str] | None = None, env: Mapping[str, str] = os.environ) -> bytes | None:
    """The key from ``path`` (a file holding it in hex) or else ``$DSEC_CONTROL_KEY``; None if neither."""
    if path:
        return parse_key(Path(path).read_text())
    text = env.get(ENV_CONTROL_KEY)
    return parse_key(text) if text else None


def signature(key: bytes, subject: str, data: bytes) -> str:
    # The subject is bound in so a hand-off for one host is not valid work for another.
    mac = hmac.new(key, subject.encode(), hashlib.sha256)
    mac.update(b"\0")
    mac.update(data)
    return mac.hexdigest()


def sign_headers(key: bytes | None, subject: str, data: bytes, headers: dict[str, str] | None = None) -> dict[str, str]:
    """``headers`` plus the signature (unchanged without a key)."""
    h = dict(headers or {})
    if key is not None:
        h[S.HDR_SIGNATURE] = signature(key, subject, data)
    return h


def verify(key: bytes | None, subject: str, data: bytes, headers: Mapping[str, str] | None) -> bool:
    """True when no key is configured, or the message carries a valid signature for it."""
    if key is None:
        return True
    got = (headers or {}).get(S.HDR_SIGNATURE)
    if not isinstance(got, str):
        return False
    return hmac.compare_digest(got, signature(key, subject, data))
