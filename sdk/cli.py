"""The ``dsec`` command line. Services add their own subcommands through the ``dsec.cli`` entry-point group."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shlex
import socket
import sys
import time
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from bus import subjects as S
from bus.errors import DsecError, Unavailable
from bus.messages import TenantLimits

# Subcommands that talk to a running stack: told within seconds when it is not there (status says it its own way).
_STACK_COMMANDS = {"sandbox", "audit", "image", "trajectory"}


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, default=lambda o: o.__dict__ if hasattr(o, "__dict__") else str(o)))


def _context_in_use(args: argparse.Namespace) -> Any:
    """The client context `dsec up` wrote, unless --nats-url or $DSEC_NATS_URL says where to go instead."""
    from bus.auth import load_client_context

    if getattr(args, "nats_url", None) or os.environ.get("DSEC_NATS_URL"):
        return None
    return load_client_context()


# --- status ------------------------------------------------------------------------------
def _services(args: argparse.Namespace) -> list[dict[str, Any]] | None:
    """What the `dsec up` supervisor of this stack says about its processes (None: no supervisor here)."""
    from ._up import SERVICES_FILE

    data_dir = args.data_dir
    if data_dir is None:
        ctx = _context_in_use(args)
        data_dir = ctx.data_dir if ctx else None
    if not data_dir:
        return None
    try:
        view = json.loads((Path(data_dir) / SERVICES_FILE).read_text())
        os.kill(int(view["supervisor_pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None  # no view, or its supervisor is gone: nothing current to say
    services: list[dict[str, Any]] | None = view.get("services")
    return services


def _print_services(services: list[dict[str, Any]]) -> None:
    from ._up import exit_text

    now = time.time()
    for s in services:
        up = f"up {now - s['up_since']:.0f}s" if s.get("up_since") else s["state"]
        last = f" last exit {exit_text(s['last_exit'])}" if s.get("last_exit") is not None else ""
        print(f"  {s['name']:<24} {s['state']:<8} pid={s.get('pid') or '-':<8} restarts={s['restarts']:<3} {up}{last}")


async def _status(args: argparse.Namespace) -> int:
    from bus.auth import redact_url

    from ._admin import cluster_status

    services = _services(args)
    try:
        _probe(args.nats_url, min(2.0, args.timeout))
        st = await cluster_status(args.nats_url, timeout=args.timeout)
    except DsecError as exc:
        if args.json:
            _print_json({"ok": False, "error": exc.code, "description": exc.description, "services": services})
        else:
            print(f"dsec: {exc.description}", file=sys.stderr)
            if services:
                _print_services(services)
        return 1
    ok = st["ready_hosts"] > 0
    st["ok"] = ok
    st["nats_url"] = redact_url(st["nats_url"])
    st["services"] = services
    if args.json:
        _print_json(st)
    else:
        templates = ", ".join(st["templates"]) or "-"
        print(f"nats: {st['nats_url']}  hosts ready: {st['ready_hosts']}/{len(st['hosts'])}  templates: {templates}  sandboxes: {st['sandboxes']}")
        for h in st["hosts"]:
            print(
                f"  {h['host_id']:<24} {h['state']:<8} {h['backend']:<10} sandboxes={h['sandboxes']} "
                f"cpu={h['cpu_alloc']:.1f}/{h['cpu_total']:.0f}x{h['cpu_overcommit']:.0f} mem={h['mem_alloc_mb']}/{h['mem_total_mb']}MB "
                f"disk free={h.get('disk_free_mb', 0)}/{h['disk_total_mb']}MB age={h['age_s']:.1f}s"
            )
            for b in h.get("backends") or []:  # what each backend's probe found (a microvm host: accel=kvm|tcg)
                if b.get("detail"):
                    print(f"    {b['name']}: " + " ".join(f"{k}={v}" for k, v in sorted(b["detail"].items())))
        if st.get("storage"):
            _print_storage(st["storage"])
        if services:
            print("services (dsec up):")
            _print_services(services)
    return 0 if ok else 1


def _print_storage(use: dict[str, Any]) -> None:
    def lim(v: int) -> str:
        return str(v) if v else "no limit"

    limits = use["limits"]
    print(f"snapshots: {use['snapshots']}, {use['snapshot_bytes']} bytes in the blob store "
          f"(per sandbox: {lim(limits.get('snapshot_bytes_per_sandbox', 0))})")
    for t, u in use["tenants"].items():
        print(f"  tenant {t or '(operator)':<24} {u['used_bytes']}/{lim(u['limit_bytes'])} bytes")
    uploads = use.get("uploads") or {}
    if uploads:
        print(f"uploads (per tenant on each host: {lim(limits.get('upload_bytes_per_tenant', 0))}):")
        for host, by in uploads.items():
            for t, b in by.items():
                print(f"  {host:<24} tenant {t:<24} {b} bytes")


# --- sandbox -----------------------------------------------------------------------------
def _sandbox(args: argparse.Namespace) -> int:
    from . import Sandbox
    from ._sync import _run
    from ._async import close_connections

    kw = {"nats_url": args.nats_url} if args.nats_url else {}
    try:
        if args.sbx_cmd == "create":
            if any("=" not in e for e in args.env or []):
                print(f"dsec: --env takes K=V, got {[e for e in args.env if '=' not in e]}", file=sys.stderr)
                return 2
            envs = dict(e.split("=", 1) for e in args.env or [])
            sb = Sandbox.create(
                args.template, backend=args.backend, cpu=args.cpu, memory_mb=args.memory_mb, disk_mb=args.disk_mb, timeout=args.timeout,
                envs=envs, pool=args.pool, **kw,
            )
            if args.json:
                _print_json({"sandbox_id": sb.sandbox_id, "host_id": sb.host_id})
            else:
                print(sb.sandbox_id)
        elif args.sbx_cmd == "exec":
            from .errors import CommandExitError

            sb = Sandbox.connect(args.sandbox_id, **kw)
            # One argument is a shell command line; several are an argv, quoted so the shell keeps them apart.
            cmd = shlex.join(args.command) if len(args.command) > 1 else args.command[0]
            # Streamed as it comes (output of any size); the result itself need not carry it again.
            try:
                r = sb.commands.run(
                    cmd, timeout=args.timeout, cwd=args.cwd, on_stdout=sys.stdout.write, on_stderr=sys.stderr.write, output_cap=0,
                )
            except CommandExitError as exc:
                r = exc.result
            finally:
                sys.stdout.flush()
            code: int = r.exit_code
            return code
        elif args.sbx_cmd == "ls":
            items = Sandbox.list(**kw)
            if args.memory:
                _run(_memory_of(items, args.nats_url))
            if args.json:
                _print_json([i.__dict__ for i in items])
            else:
                for i in items:
                    left = max(0, i.expires_at - time.time())
                    mem = (f"  mem {i.mem_resident_bytes >> 20}M reclaimed {i.mem_reclaimed_bytes >> 20}M merged {i.mem_merged_bytes >> 20}M"
                           if args.memory else "")
                    print(f"{i.sandbox_id}  {i.template:<10} {i.host_id:<20} {i.state:<8} {i.cpu_class:<17} expires in {left:.0f}s{mem}")
        elif args.sbx_cmd == "kill":
            for sid in args.sandbox_ids:
                _run(_kill(sid, args.nats_url))
        return 0
    except DsecError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 1
    finally:
        _run(close_connections())


async def _memory_of(items: list[Any], url: str | None) -> None:
    """Fill each listed sandbox's memory figures from its host (what the reclaim service reported)."""
    from ._async import AsyncSandbox, _nc

    nc = await _nc(url)

    async def one(i: Any) -> None:
        try:
            info = await AsyncSandbox(i.sandbox_id, nc).get_info()
        except DsecError:
            return  # ended meanwhile: listed without figures
        i.mem_resident_bytes, i.mem_reclaimed_bytes, i.mem_merged_bytes = info.mem_resident_bytes, info.mem_reclaimed_bytes, info.mem_merged_bytes

    await asyncio.gather(*(one(i) for i in items))


