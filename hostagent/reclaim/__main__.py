"""``python -m hostagent.reclaim``: reclaim the cold memory of this host's idle sandboxes until SIGTERM."""

from __future__ import annotations

import asyncio
import sys

from bus import log as _log
from bus.config import from_args, parser

from ._config import ReclaimConfig
from ._host import SwapRefused


def main(argv: list[str] | None = None) -> None:
    cfg = from_args(ReclaimConfig, parser("python -m hostagent.reclaim", __doc__, ReclaimConfig).parse_args(argv))
    _log.configure()
    from ._service import ReclaimService

    try:
        svc = ReclaimService(cfg)
    except SwapRefused as exc:
        print(f"hostagent.reclaim: {exc}", file=sys.stderr)
        sys.exit(2)
    svc.metrics_port = cfg.metrics_port
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
