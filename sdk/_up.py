"""``dsec up``: the whole dev stack on this machine, in the foreground, supervised until Ctrl-C or SIGTERM.

It starts the same processes production runs (``python -m placement`` and friends) and imports none of
them. A process that exits is started again (bounded exponential backoff with jitter); sandboxes live
on across a restart of any one service (the host agent recovers its sandboxes, the lazy loader takes
its FUSE connection back, nats-server restarts on the same store and port). The supervisor's view of
its services is ``<data-dir>/services.json`` (``dsec status`` shows it). Only Ctrl-C or SIGTERM stops
the stack: services in reverse start order, by pid, then nats-server, then a sweep by the host agent's
own clean-up entry point of whatever the data dir still owns.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import ipaddress
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bus.auth import ENV_MONITOR_URL, MONITOR_ROLE, OPERATOR_ROLE, AuthConfig, default_context_path, remove_client_context, write_client_context
from bus.errors import DsecError, InvalidArgument
from bus.natsd import NatsCluster, NatsServer, NatsServerError
from bus.streams import REPLICAS_ENV
from bus.sign import ENV_CONTROL_KEY
from bus.subjects import METRICS_SCRAPE

from ._hostnet import HostNet

SERVICES_FILE = "services.json"


@dataclass(frozen=True)
class Service:
    """One supervised process: ``python -m ARGV...`` connected to NATS as user ``role`` (bus.auth;
    "" for none: the gateway, whose every API key is its own NATS user).

    ``argv`` items are formatted with the stack's settings: every ``dsec up`` option by its dest
    (``{backend}``, ``{concurrency}``, ...), ``{data}`` (the resolved data dir) and ``{host_id}``;
    ``replicas`` names the option that says how many run (default one)."""

    name: str
    role: str
    argv: tuple[str, ...]
    grace_s: float = 15.0
    control_key: bool = False  # placement signs host work with it; host agents run nothing else (bus.sign)
    replicas: str = ""
    enabled_by: str = ""  # the on|off option that turns it off
    per_host: bool = False  # one per host (``--hosts N``: in each host's network namespace, with its data dir and id)
    hosts_only: bool = False  # only with ``--hosts N`` (a host's share of a machine-wide duty)


# Start order; the stack stops in reverse (the host agent first: it removes its sandboxes while the
# lazy loader and NATS are still there). Adding a service is one line here.
SERVICES: tuple[Service, ...] = (
    Service("imaged", "imaged", ("imaged", "serve", "--data-dir", "{data}")),
    Service("lazy-loader", "imaged", ("imaged.lazy", "--data-dir", "{data}", "--mount", "{data}/lazy", "--host-id", "{host_id}"), per_host=True),
    Service("placement", "placement", ("placement", "--host-down", "{host_down}"), control_key=True, replicas="placement_replicas"),
    Service("guard", "guard", ("guard",)),
    # NFLOG is per network namespace: the drops a host's agent logs in its own are read there.
    Service("guard-drops", "guard", ("guard", "--drops-only", "--host-id", "{host_id}"), per_host=True, hosts_only=True),
    Service("gateway", "", ("sdk.gateway", "--http-port", "{http_port}")),
    Service("rollouts", "rollouts", ("sdk.rollouts",)),
    # Stopped after the host agent: its swap is taken away once the sandboxes are gone (no pages to bring back).
    Service("reclaim", "hostagent", ("hostagent.reclaim", "--data-dir", "{data}", "--host-id", "{host_id}"), enabled_by="reclaim", per_host=True),
    Service("hostagent", "hostagent", ("hostagent", "--data-dir", "{data}", "--host-id", "{host_id}", "--backend", "{backend}",
                                       "--concurrency", "{concurrency}", "--destroy-on-shutdown", "--fn-pool", "{fn_pool}"),
            grace_s=60, control_key=True, per_host=True),
)

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 30.0
STABLE_S = 30.0  # a process up this long has recovered: the next exit starts the backoff afresh
TICK_S = 0.2  # how often exits are looked for
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # SIGHUP: the terminal went away


def _say(msg: str) -> None:
    print(f"dsec up: {msg}", flush=True)


def exit_text(code: int | None) -> str:
    if code is None:
        return "?"
    if code < 0:
        try:
            return f"signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


class Supervised(abc.ABC):
    """One process of the stack and its record: restarts, last exit, up since, next start."""

    blocking_start: bool  # start() waits for readiness (run in a thread) or returns at once

    def __init__(self, name: str, log_path: Path, grace_s: float) -> None:
        self.name = name
        self.log_path = log_path
        self.grace_s = grace_s
        self.state = "stopped"  # starting | running | backoff | stopped
        self.restarts = 0
        self.last_exit: int | None = None
        self.last_exit_at: float | None = None
        self.up_since: float | None = None
        self.started_mono = 0.0
        self.failures = 0  # exits in a row, each within STABLE_S of its start
        self.next_start = 0.0

    # What a kind of process does differently: how it starts, whether it lives, how it stops.
    @abc.abstractmethod
    def _launch(self) -> None: ...

    @abc.abstractmethod
    def pid(self) -> int | None: ...

    @abc.abstractmethod
    def poll(self) -> int | None:
        """The exit code once the process is gone, else None."""

    @abc.abstractmethod
    def _terminate(self, grace: float) -> None: ...

    def start(self) -> None:
        self.state, self.started_mono = "starting", time.monotonic()
        self._launch()
        self.state, self.up_since = "running", time.time()

    def exited(self, code: int | None) -> float:
        """Record an exit (None: it did not even start); returns the delay before the next start."""
        if code is not None:
            self.last_exit, self.last_exit_at = code, time.time()
        self.failures = 1 if time.monotonic() - self.started_mono > STABLE_S else self.failures + 1
        # Full jitter on a capped exponential: a crash loop costs little, and restarts of several
        # services that fell together (NATS away) spread out.
        delay = random.uniform(0.5, 1.0) * min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2.0 ** (self.failures - 1))
        self.state, self.up_since, self.next_start = "backoff", None, time.monotonic() + delay
        return delay

    def stop(self) -> None:
        if self.poll() is None and self.pid() is not None:
            self._terminate(self.grace_s)
        self.state = "stopped"

    def view(self) -> dict[str, Any]:
        return {
            "name": self.name, "state": self.state, "pid": self.pid() if self.state == "running" else None, "restarts": self.restarts,
            "last_exit": self.last_exit, "last_exit_at": self.last_exit_at, "up_since": self.up_since, "log": str(self.log_path),
        }


# A service outlives a supervisor killed by SIGKILL unless told otherwise: setpriv (util-linux, always on
# Debian) has the kernel send it SIGTERM when its parent goes, and it stops as on a Ctrl-C.
_SETPRIV = shutil.which("setpriv") or shutil.which("setpriv", path="/usr/bin:/bin")
DIE_WITH_SUPERVISOR = [_SETPRIV, "--pdeathsig", "TERM", "--"] if _SETPRIV else []


class Child(Supervised):
    """A ``python -m`` service, in its own session (a Ctrl-C on the terminal reaches only the supervisor).

    Started from the event loop's thread: the parent-death signal follows the thread that forked."""

    blocking_start = False

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path, grace_s: float) -> None:
        super().__init__(name, log_path, grace_s)
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def _launch(self) -> None:
        with open(self.log_path, "ab") as log:
            if self.restarts:
                log.write(f"--- dsec up: restart {self.restarts} at {time.strftime('%Y-%m-%dT%H:%M:%S')} ---\n".encode())
                log.flush()
            self.proc = subprocess.Popen(
                [*DIE_WITH_SUPERVISOR, *self.argv], env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )

    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def poll(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def _terminate(self, grace: float) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            _say(f"{self.name} (pid {self.proc.pid}) did not stop within {grace:.0f}s: killing it")
            self.proc.kill()
            self.proc.wait()


class NatsChild(Supervised):
    """nats-server (or one node of a cluster): restarted on the same store dir, ports and users
    (bus.natsd), so a node that died rejoins its cluster and catches up; its start waits until
    JetStream is ready, off the event loop."""

    blocking_start = True

    def __init__(self, server: NatsServer, name: str = "nats-server") -> None:
        super().__init__(name, Path(server.log_file), 10.0)
        self.server = server
        self._proc: subprocess.Popen[bytes] | None = None

    def _launch(self) -> None:
        self.server.proc = None  # forget the dead one; start() makes a new one on the same config
        self.server.start()
        self._proc = self.server.proc

    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def poll(self) -> int | None:
        return self._proc.poll() if self._proc else None

    def _terminate(self, grace: float) -> None:
        self.server.proc = self._proc
        self.server.stop(grace)


class Supervisor:
    def __init__(
        self, data: Path, nats: list[NatsChild], children: list[Child], backend: str, hosts: HostNet | None = None, cluster: NatsCluster | None = None,
    ) -> None:
        self.data = data
        self.hosts = hosts
        self.nats = nats  # one nats-server, or the nodes of ``cluster``
        self.cluster = cluster
        self.children = children
        self.backend = backend
        self.stopping = asyncio.Event()
        self.view_path = data / SERVICES_FILE

    @property
    def all(self) -> list[Supervised]:
        return [*self.nats, *self.children]

    @property
    def url(self) -> str:
        """The NATS URL every process is given: a seed list of every node, on a cluster."""
        return ",".join(n.server.url for n in self.nats)

    def reload(self, extra_config: str) -> None:
        """Users and permissions, the same on every node."""
        for n in self.nats:
            n.server.reload(extra_config)

    def write_view(self) -> None:
        view = {"supervisor_pid": os.getpid(), "nats_url": self.url, "at": time.time(), "services": [s.view() for s in self.all]}
        tmp = self.view_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(view))
        os.replace(tmp, self.view_path)

    async def _start(self, s: Supervised) -> bool:
        try:
            if s.blocking_start:
                await asyncio.to_thread(s.start)
            else:
                s.start()
        except (OSError, NatsServerError) as exc:
            delay = s.exited(None)
            _say(f"{s.name} did not start ({exc}); next try in {delay:.1f}s")
            return False
        _say(f"{'restarted' if s.restarts else 'started'} {s.name} (pid {s.pid()}), log {s.log_path}")
        return True

    async def tend(self) -> None:
        """Start what is due, record what exited; until stopping."""
        while not self.stopping.is_set():
            changed = False
            for s in self.all:
                if self.stopping.is_set():
                    break
                if s.state == "running":
                    code = s.poll()
                    if code is not None:
                        delay = s.exited(code)
                        _say(f"{s.name} (pid {s.pid()}) exited with {exit_text(code)}; restart {s.restarts + 1} in {delay:.1f}s; see {s.log_path}")
                        changed = True
                elif s.state == "backoff" and time.monotonic() >= s.next_start:
                    s.restarts += 1
                    await self._start(s)
                    changed = True
            if changed:
                self.write_view()
            try:
                await asyncio.wait_for(self.stopping.wait(), TICK_S)
            except asyncio.TimeoutError:
                pass

    async def start_all(self) -> None:
        for s in self.all:
            if self.stopping.is_set():
                return
            if self.cluster is not None and self.children and s is self.children[0]:
                # Services set the streams up at start, replicated: the nodes must first agree on a leader.
                try:
                    await asyncio.to_thread(self.cluster.wait_meta_leader, 60.0)
                except NatsServerError as exc:
                    raise DsecError(str(exc)) from None
            if not await self._start(s) and s in self.nats:
                raise DsecError(f"{s.name} did not start; see {s.log_path}")
        self.write_view()

    async def stop_all(self) -> None:
        for s in reversed(self.children):
            await asyncio.to_thread(s.stop)
            self.write_view()
        for n in self.nats:
            await asyncio.to_thread(n.stop)
        self.write_view()
        if self.backend == "container":
            if self.hosts is None:
                await self.sweep(self.data)
            else:
                for i in range(self.hosts.count):
                    await self.sweep(host_data(self.data, i), self.hosts.enter(i), self.hosts.env(i))
        if self.hosts is not None:
            await asyncio.to_thread(self.hosts.destroy)
        self.view_path.unlink(missing_ok=True)

    async def sweep(self, data: Path, enter: list[str] | None = None, env: dict[str, str] | None = None) -> None:
        """Whatever a crash earlier left (a host agent killed with its sandboxes, a stray shim, a FUSE
        holder): the host agent's own clean-up entry point removes it (in the host's namespace)."""
        log_path = self.data / "logs" / "cleanup.log"
        with open(log_path, "ab") as log:
            proc = await asyncio.create_subprocess_exec(
                *(enter or []), sys.executable, "-m", "hostagent", "--cleanup", "--data-dir", str(data),
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, start_new_session=True,
            )
        try:
            rc = await asyncio.wait_for(proc.wait(), 180)
        except asyncio.TimeoutError:
            proc.kill()
            rc = await proc.wait()
        if rc != 0:
            _say(f"the final clean-up did not finish (exit {rc}); see {log_path}")


