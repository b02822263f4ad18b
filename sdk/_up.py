"""``dsec up``: the whole dev stack on this machine, in the foreground, until Ctrl-C.

It starts the same processes production runs (``python -m placement`` and friends) and imports none of them.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from bus.auth import AuthConfig
from bus.errors import DsecError
from bus.natsd import NatsServer, NatsServerError
from bus.sign import ENV_CONTROL_KEY


class Child:
    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_dir: Path) -> None:
        self.name = name
        self.argv = argv
        self.env = env
        self.log_path = log_dir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log_path, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace: float) -> None:
        if not self.alive():
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _say(msg: str) -> None:
    print(f"dsec up: {msg}", flush=True)


async def _wait_ready(url: str, deadline: float, children: list[Child]) -> dict:
    from ._admin import cluster_status

    last: dict = {}
    while time.monotonic() < deadline:
        for c in children:
            if not c.alive():
                raise DsecError(f"{c.name} exited with {c.proc.returncode if c.proc else '?'}; see {c.log_path}")
        try:
            last = await cluster_status(url, timeout=2)
            if last["ready_hosts"] > 0 and "base" in last["templates"]:
                return last
        except DsecError:
            pass
        await asyncio.sleep(0.25)  # readiness poll interval
    raise DsecError(f"stack not ready in time (last status: {last}); logs in {children[0].log_path.parent}")


def run_up(args: argparse.Namespace) -> int:
    if args.backend == "container" and os.geteuid() != 0:
        print("dsec up: the container backend needs root (mounts, cgroups, namespaces); run as root", file=sys.stderr)
        return 2
    data = Path(args.data_dir).resolve()
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    auth = None if args.no_auth else AuthConfig.load_or_create(data / "auth.json")
    nats = NatsServer(data / "nats", port=args.port, log_file=str(logs / "nats-server.log"), extra_config=auth.config_block() if auth else "")
    try:
        nats.start()
    except NatsServerError as exc:
        print(f"dsec up: {exc}", file=sys.stderr)
        return 1
    _say(f"NATS JetStream at {nats.url} (pid {nats.pid})")
    base_env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    base_env.pop(ENV_CONTROL_KEY, None)

    def env(role: str) -> dict[str, str]:
        # Each service connects as its own NATS user, with only the subjects it needs.
        e = {**base_env, "DSEC_NATS_URL": auth.url_for(role, nats.url) if auth else nats.url}
        if auth and role in ("placement", "hostagent"):
            # Placement signs the work it hands hosts; host agents run nothing else (bus.sign).
            e[ENV_CONTROL_KEY] = auth.control_key
        return e

    py = sys.executable
    host_id = args.host_id or socket.gethostname().split(".")[0]
    children = [Child("imaged", [py, "-m", "imaged", "serve", "--data-dir", str(data)], env("imaged"), logs)]
    children.append(
        Child("lazy-loader", [py, "-m", "imaged.lazy", "--data-dir", str(data), "--mount", str(data / "lazy"), "--host-id", host_id], env("imaged"), logs)
    )
    children += [Child(f"placement-{i}", [py, "-m", "placement"], env("placement"), logs) for i in range(args.placement_replicas)]
    children.append(Child("guard", [py, "-m", "guard"], env("guard"), logs))
    children.append(
        Child(
            "hostagent",
            [py, "-m", "hostagent", "--data-dir", str(data), "--host-id", host_id, "--backend", args.backend,
             "--concurrency", str(args.concurrency), "--destroy-on-shutdown"],
            env("hostagent"),
            logs,
        )
    )
    # The HTTP gateway holds no credentials of its own: each API key is its own NATS user.
    children.append(Child("gateway", [py, "-m", "sdk.gateway", "--http-port", str(args.http_port)], {**base_env, "DSEC_NATS_URL": nats.url}, logs))
    auth_file = data / "auth.json"
    auth_mtime = auth_file.stat().st_mtime_ns if auth else 0
    stop = {"flag": False}

    def on_signal(signum: int, _frame: object) -> None:
        stop["flag"] = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    rc = 0
    try:
        for c in children:
            c.start()
            _say(f"started {c.name} (pid {c.proc.pid if c.proc else '?'}), log {c.log_path}")
        st = asyncio.run(_wait_ready(nats.url, time.monotonic() + args.ready_timeout, children))
        _say(f"ready: {st['ready_hosts']} host(s), templates {', '.join(st['templates'])}. export DSEC_NATS_URL={nats.url}")
        gw = f"http://127.0.0.1:{args.http_port}"
        _say(f"gateway (E2B API, envd, REST /v1, /openapi.json) at {gw}; an API key: dsec api-key create --data-dir {data}")
        _say(f"export E2B_API_URL={gw} E2B_SANDBOX_URL={gw}")
        _say("Ctrl-C stops everything")
        while not stop["flag"]:
            if auth is not None and auth_file.stat().st_mtime_ns != auth_mtime:
                # `dsec api-key create` added a NATS user: have the server load it.
                auth_mtime = auth_file.stat().st_mtime_ns
                auth = AuthConfig.load_or_create(auth_file)
                nats.reload(auth.config_block())
                _say("reloaded NATS users (a new API key)")
            for c in children:
                if not c.alive():
                    _say(f"{c.name} exited with {c.proc.returncode if c.proc else '?'}; see {c.log_path}")
                    stop["flag"] = True
                    rc = 1
            time.sleep(0.2)  # supervisor poll; the signal handler sets the flag
    except DsecError as exc:
        print(f"dsec up: {exc.description}", file=sys.stderr)
        rc = 1
    finally:
        _say("stopping")
        # Host agent first: it removes its sandboxes while NATS is still there to record it.
        for c in reversed(children):
            c.stop(grace=60 if c.name == "hostagent" else 15)
        nats.stop()
        for s, h in old.items():
            signal.signal(s, h)
        _say("stopped")
    return rc
