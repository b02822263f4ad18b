"""The pure rules of host loss (placement._hostloss) and of ``dsec up --hosts`` (sdk._up.host_net)."""

from __future__ import annotations

import argparse

import pytest

from bus.errors import InvalidArgument
from bus.messages import SandboxRecord, SandboxSpec, SnapshotRecord
from placement._hostloss import lost_on_host, restore_spec
from sdk._up import host_net


def rec(state: str, host: str = "h1", snapshot_id: str = "") -> SandboxRecord:
    return SandboxRecord(spec=SandboxSpec(sandbox_id="s1"), state=state, host_id=host, snapshot_id=snapshot_id)  # type: ignore[arg-type]


def test_what_dies_with_its_host() -> None:
    for state in ("creating", "placed", "running", "paused", "stopping"):
        assert lost_on_host(rec(state), "h1"), state
    assert not lost_on_host(rec("running"), "h2")  # another host's
    for state in ("gone", "lost", "failed", "killed"):
        assert not lost_on_host(rec(state), "h1"), state  # already ended
    assert not lost_on_host(rec("paused", snapshot_id="snap-1"), "h1")  # a persisted pause lives in its snapshot


def test_a_restore_is_the_same_id_one_generation_up_from_the_snapshot() -> None:
    spec = SandboxSpec(sandbox_id="s1", template="base", generation=2, create_deadline=5.0, reply_to="_INBOX.x", batch_id="b", restore_on_host_loss=True)
    snap = SnapshotRecord(snapshot_id="snap-9", sandbox_id="s1", template="tmpl", created_at=1.0)
    new = restore_spec(spec, snap, 100.0)
    assert (new.sandbox_id, new.generation, new.snapshot, new.template) == ("s1", 3, "snap-9", "tmpl")
    assert (new.requested_at, new.create_deadline, new.reply_to, new.batch_id) == (100.0, 0.0, "", "")
    assert new.restore_on_host_loss and spec.generation == 2  # the original is not changed


def args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"hosts": 3, "hosts_net": "10.199.0.0/16", "hosts_prefix": "dsh", **kw})


def test_hosts_net_layout() -> None:
    assert host_net(args(hosts=0)) is None
    h = host_net(args())
    assert h is not None
    assert h.pools == ("10.199.0.0/24", "10.199.1.0/24", "10.199.2.0/24")
    assert h.link_net == "10.199.255.0/24" and h.gateway == "10.199.255.1" and h.address(2) == "10.199.255.12"
    assert (h.netns(1), h.link(1), h.net_prefix(1), h.bridge) == ("dsec-dsh-host1", "dshh1", "dsh1", "dshbr")
    assert h.enter(0) == ["nsenter", "--net=/run/netns/dsec-dsh-host0", "--"]
    small = host_net(args(hosts_net="10.210.4.0/22"))  # a test slot's /22: three hosts and the links
    assert small is not None and small.link_net == "10.210.7.0/24"


@pytest.mark.parametrize("kw, code_text", [
    ({"hosts_net": "10.210.4.0/23"}, "holds 2 /24s: 3 hosts need 4"),
    ({"hosts_net": "not-a-net"}, "--hosts-net"),
    ({"hosts_prefix": "xx"}, "--hosts-prefix"),
    ({"hosts_prefix": "dshtoolong"}, "--hosts-prefix"),
])
def test_bad_hosts_options_are_refused(kw: dict[str, object], code_text: str) -> None:
    with pytest.raises(InvalidArgument) as ei:
        host_net(args(**kw))
    assert ei.value.code == "invalid_argument" and code_text in ei.value.description


def test_hosts_sandboxes_are_denied_every_host_and_the_root_namespace_rules_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each host's agent denies every link address and every host's pool (on top of a deny list of
    its own); the root namespace's ruleset is one nft transaction that nft accepts (checked, not applied)."""
    import shutil
    import subprocess

    monkeypatch.setenv("DSEC_NET_DENY", "203.0.113.0/24")
    net = host_net(args())
    assert net is not None
    for i in range(3):
        deny = net.env(i)["DSEC_NET_DENY"].split(",")
        assert deny == ["203.0.113.0/24", net.link_net, *net.pools]
        assert net.env(i)["DSEC_NET_STATE_DIR"] == f"/run/dsec/hostns/dsh{i}"  # apart from the root namespace's agents'
    assert len({net.state_dir(i) for i in range(3)}) == 3
    for guard in (False, True):
        text = net.ruleset(guard)
        assert f"ip saddr {net.link_net} oifname != \"{net.bridge}\" masquerade" in text
        assert f"ip daddr != {net.gateway}" in text and ("forward iifname != \"ds*\"" in text) == guard
        if shutil.which("nft") and subprocess.run(["nft", "list", "tables"], capture_output=True).returncode == 0:
            r = subprocess.run(["nft", "-c", "-f", "-"], input=text, capture_output=True, text=True)
            assert r.returncode == 0, r.stderr