async def _wait_ready(url: str, deadline: float, sup: Supervisor) -> dict[str, Any]:
    import nats.errors

    from ._admin import cluster_status

    last: dict[str, Any] = {}
    while time.monotonic() < deadline and not sup.stopping.is_set():
        try:
            last = await cluster_status(url, timeout=2)
            if last["ready_hosts"] >= (sup.hosts.count if sup.hosts else 1) and "base" in last["templates"]:
                return last
        except (DsecError, nats.errors.Error, OSError):
            # Not ready yet, not a failure: a clustered JetStream still electing its streams'
            # leaders times a request out or answers 503 (CI on c5e8ffd: `--cluster 3` quit on one).
            pass
        try:
            await asyncio.wait_for(sup.stopping.wait(), 0.25)  # readiness poll interval
        except asyncio.TimeoutError:
            pass
    if sup.stopping.is_set():
        return {}
    restarts = {s.name: s.restarts for s in sup.all if s.restarts}
    raise DsecError(f"stack not ready in time (last status: {last}; restarts: {restarts or 'none'}); logs in {sup.data / 'logs'}")


def _children(args: argparse.Namespace, data: Path, logs: Path, env_of: Any, hosts: HostNet | None = None) -> list[Child]:
    # Every `dsec up` option by its name, plus the resolved data dir and host id.
    settings = {k: str(v) for k, v in vars(args).items()}
    host_id = args.host_id or socket.gethostname().split(".")[0]
    settings.update(data=str(data), host_id=host_id)
    out = []
    for svc in SERVICES:
        if (svc.enabled_by and getattr(args, svc.enabled_by, "on") == "off") or (svc.hosts_only and hosts is None):
            continue
        if svc.per_host and hosts is not None:
            for i in range(hosts.count):  # host i: its namespace, data dir, id and kernel names
                each = {**settings, "data": str(host_data(data, i)), "host_id": f"{host_id}-{i}"}
                argv = [*hosts.enter(i), sys.executable, "-m", *(a.format(**each) for a in svc.argv)]
                out.append(Child(f"{svc.name}-{i}", argv, {**env_of(svc), **hosts.env(i)}, logs / f"{svc.name}-{i}.log", svc.grace_s))
            continue
        n = getattr(args, svc.replicas) if svc.replicas else 1
        for i in range(n):
            name = f"{svc.name}-{i}" if svc.replicas else svc.name
            argv = [sys.executable, "-m", *(a.format(**settings) for a in svc.argv)]
            out.append(Child(name, argv, env_of(svc), logs / f"{name}.log", svc.grace_s))
    return out


