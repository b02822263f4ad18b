"""``python -m hostagent``: run this host's agent until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os

from bus import log as _log
from bus.metrics import add_cli_flag as add_metrics_flag

from . import backends
from ._config import add_flags, from_args


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m hostagent", description=__doc__)
    add_flags(ap, backends.names())
    ap.add_argument("--cleanup", action="store_true",
                    help="remove everything left for --data-dir (containers, containerd, shims, mounts, network) and exit; only while no agent serves it")
    add_metrics_flag(ap)
    args = ap.parse_args()
    _log.configure()
    config = from_args(args)
    if args.cleanup:
        from .backends.container import network_config
        from .backends.container.cleanup import run_cleanup

        raise SystemExit(run_cleanup(config.data_dir, network_config(config.net_prefix)))
    os.makedirs(config.data_dir, exist_ok=True)
    if config.backend == "sim":
        from .backends.sim.hosts import run_sim_hosts

        asyncio.run(run_sim_hosts(config, args.host_id or ""))
        return
    from ._service import HostAgent

    agent = HostAgent(backends.make(config), config)
    asyncio.run(agent.run())


if __name__ == "__main__":
    main()
