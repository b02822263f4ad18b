"""``python -m placement``: run one placement replica until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import gc

from nats.js.api import StorageType

from bus.metrics import add_cli_flag as add_metrics_flag
from bus.sign import load_control_key
from bus.streams import StreamOptions

from ._service import Placement
from ._table import Policy

MEMORY_EVENTS_MAX_BYTES = 512 * 1024**2  # memory streams share the server's memory store


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m placement", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--replica-id", default=None)
    # a request is held until its host answers, for the whole create: room for every host's concurrency
    ap.add_argument("--capacity", type=int, default=512, help="requests held at once by this replica (until their hosts answer)")
    ap.add_argument("--strategy", choices=["spread", "pack"], default="spread")
    ap.add_argument("--sample-k", type=int, default=8)
    ap.add_argument("--ack-wait", type=float, default=10.0, help="seconds before a dead replica's requests are redelivered")
    ap.add_argument("--pending-delay", type=float, default=0.5, help="first re-try delay of a request no host fits")
    ap.add_argument("--stream-storage", choices=["file", "memory"], default="file", help="storage of streams this replica creates (memory: scale benchmarks)")
    ap.add_argument("--control-key-file", default=None, help="hex key to sign host work with (default: $DSEC_CONTROL_KEY; neither: unsigned)")
    add_metrics_flag(ap)
    args = ap.parse_args()
    storage = StorageType.MEMORY if args.stream_storage == "memory" else StorageType.FILE
    events_max_bytes = MEMORY_EVENTS_MAX_BYTES if storage == StorageType.MEMORY else StreamOptions().events_max_bytes
    svc = Placement(
        args.nats_url, replica_id=args.replica_id, capacity=args.capacity, policy=Policy(sample_k=args.sample_k, strategy=args.strategy),
        ack_wait_s=args.ack_wait, control_key=load_control_key(args.control_key_file), pending_delay_s=args.pending_delay,
        stream_options=StreamOptions(storage=storage, events_max_bytes=events_max_bytes),
    )
    # Every request allocates and frees a few dozen objects; the default gen-0 threshold (700) would run
    # the cyclic GC hundreds of times a second in a burst. Nothing here builds reference cycles per request.
    gc.set_threshold(50_000, 20, 100)
    svc.metrics_port = args.metrics_port
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
