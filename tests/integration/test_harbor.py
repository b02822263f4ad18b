"""Harbor, unmodified (the ``harbor`` package from PyPI, its E2B environment and the ``e2b`` SDK it
pulls in), runs a task of ours end to end against ``dsec up``: the task's Dockerfile (FROM an image in
a local registry) becomes an E2B template through the gateway's template API (tags, alias lookup,
build, status), the sandbox is created with the task's egress allowlist (``allow_internet_access``,
``network={allow_out, deny_out: all}``) and switched to the verifier's and back (``update_network``),
Harbor's oracle agent uploads and runs the solution, the verifier uploads and runs the tests, and the
reward is 1.0. Nothing is left running.

Harbor needs Python >= 3.12 and the shared venv is 3.11, so it lives in a venv of its own
(``HARBOR_VENV``: ``compose/dev.sh install`` makes .venv-harbor; default /work/venv-harbor, created
here when missing: PyPI must be reachable).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests import registry as R
from tests.conftest import cannot_run, needs

from . import test_gateway as _gateway
from .conftest import needs_stack
from .test_gateway import Gw, http

pytestmark = [pytest.mark.containerd, needs_stack, needs(R.missing())]
_gw = _gateway.gw


@pytest.fixture(scope="module")
def e2b_profile() -> Any:
    """The gateway under test gives E2B creates the ``e2b`` profile (every path writable): Harbor writes
    /etc/profile.d, /app, /logs, /tests and /solution as root, as in an E2B sandbox."""
    old = os.environ.get("DSEC_GATEWAY_E2B_PROFILE")
    os.environ["DSEC_GATEWAY_E2B_PROFILE"] = "e2b"  # `dsec up` (and its gateway) inherit it
    yield
    if old is None:
        os.environ.pop("DSEC_GATEWAY_E2B_PROFILE", None)
    else:
        os.environ["DSEC_GATEWAY_E2B_PROFILE"] = old


@pytest.fixture(scope="module")
def gw(e2b_profile: Any, _gw: Gw) -> Gw:
    return _gw

HARBOR_VERSION = "0.26.0"
VENV = Path(os.environ.get("HARBOR_VENV", "/work/venv-harbor"))
PYTHONS = tuple(p for p in (os.environ.get("DSEC_HARBOR_PYTHON"), "/root/.pyenv/versions/3.12.1/bin/python3.12", "python3.13", "python3.12") if p)
TASK = Path(__file__).resolve().parent.parent / "data" / "harbor-task"

# what Harbor's E2B environment runs in the image (its build steps, transfers and login-PATH drop-in):
# busybox has every tool but ``install``, which only ever makes a directory there
INSTALL_SHIM = b"""#!/bin/sh
# install -d [-m MODE] DIR...: the only form Harbor's E2B environment runs
mode=
while [ $# -gt 0 ]; do
  case $1 in -d) shift ;; -m) mode=$2; shift 2 ;; *) break ;; esac
done
mkdir -p "$@" && { [ -z "$mode" ] || chmod "$mode" "$@"; }
"""


def harbor_bin() -> Path:
    """The venv's ``harbor`` (installing ``harbor[e2b]`` into a new venv when missing); else the test
    cannot run, and fails saying why."""
    exe = VENV / "bin" / "harbor"
    if exe.exists():
        return exe
    python = next((p for p in (shutil.which(c) for c in PYTHONS) if p), None)
    if python is None:
        cannot_run(f"harbor needs Python >= 3.12 (none of {PYTHONS} found)")
    r = subprocess.run([python, "-m", "venv", str(VENV)], capture_output=True, text=True)
    if r.returncode == 0:
        r = subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", f"harbor[e2b]=={HARBOR_VERSION}"], capture_output=True, text=True, timeout=1200)
    if r.returncode != 0 or not exe.exists():
        cannot_run(f"could not install harbor[e2b]=={HARBOR_VERSION} into {VENV}: {(r.stderr or r.stdout)[-2000:]}")
    return exe


def busybox_image(layout: Path) -> Path:
    """An OCI layout of busybox with all its applets, root's account and the ``install`` shim."""
    applets = subprocess.run([R.BUSYBOX, "--list"], capture_output=True, text=True, check=True).stdout.split()
    files: dict[str, Any] = {"bin": ("dir",), "bin/busybox": ("x", Path(R.BUSYBOX).read_bytes())}
    files.update({f"bin/{a}": ("sym", "busybox") for a in applets if a not in ("busybox", "install")})
    files.update({
        "usr": ("dir",), "usr/bin": ("dir",), "usr/bin/install": ("x", INSTALL_SHIM), "etc": ("dir",),
        "etc/passwd": b"root:x:0:0:root:/root:/bin/sh\n", "etc/group": b"root:x:0:\n", "tmp": ("dir",), "root": ("dir",),
    })
    return R.oci_layout(layout, [R.tar_layer(files)], {"Env": ["PATH=/usr/local/bin:/usr/bin:/bin"]})


@pytest.fixture(scope="module")
def registry():
    reg = R.LocalRegistry().start()
    yield reg
    reg.close()