async def _kill(sid: str, url: str | None) -> None:
    from ._async import AsyncSandbox, _nc

    await AsyncSandbox(sid, await _nc(url)).kill()


# --- audit ------------------------------------------------------------------------------
async def _audit(args: argparse.Namespace) -> int:
    from ._admin import replay_events

    n = 0
    try:
        async for ev in replay_events(args.nats_url, since=args.since, sandbox_id=args.sandbox, kinds=args.kind):
            n += 1
            if args.json:
                _print_json(ev)
            else:
                at = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ev["at"])) + f".{int(ev['at'] * 1000) % 1000:03d}Z"
                who = ev.get("sandbox_id") or ev.get("host_id") or ev.get("name", "")
                extra = " ".join(f"{k}={v}" for k, v in ev.items() if k not in ("type", "at", "sandbox_id", "kind", "seq", "subject") and v not in ("", {}, 0))
                print(f"{ev['seq']:>8} {at} {ev['type']:<14} {ev['kind']:<10} {who} {extra}")
    except DsecError as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 1
    if not args.json:
        print(f"({n} events)", file=sys.stderr)
    return 0


# --- trajectory --------------------------------------------------------------------------------
async def _trajectory(args: argparse.Namespace) -> int:
    from . import _trajectory as _traj
    from ._async import _js, _nc, close_connections

    if not S.valid_token(args.sandbox_id):
        print(f"dsec: not a sandbox id: {args.sandbox_id!r}", file=sys.stderr)
        return 2
    if args.traj_cmd == "replay":
        return await _trajectory_replay(args)
    try:
        steps = await _traj.steps(_js(await _nc(args.nats_url)), args.sandbox_id)
    finally:
        await close_connections()
    if args.json:
        _print_json([s.to_dict() for s in steps])
        return 0
    for s in steps:
        what = getattr(s.request, "cmd", None) or getattr(s.request, "path", "") or ""
        if s.op == "model" and isinstance(s.result, dict):  # a policy's turn: what it said
            what = json.dumps(((s.result.get("choices") or [{}])[0] or {}).get("message"))
        if s.error_code:
            out = f"error {s.error_code}"
        elif s.result is not None and hasattr(s.result, "exit_code"):
            out = f"exit {s.result.exit_code}"
        else:
            out = "ok"
        print(f"{s.seq:>8} {s.client_id:<24} {s.step:>5} {s.kind:<14} {s.duration_ms:>9.1f}ms {out:<22} {what!s:.80}")
    print(f"({len(steps)} steps)", file=sys.stderr)
    return 0


