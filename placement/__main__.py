"""``python -m placement``: run one placement replica until SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import gc

from bus.config import from_args, parser
from bus.sign import load_control_key

from ._config import PlacementConfig
from ._service import Placement


def main(argv: list[str] | None = None) -> None:
    args = parser("python -m placement", __doc__, PlacementConfig).parse_args(argv)
    cfg = from_args(PlacementConfig, args)
    cfg = dataclasses.replace(cfg, control_key=load_control_key(cfg.control_key_file))
    svc = Placement(config=cfg)
    # Every request allocates and frees a few dozen objects; the default gen-0 threshold (700) would run
    # the cyclic GC hundreds of times a second in a burst. Nothing here builds reference cycles per request.
    gc.set_threshold(50_000, 20, 100)
    svc.metrics_port = cfg.metrics_port
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
