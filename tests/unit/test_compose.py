"""The compose dev stack is validated as files (no Docker engine runs on CI machines)."""

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
    assert ha["privileged"] is True
    assert any(v.startswith("/sys/fs/cgroup") for v in ha["volumes"])


def test_dockerfile_copies_only_what_exists() -> None:
    text = DOCKERFILE.read_text()
    assert text.startswith("#") and "FROM debian:bookworm" in text
    for src in re.findall(r"^COPY\s+(.+?)\s+\S+$", text, re.M):
        for part in src.split():
            assert (ROOT / part).exists(), f"COPY {part}: missing"
    build = _compose()["services"]["placement"]["build"]
    assert (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve() == DOCKERFILE