async def _trajectory_replay(args: argparse.Namespace) -> int:
    from . import _trajectory as _traj
    from ._async import close_connections

    kw = {"pool": args.pool} if args.pool else {}
    try:
        diffs = await _traj.replay_in_fresh(args.sandbox_id, nats_url=args.nats_url, template=args.template, **kw)
    finally:
        await close_connections()
    if args.json:
        _print_json([d.__dict__ for d in diffs])
    else:
        for d in diffs:
            print(f"{d.index:>5} {d.client_id:<24} {d.step:>5} {d.kind:<14} {d.status:<8} {d.detail}")
    differ = sum(d.status == "differs" for d in diffs)
    print(f"({len(diffs)} steps, {differ} differ, {sum(d.status == 'skipped' for d in diffs)} skipped)", file=sys.stderr)
    return 1 if differ else 0


# --- api keys and schema ----------------------------------------------------------------------
async def _api_key(args: argparse.Namespace) -> int:
    from pathlib import Path

    from bus.auth import load_client_context

    from .gateway._keys import (
        create_api_key, default_limits, describe_limits, kill_tenant_sandboxes, list_api_keys, revoke_api_key, set_default_limits, set_key_limits,
        wait_usable,
    )

    ctx = load_client_context()
    data_dir = args.data_dir or (ctx.data_dir if ctx and ctx.data_dir else "/var/lib/dsec")
    auth_file = Path(data_dir) / "auth.json"
    try:
        if args.key_cmd == "ls":
            keys = list_api_keys(auth_file)
            if args.json:
                _print_json(keys)
                return 0
            for k in keys:
                lim = k["limits"]
                print(f"{k['name']:<24} {k['user']:<28} {k['created']:<21} {describe_limits(None if lim is None else TenantLimits(**lim))}")
            print(f"(defaults: {describe_limits(default_limits(auth_file) or TenantLimits()).replace('unlimited', 'none')})", file=sys.stderr)
            return 0
        if args.key_cmd == "revoke":
            users = revoke_api_key(auth_file, args.name)
            if not users:
                print(f"dsec: no API key named {args.name!r}", file=sys.stderr)
                return 1
            for u in users:
                killed = await kill_tenant_sandboxes(u, args.nats_url) if args.kill_sandboxes else []
                print(f"revoked {u}" + (f"; killed {len(killed)} sandbox(es)" if args.kill_sandboxes else "; its sandboxes keep running"))
            return 0  # its quota record, if any, goes at the next sync: nobody can create as it any more
        if args.key_cmd == "limits":
            users = set_key_limits(auth_file, args.name, _limits_arg(args))
            if not users:
                print(f"dsec: no API key named {args.name!r}", file=sys.stderr)
                return 1
            return await _sync_limits(auth_file, args.nats_url)
        if args.key_cmd == "defaults":
            set_default_limits(auth_file, None if args.clear else _limits_arg(args) or TenantLimits())
            return await _sync_limits(auth_file, args.nats_url)
        limits = _limits_arg(args)
        key = create_api_key(auth_file, args.name_pos or args.name, limits)
    except (ValueError, FileNotFoundError) as exc:
        print(f"dsec: {exc}", file=sys.stderr)
        return 2
    print(key)
    if not await wait_usable(key, args.nats_url):
        print("dsec: the key is saved, but NATS does not accept it yet; is `dsec up` running on this data dir?", file=sys.stderr)
        return 0
    # A key without quotas of its own has no record (the defaults apply): nothing to write.
    return 0 if limits is None else await _sync_limits(auth_file, args.nats_url)


