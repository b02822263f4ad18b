"""``python -m placement``: run one placement replica until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio

from ._service import Placement
from ._table import Policy


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m placement", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--replica-id", default=None)
    ap.add_argument("--capacity", type=int, default=256, help="requests handled at once by this replica")
    ap.add_argument("--strategy", choices=["spread", "pack"], default="spread")
    ap.add_argument("--sample-k", type=int, default=8)
    args = ap.parse_args()
    svc = Placement(args.nats_url, replica_id=args.replica_id, capacity=args.capacity, policy=Policy(sample_k=args.sample_k, strategy=args.strategy))
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
