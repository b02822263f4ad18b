"""bus.quota: which limits count against a tenant, and the refusal naming the limit a create passes."""

from __future__ import annotations

from bus import subjects as S
from bus.errors import QuotaExceeded
from bus.messages import QuotaHold, TenantLimits
from bus.quota import limits_of, over_quota
from sdk import build_spec


def test_own_record_then_defaults_never_for_the_operator_and_services() -> None:
    capped, default = TenantLimits(max_sandboxes=3), TenantLimits(max_cpu=4.0)
    recs = {"cli-a": capped, "cli-free": TenantLimits(), S.TENANT_DEFAULTS: default}
    assert limits_of("cli-a", recs) == capped
    assert limits_of("cli-b", recs) == default  # no record of its own
    assert limits_of("cli-free", recs) is None  # an all-zero record: explicitly unlimited, whatever the defaults
    for svc in ("admin", "placement", "rollouts"):
        assert limits_of(svc, recs) is None
    assert limits_of("admin", {**recs, "admin": capped}) == capped  # a record of its own does apply
    assert limits_of("cli-b", {"cli-a": capped}) is None


def test_the_refusal_names_the_limit_and_a_held_id_is_not_counted_again() -> None:
    holds = {f"s{i}": QuotaHold(cpu=0.5, memory_mb=100, at=0.0) for i in range(3)}
    spec = build_spec("base", sandbox_id="s-new", cpu=0.5, memory_mb=100)
    err = over_quota("cli-a", TenantLimits(max_sandboxes=3), holds, spec)
    assert isinstance(err, QuotaExceeded) and err.code == "quota_exceeded"
    assert err.description == "tenant cli-a holds 3 of max 3 sandboxes" and err.context["limit"] == "max_sandboxes"
    assert over_quota("cli-a", TenantLimits(max_sandboxes=3), holds, build_spec("base", sandbox_id="s1")) is None  # a redelivery
    assert over_quota("cli-a", TenantLimits(max_sandboxes=4, max_cpu=2.0), holds, spec) is None  # exactly up to the limit
    err = over_quota("cli-a", TenantLimits(max_cpu=1.9), holds, spec)
    assert err is not None and err.description == "tenant cli-a holds 1.5 of max 1.9 cpu; s-new asks for 0.5 more"
    err = over_quota("cli-a", TenantLimits(max_memory_mb=399), holds, spec)
    assert err is not None and err.description == "tenant cli-a holds 300 of max 399 MB memory; s-new asks for 100 more"
