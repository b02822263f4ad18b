"""``python -m guard``: publish the security profiles and run the audit watcher until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import os

from bus import log as _log


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m guard", description=__doc__)
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    ap.add_argument("--host-id", default=None, help="reported in violations; default: this machine's hostname")
    ap.add_argument("--no-kernel-audit", action="store_true",
                    help="don't read this host's kernel audit records nor its dropped sandbox packets (run one guard with them per sandbox host)")
    ap.add_argument("--no-enable-audit", action="store_true", help="never switch kernel audit on (then Landlock denials are not reported)")
    ap.add_argument("--no-readonly-audit", action="store_true",
                    help="don't install the kernel audit rules that report writes refused by read-only system paths "
                         "(they cost every syscall on the host some tens of ns)")
    ap.add_argument("--cgroup-parent", default="/dsec", help="cgroup under which the host agent puts sandboxes")
    ap.add_argument("--nflog-group", type=int, default=None,
                    help="NFLOG group the host agent logs dropped sandbox packets to "
                         "(default: $DSEC_NFLOG_GROUP or bus.subjects.NFLOG_GROUP); -1: don't read them")
    ap.add_argument("--report-interval", type=float, default=1.0, help="seconds between two reports of the same denial of one sandbox")
    args = ap.parse_args()
    _log.configure()
    from bus import subjects as S

    from ._service import Guard

    group = args.nflog_group if args.nflog_group is not None else int(os.environ.get("DSEC_NFLOG_GROUP") or S.NFLOG_GROUP)

    svc = Guard(
        args.nats_url, host_id=args.host_id, kernel_audit=not args.no_kernel_audit, enable_audit=not args.no_enable_audit,
        readonly_audit=not args.no_readonly_audit, cgroup_parent=args.cgroup_parent, report_interval_s=args.report_interval,
        nflog_group=None if group < 0 else group,
    )
    asyncio.run(svc.run())


if __name__ == "__main__":
    main()
