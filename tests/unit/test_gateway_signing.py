"""The gateway's envd tokens and signed file URLs (sdk/gateway/_signing) against the e2b SDK's own
signing code: what the SDK signs, the gateway accepts; anything else is a BadSignature (401)."""

from __future__ import annotations

import time

import pytest
from e2b.sandbox.signature import get_signature

from sdk.gateway._signing import BadSignature, Signer, e2b_signature, key_of_token

KEY = "dsec_alice-1234.secretpart"


def test_signature_is_the_sdks() -> None:
    for exp in (None, 120):
        sdk = get_signature("dir/f.txt", "read", "user", "tok", exp)
        assert e2b_signature("dir/f.txt", "read", "user", "tok", sdk["expiration"]) == sdk["signature"]


def test_token_binds_key_and_sandbox() -> None:
    s = Signer(b"k" * 32)
    t1, t2 = s.token(KEY, "sb1"), s.token(KEY, "sb2")
    assert t1 != t2 and key_of_token(t1) == key_of_token(t2) == KEY
    assert key_of_token(KEY) == KEY  # a bare key is its own token
    assert Signer(b"j" * 32).token(KEY, "sb1") != t1  # another gateway secret, another token


def test_check() -> None:
    s = Signer()
    tok = s.token(KEY, "sb1")
    s.token(KEY, "sb2")
    good = get_signature("f.txt", "read", "user", tok, 60)
    q = {"path": "f.txt", "username": "user", "signature": good["signature"], "signature_expiration": str(good["expiration"])}
    assert s.check("sb1", "GET", q) == KEY  # positive control
    cases = [
        ("sb2", "GET", q, "invalid signature"),  # another sandbox of the same key
        ("sb1", "POST", q, "invalid signature"),  # a read signature does not write
        ("sb1", "GET", {**q, "path": "/etc/passwd"}, "invalid signature"),
        ("sb1", "GET", {**q, "username": "root"}, "invalid signature"),
        ("sb1", "GET", {**q, "signature_expiration": str(int(time.time()) - 1)}, "signature is already expired"),
        ("sb1", "GET", {**q, "signature_expiration": "soon"}, "signature_expiration must be a unix time, got 'soon'"),
        ("sb3", "GET", q, "this gateway cannot check signatures for sandbox sb3"),
    ]
    for sid, method, query, why in cases:
        with pytest.raises(BadSignature) as ei:
            s.check(sid, method, query)
        assert ei.value.code == "bad_signature" and ei.value.http_status == 401
        assert ei.value.description.startswith(why), (sid, method, query, ei.value.description)
    s.forget("sb1")
    with pytest.raises(BadSignature):
        s.check("sb1", "GET", q)
    # No expiration: valid until the token changes.
    forever = get_signature("f.txt", "write", "", s.token(KEY, "sb1"), None)
    assert s.check("sb1", "POST", {"path": "f.txt", "signature": forever["signature"]}) == KEY