def _limits_arg(args: argparse.Namespace) -> TenantLimits | None:
    """The quotas the flags give (None: none given, the defaults apply; --unlimited: none at all)."""
    if getattr(args, "unlimited", False):
        return TenantLimits()
    given = {f: getattr(args, f) for f in ("max_sandboxes", "max_cpu", "max_memory_mb") if getattr(args, f, None) is not None}
    return TenantLimits(**given) if given else None


async def _sync_limits(auth_file: Any, nats_url: str | None) -> int:
    """Have placement see the auth file's quotas (KV dsec_tenants, written as the operator)."""
    from .gateway._keys import sync_limits

    try:
        await sync_limits(auth_file, nats_url)
    except Exception as exc:  # noqa: BLE001 - NATS away, or not the operator's credential: said in one line
        why = exc.description if isinstance(exc, DsecError) else repr(exc)
        print(f"dsec: the quotas are saved, but could not be written to NATS as the operator ({why}); is `dsec up` running on this data dir?", file=sys.stderr)
        return 1
    return 0


def _limit_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-sandboxes", type=int, default=None, help="live sandboxes at once (0: no limit; none of these flags: the defaults)")
    p.add_argument("--max-cpu", type=float, default=None, help="the sum of their cpu (0: no limit)")
    p.add_argument("--max-memory-mb", type=int, default=None, help="the sum of their memory in MB (0: no limit)")
    p.add_argument("--unlimited", action="store_true", help="no quotas, whatever the defaults")