def _task(dst: Path, registry_host: str) -> Path:
    shutil.copytree(TASK, dst)
    df = dst / "environment" / "Dockerfile"
    df.write_text(df.read_text().replace("{registry}", registry_host))
    return dst


def _network_ops(gw: Gw) -> int:
    """How many ``network`` ops (E2B's update_network) the host agent answered ok (its metrics, through
    the gateway's /metrics)."""
    with urllib.request.urlopen(f"{gw.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    m = re.search(r'^dsec_sandbox_ops_total\{[^}]*op="network",code="ok"\} (\d+)', text, re.M)
    return int(m.group(1)) if m else 0


def _live(gw: Gw) -> list[str]:
    status, body, _ = http(gw, "GET", "/v2/sandboxes?state=running,paused")
    assert status == 200, body
    return [s["sandboxID"] for s in body]


async def test_harbor_oracle_runs_a_dockerfile_task_through_e2b(gw: Gw, registry: Any, tmp_path: Path) -> None:
    harbor = await asyncio.to_thread(harbor_bin)
    registry.push(busybox_image(tmp_path / "img"), "harbor/busybox", "v1")
    task = _task(tmp_path / "task", registry.host)
    before, network_ops = _live(gw), await asyncio.to_thread(_network_ops, gw)
    env = {
        "PATH": os.environ["PATH"], "HOME": str(tmp_path), "E2B_API_KEY": gw.key_a, "E2B_API_URL": gw.url, "E2B_SANDBOX_URL": gw.url,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # litellm (imported by harbor) would fetch its price list from GitHub
    }
    job = f"dsec-{uuid.uuid4().hex[:8]}"
    argv = [str(harbor), "run", "-p", str(task), "-a", "oracle", "-e", "e2b", "-o", str(tmp_path / "jobs"), "--job-name", job, "-n", "1", "-y"]
    proc = await asyncio.create_subprocess_exec(*argv, cwd=tmp_path, env=env, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=600)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-5000:]
    results = list((tmp_path / "jobs" / job).glob("*/result.json"))
    assert len(results) == 1, (text[-3000:], list((tmp_path / "jobs").rglob("*")))
    trial = json.loads(results[0].read_text())
    assert trial.get("exception_info") is None, trial["exception_info"]
    assert trial["verifier_result"]["rewards"] == {"reward": 1.0}, trial
    # the solution ran in the template the Dockerfile built (its COPY and RUN) from the registry's image
    oracle_log = next((tmp_path / "jobs" / job).glob("*/agent/oracle.txt")).read_text()
    assert oracle_log == "seed\nbuilt from the Dockerfile\n", oracle_log
    # the template Harbor built is this key's, tagged with the build Harbor used
    status, tpls, _ = http(gw, "GET", "/templates")
    harbor_tpls = [t for t in tpls if t["templateID"].startswith("harbor-")]
    assert status == 200 and len(harbor_tpls) == 1, tpls
    status, tags, _ = http(gw, "GET", f"/templates/{harbor_tpls[0]['templateID']}/tags")
    assert status == 200 and [t["tag"] for t in tags] == ["default-r5"], tags
    # the verifier phase's allowlist differs from the agent's: Harbor switched the running sandbox to
    # it and back (update_network), and the host agent swapped the allowlist both times
    assert await asyncio.to_thread(_network_ops, gw) - network_ops == 2
    # Harbor killed its sandbox: nothing of this run is left running
    assert _live(gw) == before


async def test_e2b_network_bad_input(gw: Gw) -> None:
    """What dsec cannot do is refused with its typed error, and the sandbox keeps its policy."""
    hdr = {"Content-Type": "application/json"}
    status, body, _ = http(gw, "POST", "/sandboxes", json.dumps({"templateID": "base", "network": {"denyOut": ["10.0.0.0/8"]}}).encode(), hdr)
    assert status == 400 and "only denyOut" in body["message"], body  # deny some, allow the rest: not an allowlist
    status, body, _ = http(gw, "POST", "/sandboxes", json.dumps({"templateID": "base", "timeout": 120}).encode(), hdr)
    assert status == 201, body
    sid = body["sandboxID"]
    try:
        allow = json.dumps({"allowOut": ["192.0.2.1"], "denyOut": ["0.0.0.0/0"]}).encode()
        status, body, _ = http(gw, "PUT", f"/sandboxes/{sid}/network", allow, hdr)
        assert status == 501 and "created without a network" in body["message"], body
        status, body, _ = http(gw, "PUT", f"/sandboxes/{sid}/network", json.dumps({"allowOut": ["*.example.com"], "denyOut": ["0.0.0.0/0"]}).encode(), hdr)
        assert status == 400 and "wildcard" in body["message"], body
        # positive control: no egress, which it has, is accepted
        status, body, _ = http(gw, "PUT", f"/sandboxes/{sid}/network", json.dumps({"allow_internet_access": False}).encode(), hdr)
        assert status == 204, body
        assert http(gw, "PUT", "/sandboxes/sb-nosuch/network", allow, hdr)[0] == 404
    finally:
        assert http(gw, "DELETE", f"/sandboxes/{sid}")[0] == 204
