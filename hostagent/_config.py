"""``HostAgentConfig``: every setting of a host agent, built once (from flags and the environment in
``python -m hostagent``, or directly by tests and benchmarks); each default is declared here only."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bus.messages import BackendName

DEFAULT_WARM_POOL = 4  # started sandboxes kept ready per template, disk size and profile (container backend)
GiB = 1 << 30
# settings a flag sets, else the environment (``DSEC_<NAME>``), else the declared default
ENV_SETTINGS = ("snapshot_max_bytes_per_sandbox", "snapshot_max_bytes_per_tenant", "write_reserve_mb", "disk_growth_window_s", "upload_max_bytes_per_tenant")


def default_host_id() -> str:
    return socket.gethostname().split(".")[0].replace("_", "-")


@dataclass(frozen=True)
class HostAgentConfig:
    nats_url: str | None = None  # None: $DSEC_NATS_URL or nats://127.0.0.1:4222
    host_id: str = ""  # empty: this machine's hostname
    data_dir: str = "/var/lib/dsec"
    backend: BackendName = "container"
    concurrency: int = 8  # creates handled at once (the hand-off inbox's capacity)
    heartbeat_s: float = 2.0
    pool: str = "default"
    cpu_overcommit: float = 50.0
    mem_overcommit: float = 1.0
    max_sandboxes: int = 0  # 0: no limit but resources
    persist_state: bool = True  # local state files (sim hosts keep none)
    destroy_on_shutdown: bool = False  # kill every sandbox when stopping (dev stacks); else kept for a restart
    grace_s: float = 10.0  # how long a stopping agent lets work in progress finish
    control_key: bytes | None = None  # with a key, only work placement signed runs (bus.sign)
    reconcile_s: float = 10.0  # period of the reconcile loop (records vs the backend)
    kill_wait_s: float = 10.0  # how long a kill request waits for its teardown before answering "stopping"
    containerd_address: str | None = None  # None: a private containerd under the data dir
    containerd_calls: int = 32  # containerd calls in flight at once (more queue)
    warm_pool: int = DEFAULT_WARM_POOL
    net_prefix: str = ""  # names this agent's kernel objects (nft table, veths, netns) apart from another stack's
    sim_hosts: int = 1  # with the sim backend: simulated hosts this process runs
    metrics_port: int | None = None
    fn_pools: str = ""  # FnCall warm pools, ``<template>=<members>,...`` (e.g. base=8,python=8); "": none
    fn_pool_max: int = 0  # members of one fn pool at most, idle, busy and starting (0: 4x its size)
    fn_memory_mb: int = 512  # an fn pool member's memory limit (a call may set its own)
    fn_disk_mb: int = 256  # an fn pool member's disk (its scratch filesystem)
    fn_starts: int = 4  # fn pool members being started at once, every pool together (a start is mostly waiting)
    # What a sandbox may make this host store (hostagent._storage): bytes its snapshots (persisted pauses
    # and CRIU dumps included) put in the blob store, per sandbox and per tenant; 0: no limit.
    snapshot_max_bytes_per_sandbox: int = 16 * GiB
    snapshot_max_bytes_per_tenant: int = 256 * GiB
    # Bytes a tenant's file uploads may hold in its sandboxes on this host (hostagent._uploads); 0: no limit.
    upload_max_bytes_per_tenant: int = 64 * GiB
    write_reserve_mb: int = 64  # MiB kept free in the data dir: writes that would use them fail with no_space
    disk_growth_window_s: float = 120.0  # a full disk is blamed on the sandbox whose disk grew most within this long (hostagent._diskwatch)

    def __post_init__(self) -> None:
        if not self.host_id:
            object.__setattr__(self, "host_id", default_host_id())

    def replace(self, **changes: Any) -> HostAgentConfig:
        return dataclasses.replace(self, **changes)


_D = HostAgentConfig(host_id="-")  # the declared defaults, for the flags


def add_flags(ap: argparse.ArgumentParser, backends: list[str]) -> None:
    """The command line of ``python -m hostagent``; every default comes from ``HostAgentConfig``."""
    d = " (default: %(default)s)"
    ap.add_argument("--nats-url", default=_D.nats_url, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--host-id", default=None, help="default: this machine's hostname")
    ap.add_argument("--data-dir", default=_D.data_dir, help="state, layers, scratch disks, the private containerd" + d)
    ap.add_argument("--backend", default=_D.backend, choices=backends, help="the sandbox backend this host runs" + d)
    ap.add_argument("--concurrency", type=int, default=_D.concurrency, help="creates handled at once" + d)
    ap.add_argument("--pool", default=_D.pool, help="the host pool placement matches sandboxes to" + d)
    ap.add_argument("--cpu-overcommit", type=float, default=_D.cpu_overcommit, help="CPU admitted per CPU of the host" + d)
    ap.add_argument("--mem-overcommit", type=float, default=_D.mem_overcommit, help="memory admitted per MB of the host" + d)
    ap.add_argument("--max-sandboxes", type=int, default=_D.max_sandboxes, help="0: no limit but resources" + d)
    ap.add_argument("--containerd-address", default=_D.containerd_address, help="default: start a private containerd under the data dir")
    ap.add_argument("--destroy-on-shutdown", action="store_true", default=_D.destroy_on_shutdown,
                    help="kill every sandbox when stopping (dev stacks); default keeps them for a restart")
    ap.add_argument("--reconcile-s", type=float, default=_D.reconcile_s, help="period of the reconcile loop (records vs containerd, mounts, cgroups)" + d)
    ap.add_argument("--containerd-calls", type=int, default=_D.containerd_calls, help="containerd calls in flight at once (more queue)" + d)
    ap.add_argument("--warm-pool", type=int, default=_D.warm_pool, help="started sandboxes kept ready per template, disk size and profile (0: off)" + d)
    ap.add_argument("--fn-pool", default=_D.fn_pools, help="FnCall warm pools, <template>=<members>,... e.g. base=8,python=8 (default: none)")
    ap.add_argument("--fn-pool-max", type=int, default=_D.fn_pool_max, help="members of one fn pool at most (0: 4x its size)" + d)
    ap.add_argument("--fn-memory-mb", type=int, default=_D.fn_memory_mb, help="an fn pool member's memory limit" + d)
    ap.add_argument("--fn-disk-mb", type=int, default=_D.fn_disk_mb, help="an fn pool member's disk" + d)
    ap.add_argument("--fn-starts", type=int, default=_D.fn_starts, help="fn pool members started at once" + d)
    ap.add_argument("--sim-hosts", type=int, default=_D.sim_hosts, help="with --backend sim: how many simulated hosts this process runs" + d)
    env = " (default: $DSEC_{} or {})"
    ap.add_argument("--snapshot-max-bytes-per-sandbox", type=int, default=None, help="bytes one sandbox's snapshots may put in the blob store, 0: no limit"
                    + env.format("SNAPSHOT_MAX_BYTES_PER_SANDBOX", _D.snapshot_max_bytes_per_sandbox))
    ap.add_argument("--snapshot-max-bytes-per-tenant", type=int, default=None, help="the same for all sandboxes of one tenant"
                    + env.format("SNAPSHOT_MAX_BYTES_PER_TENANT", _D.snapshot_max_bytes_per_tenant))
    ap.add_argument("--upload-max-bytes-per-tenant", type=int, default=None, help="bytes one tenant's file uploads may hold in its sandboxes here, 0: no limit"
                    + env.format("UPLOAD_MAX_BYTES_PER_TENANT", _D.upload_max_bytes_per_tenant))
    ap.add_argument("--write-reserve-mb", type=int, default=None, help="MiB kept free in the data dir: writes that would use them fail with no_space"
                    + env.format("WRITE_RESERVE_MB", _D.write_reserve_mb))
    ap.add_argument("--disk-growth-window-s", type=float, default=None, help="a full disk is blamed on the sandbox whose disk grew most within this long"
                    + env.format("DISK_GROWTH_WINDOW_S", _D.disk_growth_window_s))
    ap.add_argument("--control-key-file", default=None,
                    help="hex key placement signs host work with (default: $DSEC_CONTROL_KEY; neither: accept unsigned work)")


def from_args(args: argparse.Namespace, env: Mapping[str, str] = os.environ) -> HostAgentConfig:
    from bus.sign import load_control_key

    return HostAgentConfig(
        nats_url=args.nats_url, host_id=args.host_id or "", data_dir=args.data_dir, backend=args.backend, concurrency=args.concurrency,
        pool=args.pool, cpu_overcommit=args.cpu_overcommit, mem_overcommit=args.mem_overcommit, max_sandboxes=args.max_sandboxes,
        destroy_on_shutdown=args.destroy_on_shutdown, control_key=load_control_key(args.control_key_file, env),
        reconcile_s=args.reconcile_s, containerd_address=args.containerd_address, containerd_calls=args.containerd_calls,
        warm_pool=args.warm_pool, net_prefix=env.get("DSEC_NET_PREFIX", ""), sim_hosts=args.sim_hosts,
        metrics_port=args.metrics_port, fn_pools=args.fn_pool, fn_pool_max=args.fn_pool_max, fn_memory_mb=args.fn_memory_mb,
        fn_starts=args.fn_starts, fn_disk_mb=args.fn_disk_mb, **_from_env(args, env),
    )


def _from_env(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The ``ENV_SETTINGS``: the flag when given, else ``$DSEC_<NAME>`` when it parses (negative
    numbers are 0), else nothing (the declared default)."""
    out: dict[str, Any] = {}
    for name in ENV_SETTINGS:
        kind = type(getattr(_D, name))
        v = getattr(args, name, None)
        if v is None:
            try:
                v = kind(env.get(f"DSEC_{name.upper()}", ""))
            except ValueError:
                continue
        out[name] = max(kind(0), v)
    return out


__all__ = ["DEFAULT_WARM_POOL", "ENV_SETTINGS", "HostAgentConfig", "add_flags", "default_host_id", "from_args"]
