"""``dsec snapshot ls|info|rm``: registered into the ``dsec`` command through the ``dsec.cli`` entry-point group.

    dsec snapshot ls [--sandbox ID] [--json] [--usage]   (--usage: bytes per tenant and sandbox)
    dsec snapshot info SNAPSHOT_ID [--json]
    dsec snapshot rm SNAPSHOT_ID...          (refused while other snapshots build on it)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from bus.errors import DsecError


def register(subparsers: Any) -> None:
    sp = subparsers.add_parser("snapshot", help="list, inspect and remove sandbox snapshots")
    ssub = sp.add_subparsers(dest="snapshot_cmd", required=True)
    ls = ssub.add_parser("ls", help="list snapshots (oldest first)")
    ls.add_argument("--sandbox", default=None, help="only the snapshots of this sandbox")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--usage", action="store_true", help="only the figures: blob-store bytes per tenant and per sandbox")
    info = ssub.add_parser("info", help="one snapshot's record")
    info.add_argument("snapshot_id")
    info.add_argument("--json", action="store_true")
    rm = ssub.add_parser("rm", help="remove snapshots nothing builds on (and the chunks only they used)")
    rm.add_argument("snapshot_ids", nargs="+")
    for p in (ls, info, rm):
        p.set_defaults(func=_run)


def usage(recs: list[Any]) -> dict[str, Any]:
    """Blob-store bytes the snapshots added (what the host agents' snapshot quotas count), in all, per
    tenant (the creating client; '' is the operator) and per sandbox."""
    tenants: dict[str, int] = {}
    sandboxes: dict[str, int] = {}
    for r in recs:
        t = r.spec.client if r.spec is not None else ""
        tenants[t] = tenants.get(t, 0) + r.bytes_added
        sandboxes[r.sandbox_id] = sandboxes.get(r.sandbox_id, 0) + r.bytes_added
    return {"snapshots": len(recs), "bytes": sum(tenants.values()), "tenants": tenants, "sandboxes": sandboxes}


def _usage_lines(use: dict[str, Any]) -> list[str]:
    lines = [f"{use['snapshots']} snapshots, {use['bytes']} bytes in the blob store"]
    lines += [f"  tenant {t or '(operator)'}: {b} bytes" for t, b in sorted(use["tenants"].items())]
    return lines


def _run(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except DsecError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 1


async def _main(args: argparse.Namespace) -> int:
    from ._async import AsyncSandbox, close_connections

    url = getattr(args, "nats_url", None)
    try:
        if args.snapshot_cmd == "ls":
            from ._async import _nc
            from ._snapshots import list_records

            recs = [r for r in await list_records(await _nc(url)) if args.sandbox is None or r.sandbox_id == args.sandbox]
            use = usage(recs)
            if args.usage:
                print(json.dumps(use) if args.json else "\n".join(_usage_lines(use)))
                return 0
            items = await AsyncSandbox.list_snapshots(nats_url=url, sandbox_id=args.sandbox)
            if args.json:
                print(json.dumps([asdict(i) for i in items]))
            for i in items if not args.json else []:
                at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(i.created_at))
                print(f"{i.snapshot_id}  {at}  {i.template:<10} {i.sandbox_id:<28} parent={i.parent_id or '-'} layers={i.layers} "
                      f"added={i.bytes_added}B{' memory' if i.memory else ''}{'  ' + i.name if i.name else ''}")
            if not args.json:
                print("\n".join(_usage_lines(use)))
        elif args.snapshot_cmd == "info":
            i = await AsyncSandbox.get_snapshot(args.snapshot_id, nats_url=url)
            if args.json:
                print(json.dumps(asdict(i)))
            else:
                for k, v in asdict(i).items():
                    print(f"{k:<12} {v}")
        else:
            rc = 0
            for sid in args.snapshot_ids:
                try:
                    print(await AsyncSandbox.delete_snapshot(sid, nats_url=url))
                except DsecError as exc:
                    print(f"dsec: {exc}", file=sys.stderr)
                    rc = 1
            return rc
        return 0
    finally:
        await close_connections()
