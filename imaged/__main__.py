"""``python -m imaged serve`` runs the image service; ``python -m imaged lazy ...`` the host-side lazy loader;
``python -m imaged image ...`` the same commands as ``dsec image ...``."""

from __future__ import annotations

import argparse
import asyncio
import sys


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
    s = sub.add_parser("serve", help="run the image service")
    s.add_argument("--data-dir", default=None)
    s.add_argument("--nats-url", default=None)
    s.add_argument("--no-base", action="store_true", help="do not build the busybox base template at start")
    from bus.metrics import add_cli_flag

    add_cli_flag(s)
    sub.add_parser("lazy", help="run the host-side lazy loader (see python -m imaged.lazy --help)")
    sub.add_parser("image", help="dsec image ... commands")
    args = ap.parse_args(argv or ["serve"])
    from ._service import ImagedService

    svc = ImagedService(args.nats_url, data_dir=args.data_dir, ensure_base=not args.no_base)
    svc.metrics_port = args.metrics_port
    asyncio.run(svc.run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
