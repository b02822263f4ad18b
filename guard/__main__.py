"""``python -m guard``: publish the security profiles and run the audit watcher until SIGTERM."""

from __future__ import annotations

import asyncio

from bus import log as _log
from bus.config import from_args, parser

from ._config import GuardConfig


def main(argv: list[str] | None = None) -> None:
    cfg = from_args(GuardConfig, parser("python -m guard", __doc__, GuardConfig).parse_args(argv))
    _log.configure()
    from ._service import Guard

    svc = Guard(config=cfg)
    svc.metrics_port = cfg.metrics_port
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
