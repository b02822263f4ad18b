"""The compose dev stack as files (tests/integration/test_compose_stack.py runs it for real)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose" / "docker-compose.yml"
DOCKERFILE = ROOT / "compose" / "Dockerfile"


def _compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def test_every_service_of_the_design_is_in_the_stack() -> None:
    services = _compose()["services"]
    assert {"nats", "placement", "hostagent", "imaged", "guard"} <= set(services)


def test_commands_name_runnable_modules() -> None:
    for name, svc in _compose()["services"].items():
        cmd = svc["command"]
        assert isinstance(cmd, list) and cmd, name
        if cmd[:2] == ["python", "-m"]:
            spec = importlib.util.find_spec(cmd[2])
            assert spec is not None, f"{name}: no module {cmd[2]}"
            if spec.submodule_search_locations is not None:  # a package runs its __main__
                assert importlib.util.find_spec(f"{cmd[2]}.__main__") is not None, f"{name}: python -m {cmd[2]} has no __main__"


def test_services_reach_nats_by_service_name_and_wait_for_it() -> None:
    services = _compose()["services"]
    for name, svc in services.items():
        if name == "nats":
            assert "healthcheck" in svc
            continue
        assert svc["environment"]["DSEC_NATS_URL"] == "nats://nats:4222"
        assert svc["depends_on"]["nats"]["condition"] == "service_healthy"


def test_hostagent_gets_what_containers_need() -> None:
    ha = _compose()["services"]["hostagent"]
    # privileged would ask for CAP_SYS_RESOURCE, which these machines' bounding set lacks
    assert {"SYS_ADMIN", "NET_ADMIN", "MKNOD"} <= set(ha["cap_add"]) and "SYS_RESOURCE" not in ha["cap_add"]
    assert ha["device_cgroup_rules"] == ["a *:* rwm"] and "seccomp=unconfined" in ha["security_opt"]
    assert any(v.startswith("/sys/fs/cgroup") for v in ha["volumes"]) and "/dev:/dev" in ha["volumes"]
    assert "--destroy-on-shutdown" in ha["command"]


def test_dockerfile_copies_only_what_exists() -> None:
    text = DOCKERFILE.read_text()
    # FROM the base compose/base-image.sh makes (no registry is reachable)
    assert text.startswith("#") and "ARG BASE=dsec-base:bookworm" in text and "FROM ${BASE}" in text
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, re.M):
        for part in src.split():
            if part == "compose/.wheels":  # filled by compose/stack.sh before the build
                assert "compose/.wheels" in (ROOT / "compose" / "stack.sh").read_text()
                continue
            assert (ROOT / part).exists(), f"COPY {part}: missing"
    services = _compose()["services"]
    build = services["nats"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
    assert {svc["image"] for svc in services.values()} == {"dsec:dev"}  # one image, built once


def test_the_cluster_overlay_gives_every_service_the_seed_list_and_r3() -> None:
    """compose/cluster.yml over the stack: three nodes routed to each other, and every dsec service
    (all of them: one left on the single URL would set the streams up R1) with the seed list and R3."""
    overlay = yaml.safe_load((ROOT / "compose" / "cluster.yml").read_text())["services"]
    nodes = {"nats", "nats-2", "nats-3"}
    assert nodes <= set(overlay)
    for n in nodes:
        cmd = " ".join(overlay[n]["command"])
        assert all(f"nats-route://{m}:6222" in cmd for m in nodes) and "-js" in cmd
    dsec = set(_compose()["services"]) - {"nats"}
    assert dsec <= set(overlay), dsec - set(overlay)
    for name in dsec:
        env = overlay[name]["environment"]
        assert env["DSEC_NATS_URL"].split(",") == ["nats://nats:4222", "nats://nats-2:4222", "nats://nats-3:4222"], name
        assert env["DSEC_NATS_REPLICAS"] == "3"