def host_data(data: Path, i: int) -> Path:
    """Host ``i``'s data dir under a ``--hosts`` stack's."""
    return data / "hosts" / str(i)


def host_net(args: argparse.Namespace) -> HostNet | None:
    """The hosts' links of ``--hosts N`` (None: one host on this machine's own network)."""
    n = getattr(args, "hosts", 0)
    if not n:
        return None
    try:
        subnets = list(ipaddress.ip_network(args.hosts_net).subnets(new_prefix=24))
    except ValueError as exc:
        raise InvalidArgument(f"--hosts-net: {exc}") from None
    if len(subnets) < n + 1:
        raise InvalidArgument(f"--hosts-net {args.hosts_net} holds {len(subnets)} /24s: {n} hosts need {n + 1}")
    try:
        return HostNet(prefix=args.hosts_prefix, count=n, link_net=str(subnets[-1]), pools=tuple(str(p) for p in subnets[:n]))
    except ValueError as exc:
        raise InvalidArgument(f"--hosts-prefix: {exc}") from None


async def _reload_users(sup: Supervisor, auth_file: Path) -> None:
    """`dsec api-key create` and `revoke` edit the users in the auth file: have the server load them
    (a reload drops the connections of a removed user)."""
    seen = auth_file.stat().st_mtime_ns
    while not sup.stopping.is_set():
        try:
            await asyncio.wait_for(sup.stopping.wait(), TICK_S)
        except asyncio.TimeoutError:
            pass
        now = auth_file.stat().st_mtime_ns
        if now != seen and not sup.stopping.is_set():
            seen = now
            try:
                await asyncio.to_thread(sup.reload, AuthConfig.load_or_create(auth_file).config_block())
                _say("reloaded NATS users (API keys changed)")
            except NatsServerError as exc:
                _say(f"could not reload NATS users: {exc}")


