"""bus.metrics: the registry renders Prometheus text exposition 0.0.4, and texts of many processes merge."""

from __future__ import annotations

import pytest

from bus.metrics import Registry, merge, parse


def test_counter_gauge_histogram_render_as_the_text_format() -> None:
    reg = Registry({"service": "placement", "instance": "p1"})
    c = reg.counter("dsec_things_total", "Things\nseen", ["kind"])
    c.inc(kind="a")
    c.inc(2, kind='we"ird\\')
    g = reg.gauge("dsec_level", "A level")
    g.set(1.5)
    h = reg.histogram("dsec_op_seconds", "Op time", ["op"], buckets=(0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v, op="exec")
    text = reg.render()
    lines = text.splitlines()
    assert lines[0] == "# HELP dsec_things_total Things\\nseen"
    assert lines[1] == "# TYPE dsec_things_total counter"
    assert 'dsec_things_total{service="placement",instance="p1",kind="a"} 1' in lines
    assert 'dsec_things_total{service="placement",instance="p1",kind="we\\"ird\\\\"} 2' in lines
    assert "# TYPE dsec_level gauge" in lines and 'dsec_level{service="placement",instance="p1"} 1.5' in lines
    # buckets are cumulative, le is inclusive, +Inf equals the count
    base = 'service="placement",instance="p1",op="exec"'
    assert f'dsec_op_seconds_bucket{{{base},le="0.1"}} 2' in lines
    assert f'dsec_op_seconds_bucket{{{base},le="1"}} 3' in lines
    assert f'dsec_op_seconds_bucket{{{base},le="+Inf"}} 4' in lines
    assert f"dsec_op_seconds_sum{{{base}}} 3.65" in lines
    assert f"dsec_op_seconds_count{{{base}}} 4" in lines
    assert text.endswith("\n")
    parsed = {(n, tuple(sorted(lab.items()))): v for n, lab, v in parse(text)}
    assert parsed[("dsec_things_total", (("instance", "p1"), ("kind", 'we"ird\\'), ("service", "placement")))] == 2


def test_bad_use_is_refused() -> None:
    reg = Registry()
    with pytest.raises(ValueError, match="_total"):
        reg.counter("dsec_things", "no suffix")
    c = reg.counter("dsec_x_total", "x", ["a"])
    with pytest.raises(ValueError, match="labels"):
        c.inc(b="1")
    with pytest.raises(ValueError, match="labels"):
        c.inc()
    with pytest.raises(ValueError, match="only goes up"):
        c.inc(-1, a="1")
    with pytest.raises(ValueError, match="registered differently"):
        reg.gauge("dsec_x_total", "x", ["a"])
    assert reg.counter("dsec_x_total", "x", ["a"]) is c  # the same metric asked for twice is shared
    with pytest.raises(ValueError, match="bad metric name"):
        reg.gauge("1bad", "x")
    with pytest.raises(ValueError, match="'le'"):
        reg.histogram("dsec_h", "x", ["le"])


async def test_collectors_run_on_scrape_and_a_failing_one_does_not_blank_it() -> None:
    reg = Registry()
    g = reg.gauge("dsec_live", "live things", ["state"])
    state = {"running": 3}

    def fill() -> None:
        g.clear()
        for k, v in state.items():
            g.set(v, state=k)

    async def broken() -> None:
        raise RuntimeError("probe down")

    reg.collector(fill)
    reg.collector(broken)
    assert 'dsec_live{state="running"} 3' in await reg.scrape()
    state.clear()
    state["paused"] = 1
    text = await reg.scrape()
    assert 'dsec_live{state="paused"} 1' in text and "running" not in text


def test_merge_groups_each_family_once() -> None:
    a = Registry({"instance": "a"})
    b = Registry({"instance": "b"})
    for reg, n in ((a, 1), (b, 2)):
        reg.counter("dsec_c_total", "c").inc(n)
        reg.histogram("dsec_h_seconds", "h", buckets=(1.0,)).observe(0.5)
    b.gauge("dsec_only_b", "b only").set(7)
    text = merge([a.render(), b.render()])
    lines = text.splitlines()
    assert lines.count("# TYPE dsec_c_total counter") == 1 and lines.count("# HELP dsec_h_seconds h") == 1
    # every family's samples directly follow its own TYPE line
    current = None
    for line in lines:
        if line.startswith("# TYPE "):
            current = line.split()[2]
        elif not line.startswith("#"):
            assert line.startswith(current), (current, line)
    vals = {(n, lab.get("instance"), lab.get("le")): v for n, lab, v in parse(text)}
    assert vals[("dsec_c_total", "a", None)] == 1 and vals[("dsec_c_total", "b", None)] == 2
    assert vals[("dsec_h_seconds_bucket", "b", "+Inf")] == 1 and vals[("dsec_only_b", "b", None)] == 7


async def test_the_operator_view_is_served_to_this_machine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from unittest import mock

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from sdk.gateway._buslink import ENV_PUBLIC, operator_only

    async def page(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    guarded = operator_only(page)

    def from_addr(ip: str) -> web.Request:
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None: (ip, 40000) if name == "peername" else default
        return make_mocked_request("GET", "/dashboard", transport=transport)

    monkeypatch.delenv(ENV_PUBLIC, raising=False)
    assert (await guarded(from_addr("127.0.0.1"))).text == "ok"  # positive control
    assert (await guarded(from_addr("::1"))).text == "ok"
    with pytest.raises(web.HTTPForbidden):
        await guarded(from_addr("192.0.2.7"))
    monkeypatch.setenv(ENV_PUBLIC, "1")
    assert (await guarded(from_addr("192.0.2.7"))).text == "ok"
