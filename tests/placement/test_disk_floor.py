"""Placement and a host's free disk (the heartbeat's ``disk_free_mb``): no creates under the floor."""

from __future__ import annotations

from placement import HostTable, Policy

from .test_table import host, spec


def test_host_under_the_free_space_floor_gets_no_creates() -> None:
    t = HostTable(Policy(min_disk_free_mb=1024))
    t.update(host("full", disk_free_mb=1))  # a full data dir reports 1 (0 is "not reported")
    t.update(host("low", disk_free_mb=1023))
    assert t.why_not(t.hosts["full"], spec()) == "disk-full" and t.why_not(t.hosts["low"], spec()) == "disk-full"
    assert t.choose(spec()) is None
    # Positive controls: at the floor, and a host that does not report free space (older hosts).
    t.update(host("ok", disk_free_mb=1024))
    assert t.why_not(t.hosts["ok"], spec()) == "" and t.choose(spec()) == "ok"
    t2 = HostTable(Policy(min_disk_free_mb=1024))
    t2.update(host("old"))
    assert t2.choose(spec()) == "old"
