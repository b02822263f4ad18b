"""``python -m sdk.rollouts``: one rollout worker process (run as many as wanted)."""

from __future__ import annotations

import argparse
import asyncio

from bus import subjects as S

from .._async import close_connections
from ._worker import RolloutWorker


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sdk.rollouts", description="a dsec rollout worker")
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--queue", default=S.ROLLOUT_QUEUE)
    ap.add_argument("--capacity", type=int, default=16, help="rollouts run at once")
    ap.add_argument("--ack-wait", type=float, default=30.0, help="seconds a silent worker's job waits before another takes it up")
    args = ap.parse_args(argv)

    async def run() -> None:
        w = RolloutWorker(args.nats_url, queue=args.queue, capacity=args.capacity, ack_wait_s=args.ack_wait)
        try:
            await w.run()
        finally:
            await close_connections()

    asyncio.run(run())


if __name__ == "__main__":
    main()
