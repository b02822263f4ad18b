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


def test_the_hosts_dropped_packets_are_read_in_its_network_namespace() -> None:
    """NFLOG is per network namespace: the host's drops-only guard shares the host agent's, under its host id."""
    svc = _compose()["services"]
    gd, ha = svc["guard-drops"], svc["hostagent"]
    assert gd["network_mode"] == "service:hostagent" and "--drops-only" in gd["command"]
    assert gd["command"][gd["command"].index("--host-id") + 1] == ha["command"][ha["command"].index("--host-id") + 1]
    assert "NET_ADMIN" in gd["cap_add"]


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


def _merged(*files: str, env: dict[str, str] | None = None) -> dict:
    """What docker-compose itself makes of the files (skipped where it is not installed)."""
    import os
    import shutil
    import subprocess

    import pytest

    if not shutil.which("docker-compose"):
        pytest.skip("docker-compose not installed")
    argv = ["docker-compose", "-p", "dsec-unit", *(a for f in files for a in ("-f", str(ROOT / "compose" / f))), "config"]
    r = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=60)
    assert r.returncode == 0, r.stderr
    return yaml.safe_load(r.stdout)


def test_the_hosts_overlay_makes_three_hosts_apart() -> None:
    """compose/hosts.yml: three host agents, each with its lazy loader in its network namespace, its
    own host id, data dir and sandbox pool; on the cluster overlay they get the seed list and R3."""
    svc = _merged("docker-compose.yml", "hosts.yml")["services"]
    agents = [svc["hostagent"], svc["hostagent-2"], svc["hostagent-3"]]

    def opt(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    assert len({opt(a["command"], "--host-id") for a in agents}) == 3
    assert len({opt(a["command"], "--data-dir") for a in agents}) == 3
    assert len({a.get("environment", {}).get("DSEC_NET_POOL", "10.200.0.0/16") for a in agents}) == 3
    for i in (2, 3):
        lz, ha = svc[f"lazy-loader-{i}"], svc[f"hostagent-{i}"]
        assert lz["network_mode"] == f"service:hostagent-{i}"  # one host: one network namespace
        assert opt(lz["command"], "--host-id") == opt(ha["command"], "--host-id")
        assert opt(lz["command"], "--data-dir") == opt(ha["command"], "--data-dir")
        assert opt(lz["command"], "--mount") == opt(ha["command"], "--data-dir") + "/lazy"  # where the agent looks
        assert {"SYS_ADMIN", "NET_ADMIN"} <= set(ha["cap_add"]) and ha["depends_on"]["nats"]["condition"] == "service_healthy"
        gd = svc[f"guard-drops-{i}"]  # its dropped packets, read in its namespace
        assert gd["network_mode"] == f"service:hostagent-{i}" and "--drops-only" in gd["command"]
        assert opt(gd["command"], "--host-id") == opt(ha["command"], "--host-id") and "NET_ADMIN" in gd["cap_add"]
    seeds = "nats://nats:4222,nats://nats-2:4222,nats://nats-3:4222"
    svc = _merged("docker-compose.yml", "cluster.yml", "hosts.yml", env={"DSEC_HOSTS_NATS_URL": seeds, "DSEC_NATS_REPLICAS": "3"})["services"]
    for name in ("hostagent-2", "lazy-loader-2", "guard-drops-2", "hostagent-3", "lazy-loader-3", "guard-drops-3"):
        assert svc[name]["environment"]["DSEC_NATS_URL"] == seeds and svc[name]["environment"]["DSEC_NATS_REPLICAS"] == "3", name
    stack = (ROOT / "compose" / "stack.sh").read_text()
    assert "compose/hosts.yml" in stack and f'DSEC_HOSTS_NATS_URL="{seeds}"' in stack