def _schema(args: argparse.Namespace) -> int:
    from bus.schema import asyncapi, subject_schemas

    if args.asyncapi:
        _print_json(asyncapi())
        return 0
    schemas = subject_schemas()
    if args.subject:
        if args.subject not in schemas:
            print(f"dsec: no subject {args.subject!r}; one of: {', '.join(sorted(schemas))}", file=sys.stderr)
            return 2
        schemas = {args.subject: schemas[args.subject]}
    print(json.dumps(schemas, indent=2))
    return 0


# --- up ------------------------------------------------------------------------------------
def _up(args: argparse.Namespace) -> int:
    from ._up import run_up

    return run_up(args)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="dsec", description="dsec: sandboxes for training and evaluating AI agents")
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    sub = ap.add_subparsers(dest="cmd", required=True)

    up = sub.add_parser("up", help="start the whole dev stack in the foreground (Ctrl-C stops it)")
    up.add_argument("--data-dir", default="/var/lib/dsec")
    up.add_argument("--port", type=int, default=4222, help="NATS client port (with --cluster N: the first node's; node i listens on port+i)")
    up.add_argument("--cluster", type=int, default=1, choices=[1, 3, 5],
                    help="NATS nodes: 3 or 5 run a JetStream cluster on loopback, every stream and bucket replicated on 3 (docs/scale.md)")
    up.add_argument("--cluster-port", type=int, default=6222, help="with --cluster N: the first node's route port; node i uses cluster-port+i")
    up.add_argument("--host-id", default=None)
    up.add_argument("--backend", default="container", choices=["container", "sim"])
    up.add_argument("--concurrency", type=int, default=8)
    up.add_argument("--placement-replicas", type=int, default=1)
    up.add_argument("--reclaim", default="on", choices=["on", "off"], help="run the memory reclaim service (hostagent.reclaim)")
    up.add_argument("--ready-timeout", type=float, default=300.0)
    up.add_argument("--no-auth", action="store_true", help="run NATS without authentication (tests only)")
    up.add_argument("--http-port", type=int, default=3000, help="the HTTP gateway's port (E2B API, envd, REST)")
    up.add_argument("--hosts", type=int, default=0, help="run N hosts, each in a network namespace of its own behind a veth "
                    "(its own agent, lazy loader, containerd, data dir <data-dir>/hosts/<i> and host id <host-id>-<i>); 0: one host on this machine's network")
    up.add_argument("--hosts-net", default="10.199.0.0/16", help="with --hosts: a /24 per host for its sandboxes, the last /24 for the links")
    up.add_argument("--hosts-prefix", default="dsh", help="with --hosts: names the hosts' netns, links and kernel objects (2-5 of [a-z0-9], starting ds)")
    up.add_argument("--host-down", type=float, default=60.0, help="seconds without a heartbeat before placement marks a host down and its sandboxes lost")
    up.add_argument("--fn-pool", default="", help="FnCall warm pools on the host, <template>=<members>,... e.g. base=8,python=8 (default: none)")
    up.add_argument("--context", default=None, help="where to point clients at this stack (default: $DSEC_CONTEXT, else /run/dsec/context.json as root)")
    up.set_defaults(func=_up)

    st = sub.add_parser("status", help="exit 0 when the stack answers and at least one host is ready")
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0)
    st.add_argument("--data-dir", default=None, help="a `dsec up` data dir whose services to show (default: the client context's)")
    st.set_defaults(func=lambda a: asyncio.run(_status(a)))

    sb = sub.add_parser("sandbox", help="create, exec in, list and kill sandboxes")
    sbs = sb.add_subparsers(dest="sbx_cmd", required=True)
    c = sbs.add_parser("create")
    c.add_argument("--template", default="base")
    c.add_argument("--backend", default="container")
    c.add_argument("--cpu", type=float, default=1.0)
    c.add_argument("--memory-mb", type=int, default=512)
    c.add_argument("--disk-mb", type=int, default=1024)
    c.add_argument("--timeout", type=float, default=300)
    c.add_argument("--env", action="append", metavar="K=V")
    c.add_argument("--pool", default="default", help="the pool of hosts to place it in")
    c.add_argument("--json", action="store_true")
    e = sbs.add_parser("exec")
    e.add_argument("sandbox_id")
    e.add_argument("command", nargs="+")
    e.add_argument("--timeout", type=float, default=60)
    e.add_argument("--cwd", default=None)
    ls = sbs.add_parser("ls")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--memory", action="store_true", help="ask each sandbox's host for its memory (resident, reclaimed, merged)")
    k = sbs.add_parser("kill")
    k.add_argument("sandbox_ids", nargs="+")
    sb.set_defaults(func=_sandbox)

    au = sub.add_parser("audit", help="read the event stream kept for audit")
    aus = au.add_subparsers(dest="audit_cmd", required=True)
    r = aus.add_parser("replay", help="replay events by time, optionally for one sandbox")
    r.add_argument("--since", default=None, help="ISO time, unix seconds, or an age like 10m, 2h, 1d (default: everything)")
    r.add_argument("--sandbox", default=None)
    r.add_argument("--kind", action="append", help="only these event kinds (repeatable)")
    r.add_argument("--json", action="store_true")
    r.set_defaults(func=lambda a: asyncio.run(_audit(a)))

    ak = sub.add_parser("api-key", help="API keys of the HTTP gateway (each its own NATS identity)")
    aks = ak.add_subparsers(dest="key_cmd", required=True)
    akc = aks.add_parser("create", help="print a new API key")
    akc.add_argument("name_pos", nargs="?", metavar="NAME", help="a label (as --name)")
    akc.add_argument("--name", default="key", help="a label, part of the key's NATS user name")
    akc.add_argument("--data-dir", default=None, help="the data dir of `dsec up` (its auth.json; default: the client context's, else /var/lib/dsec)")
    _limit_flags(akc)
    akc.set_defaults(func=lambda a: asyncio.run(_api_key(a)))
    akq = aks.add_parser("limits", help="set the quotas of an API key (no flags: back to the defaults)")
    akq.add_argument("name", help="the key's name (as created), its NATS user or key id")
    akq.add_argument("--data-dir", default=None, help="the data dir of `dsec up` (as for create)")
    _limit_flags(akq)
    akq.set_defaults(func=lambda a: asyncio.run(_api_key(a)))
    akd = aks.add_parser("defaults", help="the quotas of every API key without its own")
    akd.add_argument("--data-dir", default=None, help="the data dir of `dsec up` (as for create)")
    akd.add_argument("--clear", action="store_true", help="no default quotas")
    _limit_flags(akd)
    akd.set_defaults(func=lambda a: asyncio.run(_api_key(a)))
    akl = aks.add_parser("ls", help="list the API keys (names, NATS users, creation times; never secrets)")
    akl.add_argument("--data-dir", default=None, help="the data dir of `dsec up` (as for create)")
    akl.add_argument("--json", action="store_true")
    akl.set_defaults(func=lambda a: asyncio.run(_api_key(a)))
    akr = aks.add_parser("revoke", help="revoke an API key: NATS refuses it within seconds (on the bus and through the gateway)")
    akr.add_argument("name", help="the key's name (as created), its NATS user or key id")
    akr.add_argument("--data-dir", default=None, help="the data dir of `dsec up` (as for create)")
    akr.add_argument("--kill-sandboxes", action="store_true", help="also kill the key's live sandboxes (default: they keep running)")
    akr.set_defaults(func=lambda a: asyncio.run(_api_key(a)))

    tr = sub.add_parser("trajectory", help="the trajectory log of a sandbox (every logged operation, in order)")
    trs = tr.add_subparsers(dest="traj_cmd", required=True)
    trs_show = trs.add_parser("show", help="print the logged steps")
    trs_show.add_argument("sandbox_id")
    trs_show.add_argument("--json", action="store_true")
    trs_show.set_defaults(func=lambda a: asyncio.run(_trajectory(a)))
    trs_replay = trs.add_parser("replay", help="run the logged steps again in a fresh sandbox of the same template; exit 1 where results differ")
    trs_replay.add_argument("sandbox_id")
    trs_replay.add_argument("--template", default=None, help="default: the sandbox's own (from its record)")
    trs_replay.add_argument("--pool", default=None)
    trs_replay.add_argument("--json", action="store_true")
    trs_replay.set_defaults(func=lambda a: asyncio.run(_trajectory(a)))

    sc = sub.add_parser("schema", help="JSON Schema of every subject's messages, or an AsyncAPI document")
    sc.add_argument("--subject", default=None, help="only this subject (a name from `dsec schema`, e.g. dsec.req.create)")
    sc.add_argument("--asyncapi", action="store_true", help="an AsyncAPI 3 document: subjects, streams, replies")
    sc.set_defaults(func=_schema)

    for ep in entry_points(group="dsec.cli"):
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the CLI
            print(f"dsec: plugin {ep.name!r} failed to load: {exc}", file=sys.stderr)
    return ap