async def _sync_quotas(auth_file: Path, url: str) -> None:
    """The API keys' quotas, as the auth file keeps them, into KV for placement (a stack started on
    an existing data dir, or one whose buckets were lost)."""
    from .gateway._keys import sync_limits

    try:
        if await sync_limits(auth_file, url):
            _say("wrote the API keys' quotas")
    except Exception as exc:  # noqa: BLE001 - the stack runs on; placement keeps the quotas KV has
        _say(f"could not write the API keys' quotas: {exc.description if isinstance(exc, DsecError) else repr(exc)}")


async def _run(args: argparse.Namespace, data: Path, sup: Supervisor, pointer: Path, auth: AuthConfig | None) -> int:
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, sup.stopping.set)
    rc = 0
    tend: asyncio.Task[None] | None = None
    try:
        await sup.start_all()
        url = sup.url
        write_client_context(data, url, OPERATOR_ROLE if auth else "", auth.passwords[OPERATOR_ROLE] if auth else "", pointer)
        tend = asyncio.create_task(sup.tend())
        users = asyncio.create_task(_reload_users(sup, data / "auth.json")) if auth else None
        # As the operator: nothing connects to an authenticated NATS without credentials.
        st = await _wait_ready(auth.url_for(OPERATOR_ROLE, url) if auth else url, time.monotonic() + args.ready_timeout, sup)
        if auth is not None:
            await _sync_quotas(data / "auth.json", auth.url_for(OPERATOR_ROLE, url))
        if st:
            _say(f"ready: {st['ready_hosts']} host(s), templates {', '.join(st['templates'])}, NATS at {url}")
            gw = f"http://127.0.0.1:{args.http_port}"
            _say(f"gateway (E2B API, envd, REST /v1, /openapi.json) at {gw}; an API key: dsec api-key create --data-dir {data}")
            _say(f"export E2B_API_URL={gw} E2B_SANDBOX_URL={gw}")
            _say(f"metrics: {gw}/metrics (every service), dashboard: {gw}/dashboard; on the bus: request {METRICS_SCRAPE} (every process answers)")
            _say(f"`dsec` and the SDK on this machine reach it as the operator (context {pointer}); Ctrl-C stops everything")
        await sup.stopping.wait()
        if users is not None:
            await users
    except DsecError as exc:
        print(f"dsec up: {exc.description}", file=sys.stderr)
        rc = 1
    finally:
        sup.stopping.set()
        if tend is not None:
            await tend
        _say("stopping")
        await sup.stop_all()
        remove_client_context(data, pointer)
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
        _say("stopped")
    return rc


