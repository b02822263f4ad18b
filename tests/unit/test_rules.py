"""One spec validation and one admission rule (bus.rules), the same in the SDK, placement and the host."""

from __future__ import annotations

import time

import pytest

from bus.errors import InvalidArgument
from bus.messages import HostStatus, SandboxSpec
from bus.rules import LIMITS, Allocation, Capacity, admits, validate_spec
from hostagent import HostAgent, HostAgentConfig, SimBackend
from placement import HostTable
from sdk import build_spec


@pytest.mark.parametrize(
    ("field", "value"),
    [("cpu", 0.005), ("cpu", 0.0), ("cpu", 257.0), ("timeout_s", 0.5), ("memory_mb", 8), ("disk_mb", 0), ("backend", "docker"), ("backend", "fncall"),
     ("template", "")],
)
def test_sdk_and_placement_refuse_the_same_specs(field: str, value: object) -> None:
    """What placement refuses (validate_spec on any client's request), the SDK refuses first."""
    spec = SandboxSpec(sandbox_id="sb-1", **{"backend": "sim", field: value})
    with pytest.raises(InvalidArgument, match=field):
        validate_spec(spec)
    sdk_name = {"timeout_s": "timeout"}.get(field, field)
    with pytest.raises(InvalidArgument, match=sdk_name):
        build_spec(**({"template": value} if field == "template" else {sdk_name: value}))


def test_bounds_are_inclusive_and_the_sdk_accepts_them() -> None:
    lo = {k: v[0] for k, v in LIMITS.items() if k != "lease_s"}
    spec = build_spec(cpu=lo["cpu"], memory_mb=int(lo["memory_mb"]), disk_mb=int(lo["disk_mb"]), timeout=lo["timeout_s"])
    validate_spec(spec)  # positive control: the smallest allowed values pass both
    assert spec.cpu == 0.01 and spec.timeout_s == 1.0


def _host(mem_overcommit: float) -> tuple[HostAgent, HostStatus]:
    cfg = HostAgentConfig(host_id="h1", mem_overcommit=mem_overcommit, persist_state=False)
    agent = HostAgent(SimBackend(cpu_total=4.0, mem_total_mb=1000, disk_total_mb=10_000), cfg)
    st = HostStatus(
        host_id="h1", backend="sim", at=time.time(), cpu_total=4.0, mem_total_mb=1000, disk_total_mb=10_000,
        cpu_overcommit=agent.config.cpu_overcommit, mem_overcommit=mem_overcommit,
    )
    return agent, st


@pytest.mark.parametrize("mem_overcommit", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("memory_mb", [400, 600, 1000, 1500, 2500])
def test_placement_and_host_agree_on_memory(mem_overcommit: float, memory_mb: int) -> None:
    """mem_overcommit below 1 (a host keeping headroom) is honoured by both, never clamped by one."""
    agent, st = _host(mem_overcommit)
    table = HostTable()
    table.update(st)
    spec = SandboxSpec(sandbox_id="s", backend="sim", cpu=0.1, memory_mb=memory_mb, disk_mb=1)
    host_says = agent.intake.admits(spec)
    placement_says = admits(table.hosts["h1"].cap, table.hosts["h1"].alloc, spec)
    assert bool(host_says) == bool(placement_says), (host_says, placement_says)
    assert bool(host_says) == (memory_mb > 1000 * mem_overcommit)
    if host_says:
        assert placement_says == "memory" and host_says.startswith("memory:")


def test_admits_reasons() -> None:
    cap = Capacity(2.0, 1000, 100, cpu_overcommit=2.0, mem_overcommit=1.0, max_sandboxes=2)
    s = SandboxSpec(sandbox_id="s", cpu=1.0, memory_mb=100, disk_mb=10)
    assert admits(cap, Allocation(), s) == ""
    assert admits(cap, Allocation(sandboxes=2), s) == "max_sandboxes"
    assert admits(cap, Allocation(cpu=3.5), s) == "cpu"
    assert admits(cap, Allocation(mem_mb=950), s) == "memory"
    assert admits(cap, Allocation(disk_mb=95), s) == "disk"
    ls = SandboxSpec(sandbox_id="s", cpu=1.0, memory_mb=100, disk_mb=10, priority="latency-sensitive")
    assert admits(cap, Allocation(cpu_ls=1.5), ls) == "cpu-ls"
    assert admits(Capacity(2.0, 1000, 0, cpu_overcommit=0, mem_overcommit=0), Allocation(disk_mb=10**9), s) == ""  # 0: none / no limit


@pytest.mark.parametrize("bad", ["sb-1\n", "sb-1\r", "sb.1", "sb 1", "sb-*", ""])
def test_an_id_that_would_break_a_subject_is_refused(bad: str) -> None:
    """A trailing newline passed ``^…$`` (``$`` matches before it) and would have ended a protocol
    line early on the host's connection; every id must be a whole subject token."""
    with pytest.raises(InvalidArgument, match="sandbox_id must be"):
        validate_spec(SandboxSpec(sandbox_id=bad, backend="sim"))
    validate_spec(SandboxSpec(sandbox_id="sb-1", backend="sim"))  # positive control


@pytest.mark.parametrize(
    ("inbox", "ok"),
    [("_INBOX.a.b", True), ("_INBOX.a", True), ("_INBOX.a.b\n", False), ("_INBOX", False), ("_INBOX.a.*", False), ("_INBOX..a", False),
     ("dsec.host.h1.create", False)],
)
def test_reply_inboxes_are_whole_inbox_subjects(inbox: str, ok: bool) -> None:
    from bus import subjects as S

    assert S.valid_inbox(inbox) is ok
