"""Shared rules: what a valid sandbox spec is, and whether a sandbox fits a host. Defined once here;
the SDK (client-side, before anything is sent), placement (for every request, from any client) and
the host agent (admission) all call these.

Bounds are msgspec constraints on ``SpecBounds``, checked against a decoded ``SandboxSpec``
(``msgspec.convert(..., from_attributes=True)``), not on ``SandboxSpec`` itself: a spec that
decodes but is out of bounds must reach placement, which answers its creator with a typed
``failed`` event (``invalid_argument``); a decode error could only be dead-lettered.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

import msgspec

from . import subjects as S
from .errors import InvalidArgument, PermissionDenied
from .messages import BACKENDS, PRIORITIES, BackendName, HostStatus, Priority, SandboxSpec

# name -> (low, high), both inclusive. cpu 0.01: the smallest share a cgroup CPU quota expresses well
# (the 50x-overcommit regime runs at 0.02); timeout 1 s: a sandbox must live long enough to be used.
LIMITS: dict[str, tuple[float, float]] = {
    "cpu": (0.01, 256.0),
    "memory_mb": (16, 1024 * 1024),
    "disk_mb": (1, 16 * 1024 * 1024),
    "timeout_s": (1.0, 30 * 86400.0),
    "lease_s": (0.0, 86400.0),  # 0: no client lease
}
CREATE_TIMEOUT_S = (0.1, 86400.0)  # the client's wait for ready (its create_deadline)
LEASE_MIN_S = 1.0  # a lease, when there is one


def _b(name: str) -> msgspec.Meta:
    lo, hi = LIMITS[name]
    return msgspec.Meta(ge=lo, le=hi)


class SpecBounds(msgspec.Struct):
    """The bounds of a ``SandboxSpec``'s numbers and names, as msgspec constraints."""

    cpu: Annotated[float, _b("cpu")]
    memory_mb: Annotated[int, _b("memory_mb")]
    disk_mb: Annotated[int, _b("disk_mb")]
    timeout_s: Annotated[float, _b("timeout_s")]
    lease_s: Annotated[float, _b("lease_s")]
    backend: BackendName
    priority: Priority
    template: Annotated[str, msgspec.Meta(min_length=1)]
    envs: dict[str, str]
    metadata: dict[str, str]


_AT = re.compile(r"at `\$\.(\w+)")


def _num(x: float) -> str:
    return str(int(x)) if x == int(x) else str(x)


def _message(field: str, value: Any, why: str) -> str:
    if field in LIMITS:
        lo, hi = LIMITS[field]
        kind = "an integer" if field.endswith("_mb") else "a number"
        return f"{field} must be {kind} between {_num(lo)} and {_num(hi)}, got {value!r}"
    if field == "backend":
        return f"backend must be one of {', '.join(BACKENDS)}; got {value!r}"
    if field == "priority":
        return f"priority must be one of {', '.join(PRIORITIES)}; got {value!r}"
    if field == "template":
        return f"template must be a non-empty string, got {value!r}"
    if field in ("envs", "metadata"):
        return f"{field} must be a dict of str to str, got {value!r}"
    return f"{field}: {why}"


def validate_spec(spec: SandboxSpec) -> None:
    """Raise ``InvalidArgument`` (naming the field) unless ``spec`` is within every bound."""
    if not isinstance(spec.sandbox_id, str) or not S.valid_token(spec.sandbox_id):
        raise InvalidArgument(f"sandbox_id must be 1-128 of [A-Za-z0-9_-], got {spec.sandbox_id!r}")
    try:
        msgspec.convert(spec, SpecBounds, from_attributes=True)
    except msgspec.ValidationError as exc:
        m = _AT.search(str(exc))
        field = m.group(1) if m else "spec"
        raise InvalidArgument(_message(field, getattr(spec, field, None), str(exc))) from None
    if 0 < spec.lease_s < LEASE_MIN_S:
        raise InvalidArgument(f"lease_s must be 0 (none) or between {_num(LEASE_MIN_S)} and {_num(LIMITS['lease_s'][1])}, got {spec.lease_s!r}")
    if spec.reply_to and not S.valid_inbox(spec.reply_to):
        raise InvalidArgument(f"reply_to must be an _INBOX subject, got {spec.reply_to!r}")
    if spec.backend == "fncall":  # its pools serve calls, not sandboxes (hosts advertise them for FnCall's routing)
        raise InvalidArgument("backend 'fncall' serves stateless calls (FnCall.run, POST /run_code), not sandboxes; "
                              "create sandboxes on container, microvm or vm")


