"""Service settings: frozen dataclasses built once from flags and environment (bus.config)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from bus.config import from_args, parser
from guard import GuardConfig
from imaged.__main__ import ImagedConfig
from placement import Placement, PlacementConfig
from sdk.gateway import GatewayConfig
from tests.integration.conftest import REPO


def test_a_setting_is_its_flag_else_its_environment_else_its_one_default() -> None:
    ap = parser("python -m placement", None, PlacementConfig)
    cfg = from_args(PlacementConfig, ap.parse_args([]), env={})
    assert cfg == PlacementConfig() and cfg.capacity == 512 and cfg.strategy == "spread" and cfg.metrics_port is None
    cfg = from_args(PlacementConfig, ap.parse_args(["--capacity", "7", "--strategy", "pack", "--ack-wait", "2.5"]), env={"DSEC_METRICS_PORT": "9100"})
    assert (cfg.capacity, cfg.strategy, cfg.ack_wait_s, cfg.metrics_port) == (7, "pack", 2.5, 9100)
    cfg = from_args(PlacementConfig, ap.parse_args(["--metrics-port", "9200"]), env={"DSEC_METRICS_PORT": "9100"})
    assert cfg.metrics_port == 9200  # the flag wins over the environment
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.capacity = 1  # type: ignore[misc]  # the point: a config does not change once built
    with pytest.raises(SystemExit):
        ap.parse_args(["--strategy", "random"])  # a Literal's values are the flag's choices


def test_booleans_negate_and_environment_values_are_checked() -> None:
    ap = parser("python -m guard", None, GuardConfig)
    assert from_args(GuardConfig, ap.parse_args([]), env={}).kernel_audit is True
    cfg = from_args(GuardConfig, ap.parse_args(["--no-kernel-audit", "--nflog-group", "-1"]), env={})
    assert cfg.kernel_audit is False and cfg.nflog() is None  # the flags compose/docker-compose.yml passes
    assert from_args(GuardConfig, ap.parse_args([]), env={"DSEC_NFLOG_GROUP": "42"}).nflog() == 42
    imaged = parser("python -m imaged serve", None, ImagedConfig)
    assert from_args(ImagedConfig, imaged.parse_args(["--no-base"]), env={}).base is False
    assert from_args(ImagedConfig, imaged.parse_args([]), env={}).base is True
    with pytest.raises(ValueError, match=r"\$DSEC_NFLOG_GROUP: 'x' is not a valid int"):
        from_args(GuardConfig, ap.parse_args([]), env={"DSEC_NFLOG_GROUP": "x"})


def test_a_service_takes_its_config_or_single_settings() -> None:
    pl = Placement("nats://127.0.0.1:1", pending_delay_s=0.1, config=PlacementConfig(capacity=3, strategy="pack"))
    assert (pl.capacity, pl.pending_delay_s, pl.table.policy.strategy, pl.nats_url) == (3, 0.1, "pack", "nats://127.0.0.1:1")
    with pytest.raises(TypeError, match="no_such_setting"):
        Placement(no_such_setting=1)
    gw = GatewayConfig(http_port=8080)
    assert gw.sandbox_domain == "localhost:8080" and gw.max_upload == 1024 * 1024 * 1024


@pytest.mark.parametrize(("argv", "shows"), [
    (["placement"], ["--capacity", "(default: 512)", "--strategy {spread,pack}", "--ack-wait", "$DSEC_METRICS_PORT"]),
    (["guard"], ["--no-kernel-audit", "--nflog-group", "(default: 7301; $DSEC_NFLOG_GROUP when set)", "--report-interval"]),
    (["sdk.gateway"], ["--http-port", "(default: 3000)", "--max-upload-mb", "localhost:<http-port>"]),
    (["imaged", "serve"], ["--no-base", "--data-dir", "$DSEC_DATA_DIR"]),
    (["hostagent"], ["--snapshot-max-bytes-per-sandbox", "(default: $DSEC_SNAPSHOT_MAX_BYTES_PER_SANDBOX or 17179869184)", "--write-reserve-mb"]),
])
def test_help_shows_every_setting_with_its_default(argv: list[str], shows: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for s in shows:
        assert s in text, (s, text)
    assert text.count("(default: ") >= len(shows) - 1


def test_host_agent_storage_limits_are_a_flag_else_the_environment_else_the_default() -> None:
    import argparse

    from hostagent import HostAgentConfig
    from hostagent._config import add_flags, from_args as host_from_args
    from hostagent._storage import Limits

    ap = argparse.ArgumentParser()
    add_flags(ap, ["container"])
    ap.add_argument("--metrics-port", type=int, default=None)
    d = HostAgentConfig(host_id="h")
    cfg = host_from_args(ap.parse_args([]), env={})
    assert (cfg.snapshot_max_bytes_per_sandbox, cfg.snapshot_max_bytes_per_tenant, cfg.write_reserve_mb) == (16 << 30, 256 << 30, 64)
    assert Limits.of(cfg) == Limits() == Limits.of(d)
    env = {"DSEC_SNAPSHOT_MAX_BYTES_PER_SANDBOX": "1000", "DSEC_WRITE_RESERVE_MB": "8", "DSEC_SNAPSHOT_MAX_BYTES_PER_TENANT": "lots",
           "DSEC_DISK_GROWTH_WINDOW_S": "-5"}
    cfg = host_from_args(ap.parse_args([]), env=env)
    # the environment; a value that does not parse keeps the default; a negative one is 0 (no limit)
    assert (cfg.snapshot_max_bytes_per_sandbox, cfg.snapshot_max_bytes_per_tenant, cfg.write_reserve_mb, cfg.disk_growth_window_s) == (1000, 256 << 30, 8, 0.0)
    cfg = host_from_args(ap.parse_args(["--snapshot-max-bytes-per-sandbox", "0", "--write-reserve-mb", "16"]), env=env)
    assert (cfg.snapshot_max_bytes_per_sandbox, cfg.write_reserve_mb) == (0, 16)  # the flag wins
    assert Limits.of(cfg).named() == {"snapshot_bytes_per_sandbox": 0, "snapshot_bytes_per_tenant": 256 << 30}
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.write_reserve_mb = 1  # type: ignore[misc]