def _probe(url: str | None, timeout: float = 2.0) -> None:
    """Raise Unavailable unless some server of the URL accepts a TCP connection within ``timeout``:
    a client's own connect retries for longer than anyone should wait to hear the stack is down."""
    from urllib.parse import urlsplit

    from bus.auth import redact_url
    from bus.runtime import nats_url

    servers = nats_url(url).split(",")
    why = ""
    for u in servers:
        parts = urlsplit(u if "://" in u else f"nats://{u}")
        try:
            socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 4222), timeout=timeout).close()
            return
        except OSError as exc:
            why = exc.strerror or str(exc) or type(exc).__name__
    raise Unavailable(f"cannot reach NATS at {redact_url(','.join(servers))} ({why}): is `dsec up` running?")


class _NatsErrors(logging.Handler):
    """Keeps the connection errors bus.runtime logs (one per -ERR) instead of printing them: a denied
    publish reaches the caller only as a timeout, so the denial is what the CLI's one line says."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.denied: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "permissions violation" in msg.lower() and self.denied is None:
            self.denied = msg.split("nats: ", 2)[-1]


def _one_line(exc: BaseException, denied: str | None = None) -> str:
    """An expected failure as the one line the CLI prints."""
    import nats.errors

    if isinstance(exc, DsecError):
        return str(exc)
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if denied and isinstance(exc, nats.errors.TimeoutError):
        text = denied
    if "permissions violation" in text.lower():
        return (f"not allowed: {text} (this NATS user may not do that; the operator's context that `dsec up` writes may,"
                " or set DSEC_NATS_URL with such a user)")
    if isinstance(exc, nats.errors.TimeoutError):
        return f"timeout: NATS did not answer in time ({text})"
    return f"NATS: {text}"


def main(argv: list[str] | None = None) -> None:
    import nats.errors
    import nats.js.errors

    args = build_parser().parse_args(argv)
    if getattr(args, "dockerfile", None):  # `image build --dockerfile`: imaged's CLI declares it, the build is client-side
        from ._builder import cli_build

        args.func = cli_build
    ctx = _context_in_use(args)
    if ctx is not None and ctx.data_dir:
        # Local state of client-side work (image build caches) goes where that stack keeps its own.
        os.environ.setdefault("DSEC_DATA_DIR", ctx.data_dir)
    errors = _NatsErrors()
    nats_log = logging.getLogger("dsec.nats")
    nats_log.addHandler(errors)
    nats_log.propagate = False
    try:
        if args.cmd in _STACK_COMMANDS:
            _probe(args.nats_url)
        rc = args.func(args)
    except KeyboardInterrupt:
        rc = 130
    except (DsecError, nats.errors.Error, nats.js.errors.Error) as exc:
        print(f"dsec: {_one_line(exc, errors.denied)}", file=sys.stderr)
        rc = 1
    sys.exit(rc or 0)


if __name__ == "__main__":
    main()
