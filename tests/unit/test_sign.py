"""bus.sign: placement's HMAC over host work, and the control key dsec up keeps with the NATS users."""

from __future__ import annotations

import os
import stat

import pytest

from bus import subjects as S
from bus.auth import AuthConfig
from bus.sign import ENV_CONTROL_KEY, load_control_key, new_control_key, parse_key, sign_headers, verify


def test_signed_work_verifies_and_any_change_does_not() -> None:
    key = parse_key(new_control_key())
    subj, data = S.host_create("h1"), b"\x81\xa4type\xacPlaceSandbox"
    h = sign_headers(key, subj, data, {S.HDR_MSG_ID: "x:0"})
    assert h[S.HDR_MSG_ID] == "x:0" and verify(key, subj, data, h)
    assert not verify(key, subj, data + b"x", h)
    assert not verify(key, S.host_create("h2"), data, h)  # bound to the host's subject
    assert not verify(parse_key(new_control_key()), subj, data, h)
    assert not verify(key, subj, data, {S.HDR_MSG_ID: "x:0"})
    assert not verify(key, subj, data, None)
    assert not verify(key, subj, data, {S.HDR_SIGNATURE: "0" * 64})


def test_without_a_key_nothing_is_signed_or_checked() -> None:
    assert sign_headers(None, "s", b"d", {"a": "b"}) == {"a": "b"}
    assert verify(None, "s", b"d", None)


def test_key_sources(tmp_path) -> None:
    k = new_control_key()
    f = tmp_path / "key"
    f.write_text(k + "\n")
    assert load_control_key(f, env={}) == bytes.fromhex(k)
    assert load_control_key(None, env={ENV_CONTROL_KEY: k}) == bytes.fromhex(k)
    assert load_control_key(None, env={}) is None
    with pytest.raises(ValueError):
        parse_key("abcd")


def test_auth_config_keeps_one_control_key_in_a_private_file(tmp_path) -> None:
    p = tmp_path / "auth.json"
    a = AuthConfig.load_or_create(p)
    assert len(a.control_key_bytes) == 32
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    assert AuthConfig.load_or_create(p).control_key == a.control_key