def run_up(args: argparse.Namespace) -> int:
    if args.backend == "container" and os.geteuid() != 0:
        print("dsec up: the container backend needs root (mounts, cgroups, namespaces); run as root", file=sys.stderr)
        return 2
    data = Path(args.data_dir).resolve()
    logs = data / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    auth = None if args.no_auth else AuthConfig.load_or_create(data / "auth.json")
    try:
        hosts = host_net(args)
    except DsecError as exc:
        print(f"dsec up: {exc.description}", file=sys.stderr)
        return 2
    if hosts is not None:
        hosts.destroy()  # a crashed earlier run's links
        try:
            hosts.create()
        except RuntimeError as exc:
            print(f"dsec up: {exc}", file=sys.stderr)
            return 2
        for i in range(hosts.count):
            host_data(data, i).mkdir(parents=True, exist_ok=True)
        _say(f"{hosts.count} hosts, each in netns {hosts.netns(0)[:-1]}<i> behind link {hosts.link(0)[:-1]}<i>; NATS on {hosts.gateway}")
    # With --hosts, NATS listens on the hosts' bridge: they reach it over their links, as remote machines would.
    nats_host = hosts.gateway if hosts else "127.0.0.1"
    extra = auth.config_block() if auth else ""
    size = getattr(args, "cluster", 1)
    cluster: NatsCluster | None = None
    if size > 1:
        # Every node carries the same users and permissions (bus.auth); every stream and bucket R3.
        cluster = NatsCluster(data / "nats", size=size, ports=[args.port + i for i in range(size)],
                              route_ports=[args.cluster_port + i for i in range(size)], host=nats_host, extra_config=extra, log_dir=logs)
        nodes = [NatsChild(n, f"nats-server-n{i}") for i, n in enumerate(cluster.nodes)]
    else:
        nodes = [NatsChild(NatsServer(data / "nats", port=args.port, host=nats_host, log_file=str(logs / "nats-server.log"), extra_config=extra))]
    seeds = ",".join(n.server.url for n in nodes)
    base_env = {k: v for k, v in os.environ.items() if k not in (ENV_CONTROL_KEY, "DSEC_NATS_CREDS")}
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env[REPLICAS_ENV] = "3" if size > 1 else "1"  # every process sets the streams up alike (bus.streams)

    def env_of(svc: Service) -> dict[str, str]:
        # Each service connects as its own NATS user, with only the subjects it needs.
        e = {**base_env, "DSEC_NATS_URL": auth.url_for(svc.role, seeds) if auth and svc.role else seeds}
        if auth and svc.control_key:
            e[ENV_CONTROL_KEY] = auth.control_key
        if auth and svc.name == "gateway":
            e[ENV_MONITOR_URL] = auth.url_for(MONITOR_ROLE, seeds)  # its /metrics and /dashboard (read-only)
        return e

    pointer = Path(args.context) if args.context else default_context_path()
    sup = Supervisor(data, nodes, _children(args, data, logs, env_of, hosts), args.backend, hosts, cluster)
    try:
        return asyncio.run(_run(args, data, sup, pointer, auth))
    finally:
        if hosts is not None:
            hosts.destroy()  # stop_all did, unless it never ran
