"""The per-tenant upload count (hostagent._uploads): what a write, a chunk, a failure, a remove,
a rename and a sandbox's end do to it."""

from __future__ import annotations

import pytest

from bus.errors import QuotaExceeded
from hostagent._config import HostAgentConfig, _from_env, add_flags
from hostagent._uploads import LIMIT, Uploads


def test_chunks_extend_a_file_and_a_rewrite_replaces_it() -> None:
    live = {"s1", "s2"}
    up = Uploads(1000, live.__contains__)
    up.charge("a", "s1", "/f", 0, 300, True)
    up.charge("a", "s1", "/f", 300, 300, False)  # the next chunk
    assert up.by_tenant() == {"a": 600}
    up.charge("a", "s1", "/f", 0, 100, True)  # rewritten smaller
    assert up.by_tenant() == {"a": 100}
    up.charge("a", "s2", "/g", 0, 900, True)
    with pytest.raises(QuotaExceeded) as exc:
        up.charge("a", "s2", "/h", 0, 1, True)
    assert exc.value.context["limit"] == LIMIT and exc.value.context["used"] == "1000"
    assert up.by_tenant() == {"a": 1000} and up.refused == 1
    up.charge("b", "s3", "/f", 0, 1000, True)  # another tenant: its own bound
    live.add("s3")
    assert up.by_tenant() == {"a": 1000, "b": 1000}


def test_failed_writes_removes_renames_and_ended_sandboxes_give_bytes_back() -> None:
    live = {"s1", "s2"}
    up = Uploads(1000, live.__contains__)
    added = up.charge("a", "s1", "/d/x", 0, 400, True)
    up.refund("s1", "/d/x", added)  # the write failed
    assert up.by_tenant() == {}
    up.charge("a", "s1", "/d/x", 0, 400, True)
    up.charge("a", "s1", "/d/y", 0, 100, True)
    up.renamed("s1", "/d/y", "/d/x")  # over x: x's bytes are gone
    assert up.by_tenant() == {"a": 100}
    up.removed("s1", "/d")  # the directory, and what was uploaded under it
    assert up.by_tenant() == {}
    up.charge("a", "s2", "/z", 0, 1000, True)
    live.discard("s2")  # killed: freed when the bound is next met
    up.charge("a", "s1", "/z", 0, 1000, True)
    assert up.by_tenant() == {"a": 1000}


def test_an_upload_of_known_size_is_reserved_at_its_first_chunk() -> None:
    up = Uploads(1000, lambda _sid: True)
    up.charge("a", "s1", "/f", 0, 100, True, size=600)  # the first of six chunks
    assert up.by_tenant() == {"a": 600}
    up.charge("a", "s1", "/f", 100, 100, False)  # the next ones add nothing
    assert up.by_tenant() == {"a": 600}
    with pytest.raises(QuotaExceeded):
        up.charge("a", "s1", "/g", 0, 100, True, size=401)  # refused whole, at its first chunk
    assert up.by_tenant() == {"a": 600}


def test_no_limit_counts_and_refuses_nothing() -> None:
    up = Uploads(0, lambda _sid: True)
    up.charge("a", "s1", "/f", 0, 10 << 30, True)
    assert up.by_tenant() == {"a": 10 << 30}


def test_the_limit_is_a_setting() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    add_flags(ap, ["container"])
    assert HostAgentConfig().upload_max_bytes_per_tenant == 64 << 30
    assert _from_env(ap.parse_args([]), {"DSEC_UPLOAD_MAX_BYTES_PER_TENANT": "12345"})["upload_max_bytes_per_tenant"] == 12345
    assert _from_env(ap.parse_args(["--upload-max-bytes-per-tenant", "0"]), {})["upload_max_bytes_per_tenant"] == 0
