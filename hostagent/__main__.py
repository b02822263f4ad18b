"""``python -m hostagent``: run this host's agent until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any

from bus import log as _log
from bus.metrics import add_cli_flag as add_metrics_flag

from . import _storage as storage


def network_config() -> Any:
    """The network config from the environment (NetworkConfig.from_env), with $DSEC_NET_PREFIX naming
    this agent's kernel objects (nft table ``dsec_<p>``, veths ``<p>*``, netns ``dsec-<p>-*``) so that
    two stacks on one machine keep apart; without it, the default names."""
    import dataclasses

    from ._container import NetworkConfig

    cfg = NetworkConfig.from_env()
    p = os.environ.get("DSEC_NET_PREFIX")
    return dataclasses.replace(cfg, table=f"dsec_{p}", ifprefix=p, netns_prefix=f"dsec-{p}-") if p else cfg


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hostagent", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--host-id", default=None, help="default: this machine's hostname")
    ap.add_argument("--data-dir", default="/var/lib/dsec")
    ap.add_argument("--backend", default="container", choices=["container", "sim"])
    ap.add_argument("--concurrency", type=int, default=8, help="creates handled at once (max_ack_pending)")
    ap.add_argument("--pool", default="default")
    ap.add_argument("--cpu-overcommit", type=float, default=50.0)
    ap.add_argument("--mem-overcommit", type=float, default=1.0)
    ap.add_argument("--max-sandboxes", type=int, default=0)
    ap.add_argument("--containerd-address", default=None, help="default: start a private containerd under the data dir")
    ap.add_argument("--destroy-on-shutdown", action="store_true", help="kill every sandbox when stopping (dev stacks); default keeps them for a restart")
    ap.add_argument("--reconcile-s", type=float, default=10.0, help="period of the reconcile loop (records vs containerd, mounts, cgroups)")
    ap.add_argument("--containerd-calls", type=int, default=32, help="containerd calls in flight at once (more queue)")
    ap.add_argument("--warm-pool", type=int, default=4, help="started sandboxes kept ready per template and disk size (0: off)")
    ap.add_argument("--sim-hosts", type=int, default=1, help="with --backend sim: how many simulated hosts this process runs")
    ap.add_argument("--cleanup", action="store_true",
                    help="remove everything left for --data-dir (containers, containerd, shims, mounts, network) and exit; only while no agent serves it")
    ap.add_argument("--control-key-file", default=None,
                    help="hex key placement signs host work with (default: $DSEC_CONTROL_KEY; neither: accept unsigned work)")
    add_metrics_flag(ap)
    storage.add_cli_flags(ap)
    args = ap.parse_args()
    storage.apply_cli_flags(args)
    _log.configure()
    if args.cleanup:
        from ._cleanup import run_cleanup

        raise SystemExit(run_cleanup(args.data_dir, network_config()))
    os.makedirs(args.data_dir, exist_ok=True)
    if args.backend == "sim":
        from ._sim import run_sim_hosts

        asyncio.run(run_sim_hosts(args))
        return
    from bus.sign import load_control_key

    from ._container import ContainerBackend
    from ._service import HostAgent

    backend = ContainerBackend(
        args.data_dir, containerd_address=args.containerd_address, warm_pool=args.warm_pool, network=network_config(),
        containerd_calls=args.containerd_calls,
    )
    agent = HostAgent(
        backend, nats_url=args.nats_url, host_id=args.host_id, data_dir=args.data_dir, concurrency=args.concurrency,
        pool=args.pool, cpu_overcommit=args.cpu_overcommit, mem_overcommit=args.mem_overcommit,
        max_sandboxes=args.max_sandboxes, destroy_on_shutdown=args.destroy_on_shutdown, control_key=load_control_key(args.control_key_file),
        reconcile_s=args.reconcile_s,
    )
    agent.metrics_port = args.metrics_port
    asyncio.run(agent.run())


if __name__ == "__main__":
    main()
