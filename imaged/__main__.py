"""``python -m imaged serve`` runs the image service; ``python -m imaged lazy ...`` the host-side lazy loader;
``python -m imaged image ...`` the same commands as ``dsec image ...``."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import dataclass, field

from bus.config import METRICS_PORT, NATS_URL, add_flags, from_args, setting

from ._quota import DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT


@dataclass(frozen=True)
class ImagedConfig:
    """``python -m imaged serve``'s settings."""

    nats_url: str | None = field(default=None, metadata=NATS_URL)
    data_dir: str | None = field(default=None, metadata=setting("where templates are built and kept", default_text="$DSEC_DATA_DIR, else /var/lib/dsec"))
    base: bool = field(default=True, metadata=setting("build the busybox base template at start when it is missing"))
    metrics_port: int | None = field(default=None, metadata=METRICS_PORT)
    template_max_bytes_per_tenant: int = field(default=DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT, metadata=setting(
        "bytes of layers one tenant's templates may hold in the blob store (0: no limit)", env="DSEC_TEMPLATE_MAX_BYTES_PER_TENANT"))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "lazy":
        from .lazy import main as lazy_main

        return lazy_main(argv[1:])
    if argv and argv[0] == "image":
        from .cli import main as cli_main

        return cli_main(argv)
    ap = argparse.ArgumentParser(prog="python -m imaged")
    sub = ap.add_subparsers(dest="cmd")
    add_flags(sub.add_parser("serve", help="run the image service"), ImagedConfig)
    sub.add_parser("lazy", help="run the host-side lazy loader (see python -m imaged.lazy --help)")
    sub.add_parser("image", help="dsec image ... commands")
    cfg = from_args(ImagedConfig, ap.parse_args(argv or ["serve"]))
    from ._service import ImagedService

    svc = ImagedService(cfg.nats_url, data_dir=cfg.data_dir, ensure_base=cfg.base, template_max_bytes_per_tenant=cfg.template_max_bytes_per_tenant)
    svc.metrics_port = cfg.metrics_port
    asyncio.run(svc.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