# --- admission ------------------------------------------------------------------------------
class Capacity:
    """What a host may hold: limits after overcommit. An overcommit ratio <= 0 means none (1.0); a
    ratio below 1 is honoured (a host keeping headroom); ``disk_mb`` / ``max_sandboxes`` 0: no limit."""

    __slots__ = ("cpu", "cpu_ls", "mem_mb", "disk_mb", "max_sandboxes")

    def __init__(
        self, cpu_total: float, mem_total_mb: float, disk_total_mb: float, *, cpu_overcommit: float, mem_overcommit: float, max_sandboxes: int = 0
    ) -> None:
        self.cpu = cpu_total * (cpu_overcommit if cpu_overcommit > 0 else 1.0)
        self.cpu_ls = cpu_total  # latency-sensitive work is never overcommitted
        self.mem_mb = mem_total_mb * (mem_overcommit if mem_overcommit > 0 else 1.0)
        self.disk_mb = disk_total_mb
        self.max_sandboxes = max_sandboxes


def capacity_of(st: HostStatus, *, cpu_overcommit: float | None = None) -> Capacity:
    """A heartbeat's capacity; ``cpu_overcommit`` replaces the host's own ratio (a stricter pool policy)."""
    return Capacity(
        st.cpu_total, st.mem_total_mb, st.disk_total_mb,
        cpu_overcommit=st.cpu_overcommit if cpu_overcommit is None else cpu_overcommit,
        mem_overcommit=st.mem_overcommit, max_sandboxes=st.max_sandboxes,
    )


class Allocation:
    """What a host's sandboxes requested (running sums)."""

    __slots__ = ("cpu", "cpu_ls", "mem_mb", "disk_mb", "sandboxes")

    def __init__(self, cpu: float = 0.0, cpu_ls: float = 0.0, mem_mb: int = 0, disk_mb: int = 0, sandboxes: int = 0) -> None:
        self.cpu = cpu
        self.cpu_ls = cpu_ls
        self.mem_mb = mem_mb
        self.disk_mb = disk_mb
        self.sandboxes = sandboxes

    def add(self, spec: SandboxSpec, sign: int = 1) -> None:
        """Count ``spec`` in (``sign`` 1) or out (-1)."""
        self.cpu += sign * spec.cpu
        self.mem_mb += sign * spec.memory_mb
        self.disk_mb += sign * spec.disk_mb
        self.sandboxes += sign
        if spec.priority == "latency-sensitive":
            self.cpu_ls += sign * spec.cpu

    def plus(self, other: "Allocation") -> "Allocation":
        return Allocation(
            self.cpu + other.cpu, self.cpu_ls + other.cpu_ls, self.mem_mb + other.mem_mb, self.disk_mb + other.disk_mb, self.sandboxes + other.sandboxes,
        )


def admits(cap: Capacity, alloc: Allocation, spec: SandboxSpec) -> str:
    """Empty when ``spec`` fits next to ``alloc`` within ``cap``, else the reason's code
    (max_sandboxes, cpu, memory, disk, cpu-ls)."""
    if cap.max_sandboxes and alloc.sandboxes + 1 > cap.max_sandboxes:
        return "max_sandboxes"
    if alloc.cpu + spec.cpu > cap.cpu:
        return "cpu"
    if alloc.mem_mb + spec.memory_mb > cap.mem_mb:
        return "memory"
    if cap.disk_mb and alloc.disk_mb + spec.disk_mb > cap.disk_mb:
        return "disk"
    if spec.priority == "latency-sensitive" and alloc.cpu_ls + spec.cpu > cap.cpu_ls:
        return "cpu-ls"
    return ""


def refusal(cap: Capacity, alloc: Allocation, spec: SandboxSpec) -> str:
    """``admits`` in words for people (empty when it fits)."""
    code = admits(cap, alloc, spec)
    if code == "max_sandboxes":
        return f"host holds its maximum of {cap.max_sandboxes} sandboxes"
    if code == "cpu":
        return f"cpu: {alloc.cpu + spec.cpu:.2f} > {cap.cpu:g} (after overcommit)"
    if code == "memory":
        return f"memory: {alloc.mem_mb + spec.memory_mb} MB > {cap.mem_mb:g} MB (after overcommit)"
    if code == "disk":
        return f"disk: {alloc.disk_mb + spec.disk_mb} MB > {cap.disk_mb:g} MB"
    if code == "cpu-ls":
        return f"latency-sensitive cpu: {alloc.cpu_ls + spec.cpu:.2f} > {cap.cpu_ls:g} real cores"
    return code



def template_refusal(template: str, owner: str, client: str) -> PermissionDenied | None:
    """Why tenant ``client`` (a spec's ``client``) may not start a sandbox from template ``template``
    of ``owner`` (its manifest's), or None. Shared templates (no owner: the operator's, the pull
    cache) are everyone's; a tenant's own are its own and the operator's. Placement refuses before
    placing; host agents check again (defence in depth)."""
    tenant = S.tenant(client) if client else S.OPERATOR_TENANT
    if not owner or owner == tenant or tenant == S.OPERATOR_TENANT:
        return None
    return PermissionDenied(f"template {template!r} is private to another tenant", template=template, tenant=tenant)


__all__ = [
    "Allocation", "BACKENDS", "CREATE_TIMEOUT_S", "Capacity", "LIMITS", "PRIORITIES", "SpecBounds",
    "admits", "capacity_of", "refusal", "template_refusal", "validate_spec",
]
