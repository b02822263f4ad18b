"""`dsec up`'s restart policy and the client context, without a stack."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path

import pytest

from bus.auth import load_client_context, redact_url, remove_client_context, write_client_context
from bus.runtime import nats_url
from sdk import _up


class _Fake(_up.Supervised):
    """A process record whose process is only pretended (the policy is what is under test)."""

    def _launch(self) -> None:
        pass

    def pid(self) -> int | None:
        return 1

    def poll(self) -> int | None:
        return None

    def _terminate(self, grace: float) -> None:
        pass


def test_backoff_grows_with_jitter_is_capped_and_resets_after_a_stable_run(monkeypatch: pytest.MonkeyPatch) -> None:
    s = _Fake("svc", Path("/dev/null"), 1.0)
    delays = []
    for _ in range(12):
        s.start()
        delays.append(s.exited(1))
    assert all(d > 0 for d in delays)
    # Each delay is within [0.5, 1] of base * 2^n, capped.
    for n, d in enumerate(delays):
        ceiling = min(_up.BACKOFF_CAP_S, _up.BACKOFF_BASE_S * 2**n)
        assert 0.5 * ceiling <= d <= ceiling, (n, d)
    assert max(delays) <= _up.BACKOFF_CAP_S
    assert s.state == "backoff" and s.last_exit == 1 and s.up_since is None
    # A run longer than STABLE_S: the next exit starts again at the base delay.
    s.start()
    s.started_mono = time.monotonic() - _up.STABLE_S - 1
    assert s.exited(-9) <= _up.BACKOFF_BASE_S and s.failures == 1
    view = s.view()
    assert view["last_exit"] == -9 and view["state"] == "backoff" and view["pid"] is None


def test_exit_text() -> None:
    assert _up.exit_text(-9) == "signal 9 (SIGKILL)" and _up.exit_text(3) == "code 3"


def test_adding_a_service_is_one_entry() -> None:
    names = [s.name for s in _up.SERVICES]
    assert names[-1] == "hostagent"  # stopped first
    assert len(set(names)) == len(names)


def test_client_context_pointer_override_and_redaction(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pointer = tmp_path / "ptr.json"
    monkeypatch.setenv("DSEC_CONTEXT", str(pointer))
    monkeypatch.delenv("DSEC_NATS_URL", raising=False)
    monkeypatch.delenv("DSEC_NATS_CREDS", raising=False)
    assert load_client_context() is None
    ctx_file = write_client_context(tmp_path / "data", "nats://127.0.0.1:4999", "admin", "s3cr/t")
    assert stat.S_IMODE(ctx_file.stat().st_mode) == 0o600 and stat.S_IMODE(pointer.stat().st_mode) == 0o600
    ctx = load_client_context()
    assert ctx is not None and ctx.data_dir == str(tmp_path / "data")
    assert nats_url() == "nats://admin:s3cr%2Ft@127.0.0.1:4999"
    assert "s3cr" not in redact_url(nats_url()) and redact_url(nats_url()).startswith("nats://admin:***@")
    monkeypatch.setenv("DSEC_NATS_CREDS", "/some/user.creds")  # a credential of its own: the context's URL only
    assert nats_url() == "nats://127.0.0.1:4999"
    monkeypatch.setenv("DSEC_NATS_URL", "nats://elsewhere:4222")  # the environment wins
    assert nats_url() == "nats://elsewhere:4222" and nats_url("nats://x:1") == "nats://x:1"
    monkeypatch.delenv("DSEC_NATS_URL")
    # Another stack took the pointer: removing ours leaves theirs.
    pointer.write_text(json.dumps({"context": "/elsewhere/client.json"}))
    remove_client_context(tmp_path / "data")
    assert pointer.exists()
    write_client_context(tmp_path / "data", "nats://127.0.0.1:4999", "admin", "pw")
    remove_client_context(tmp_path / "data")
    assert not pointer.exists() and load_client_context() is None


def test_unreadable_context_is_no_context() -> None:
    """A context file this user may not read is no context. Root reads any file, so as root the
    reads run as nobody (effective uid/gid 65534, put back after)."""
    d = Path(tempfile.mkdtemp(prefix="dsec-ctx-"))
    d.chmod(0o755)  # not under tmp_path (0700): nobody must get as far as the file's own mode
    try:
        readable, unreadable = d / "ok.json", d / "secret.json"
        for f in (readable, unreadable):
            f.write_text(json.dumps({"nats_url": "nats://x:1"}))
            f.chmod(0o644)
        unreadable.chmod(0)
        root = os.geteuid() == 0
        if root:
            os.setegid(65534)
            os.seteuid(65534)
        try:
            assert load_client_context(readable) is not None  # positive control: the same reader, a readable file
            assert load_client_context(unreadable) is None
        finally:
            if root:
                os.seteuid(0)
                os.setegid(0)
    finally:
        shutil.rmtree(d, ignore_errors=True)
