"""``dsec image ...``: registered into the ``dsec`` command through the ``dsec.cli`` entry-point group.

    dsec image build NAME --base SRC [--workspace SRC] [--toolkit SRC] [--json]
    dsec image build NAME --from REF [--platform OS/ARCH] [--json]   (an image in a registry; mirrors: $DSEC_REGISTRY_MIRRORS)
    dsec image build NAME --dockerfile PATH [--context DIR] [--build-arg K=V] [--no-cache] [--allow-out HOST]
    dsec image build-python [NAME] [--json]      (debian bookworm + python3, pip, git; default name "python")
    dsec image ensure-base [--json]              (the busybox "base" template, idempotent)
    dsec image ls [--json]
    dsec image show NAME                         (the manifest, as JSON)
    dsec image rm NAME... [--prune]
    dsec image stats NAME [--json] [--host-id H]
    dsec gc [--data-dir D] [--grace S] [--json]  (layers, chunks and local leftovers nothing references)

SRC is a directory, a tarball, an OCI image layout directory (``DIR`` or ``DIR:ref``), ``layer:<digest>``
or ``template:<name>``. Also runnable alone: ``python -m imaged.cli image ls``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import msgspec

from bus.errors import DsecError, InvalidArgument
from bus.runtime import connect

from ._util import DEFAULT_CHUNK_SIZE


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, sort_keys=False, default=str))


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data-dir", default=None, help="default: $DSEC_DATA_DIR or /var/lib/dsec")
    p.add_argument("--blob-store", default=None, help="default: $DSEC_BLOB_STORE or nats (s3://bucket[/prefix])")
    if not any(a.dest == "nats_url" for a in p._actions):
        p.add_argument("--nats-url", default=argparse.SUPPRESS, help="default: $DSEC_NATS_URL")


def register(subparsers: Any) -> None:
    """Add ``image`` and its subcommands to the ``dsec`` argparse sub-parsers."""
    img = subparsers.add_parser("image", help="build, list, inspect and remove image templates")
    isub = img.add_subparsers(dest="image_cmd", required=True)

    b = isub.add_parser("build", help="build a template from base [+ workspace] [+ toolkit] sources, or from an image in a registry")
    b.add_argument("name")
    src = b.add_mutually_exclusive_group(required=True)
    src.add_argument("--base", metavar="SRC")
    src.add_argument("--from", dest="from_ref", metavar="REF", help="an image in a registry: [host/]repo[:tag][@sha256:...]")
    # A Dockerfile build is a client of the stack (build sandboxes, snapshots): the `dsec` command runs it (sdk._builder).
    src.add_argument("--dockerfile", default=None, metavar="PATH", help="build from a Dockerfile (RUN steps run in a build sandbox)")
    b.add_argument("--context", default=None, metavar="DIR", help="of --dockerfile: where COPY/ADD read (default: the Dockerfile's directory)")
    b.add_argument("--build-arg", action="append", default=[], metavar="K=V")
    b.add_argument("--no-cache", action="store_true", help="of --dockerfile: run every step again")
    b.add_argument("--allow-out", action="append", default=[], metavar="HOST", help="of --dockerfile: egress RUN may use (package mirrors)")
    b.add_argument("--platform", default="", help="of --from: os/arch[/variant] (default: this machine's)")
    b.add_argument("--workspace", default=None, metavar="SRC")
    b.add_argument("--toolkit", default=None, metavar="SRC")
    b.add_argument("--description", default="")
    b.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    b.add_argument("--compress", default=None, help="mkfs.erofs compressor, e.g. lz4hc (default: none)")
    b.add_argument("--json", action="store_true")
    _add_common(b)
    b.set_defaults(func=_sync(_build))

    bp = isub.add_parser("build-python", help="build the Python template (debootstrap bookworm + python3, pip, git)")
    bp.add_argument("name", nargs="?", default="python")
    bp.add_argument("--suite", default="bookworm")
    bp.add_argument("--mirror", default="http://deb.debian.org/debian")
    bp.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    bp.add_argument("--json", action="store_true")
    _add_common(bp)
    bp.set_defaults(func=_sync(_build_python))

    eb = isub.add_parser("ensure-base", help="build the busybox 'base' template unless it is there")
    eb.add_argument("--json", action="store_true")
    _add_common(eb)
    eb.set_defaults(func=_sync(_ensure_base))

    ls = isub.add_parser("ls", help="list templates")
    ls.add_argument("--json", action="store_true")
    _add_common(ls)
    ls.set_defaults(func=_sync(_ls))

    sh = isub.add_parser("show", help="print a template's manifest as JSON")
    sh.add_argument("name")
    _add_common(sh)
    sh.set_defaults(func=_sync(_show))

    rm = isub.add_parser("rm", help="remove templates")
    rm.add_argument("names", nargs="+")
    rm.add_argument("--prune", action="store_true", help="also delete layers and chunks nothing references any more")
    rm.add_argument("--json", action="store_true")
    _add_common(rm)
    rm.set_defaults(func=_sync(_rm))

    st = isub.add_parser("stats", help="how much of a template this host has fetched")
    st.add_argument("name")
    st.add_argument("--host-id", default=None, help="default: $DSEC_HOST_ID or the hostname")
    st.add_argument("--timeout", type=float, default=2.0)
    st.add_argument("--json", action="store_true")
    _add_common(st)
    st.set_defaults(func=_sync(_stats))

    gc = subparsers.add_parser("gc", help="collect the blob store's unreferenced layers and chunks, and this host's data-dir leftovers")
    gc.add_argument("--grace", type=float, default=None, help="seconds a data-dir leftover must be old to go (default 3600)")
    gc.add_argument("--json", action="store_true")
    _add_common(gc)
    gc.set_defaults(func=_sync(_gc))


def _sync(fn: Any) -> Any:
    def run(args: argparse.Namespace) -> int:
        try:
            rc: int = asyncio.run(fn(args))
            return rc
        except DsecError as exc:
            print(f"dsec: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


async def _js(args: argparse.Namespace) -> tuple[Any, Any]:
    nc = await connect(getattr(args, "nats_url", None), name="dsec-image-cli", connect_attempts=3, connect_timeout_s=5.0)
    return nc, nc.jetstream()


def _store(js: Any, args: argparse.Namespace) -> Any:
    from ._store import open_blob_store

    return open_blob_store(js, args.blob_store)


async def _build(args: argparse.Namespace) -> int:
    from ._build import ImageBuilder
    from ._progress import TtyProgress

    nc, js = await _js(args)
    progress = TtyProgress()
    store = _store(js, args)
    try:
        builder = ImageBuilder(
            js, args.data_dir, store=store, chunk_size=args.chunk_size, compress=args.compress, progress=progress
        )
        if args.dockerfile:
            raise InvalidArgument("--dockerfile builds run in the `dsec` command (they are a client of the stack)")
        if args.from_ref:
            from ._oci import build_from_image

            if args.workspace or args.toolkit:
                raise InvalidArgument("--from builds the whole template: no --workspace/--toolkit with it")
            result, _ = await build_from_image(builder, args.name, args.from_ref, platform=args.platform, description=args.description)
        else:
            result = await builder.build_template(args.name, args.base, args.workspace, args.toolkit, description=args.description)
    finally:
        progress.close()
        await store.close()
        await nc.close()
    _report_build(result, args.json)
    return 0


def _report_build(result: Any, as_json: bool) -> None:
    if as_json:
        _print_json(result.as_json())
        return
    print(f"template {result.manifest.name}: {len(result.layers)} layer(s), {result.seconds:.1f}s")
    for lb in result.layers:
        what = "built" if lb.built else "reused"
        print(f"  {lb.ref.role:<9} {lb.ref.digest[:19]}  {_human(lb.ref.size):>10}  {what:<6}  uploaded {_human(lb.uploaded_bytes)}")
    print(f"uploaded {_human(result.uploaded_bytes)}")


async def _build_python(args: argparse.Namespace) -> int:
    from ._debootstrap import build_python_template
    from ._progress import TtyProgress

    nc, js = await _js(args)
    progress = TtyProgress()
    store = _store(js, args)
    try:
        result = await build_python_template(
            js, args.data_dir, args.name, suite=args.suite, mirror=args.mirror, progress=progress,
            store=store, chunk_size=args.chunk_size,
        )
    finally:
        progress.close()
        await store.close()
        await nc.close()
    _report_build(result, args.json)
    return 0


async def _ensure_base(args: argparse.Namespace) -> int:
    from ._build import ensure_base_template

    nc, js = await _js(args)
    store = _store(js, args)
    try:
        m = await ensure_base_template(js, args.data_dir, store=store)
    finally:
        await store.close()
        await nc.close()
    if args.json:
        _print_json(msgspec.to_builtins(m))
    else:
        for lay in m.layers:
            print(f"{m.name}: {lay.role} {lay.digest} {_human(lay.size)} {lay.path}")
    return 0


async def _ls(args: argparse.Namespace) -> int:
    from ._manifests import list_manifests

    nc, js = await _js(args)
    try:
        ms = await list_manifests(js)
    finally:
        await nc.close()
    if args.json:
        _print_json(
            [
                {
                    "name": m.name,
                    "created_at": m.created_at,
                    "description": m.description,
                    "total_bytes": sum(lay.size for lay in m.layers),
                    "layers": [{"role": lay.role, "digest": lay.digest, "size": lay.size} for lay in m.layers],
                }
                for m in ms
            ]
        )
        return 0
    if not ms:
        print("(no templates)", file=sys.stderr)
        return 0
    print(f"{'NAME':<24} {'SIZE':>10}  {'CREATED':<20} LAYERS")
    for m in ms:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.created_at)) if m.created_at else "-"
        layers = " ".join(f"{lay.role}:{lay.digest[7:19]}" for lay in m.layers)
        print(f"{m.name:<24} {_human(sum(lay.size for lay in m.layers)):>10}  {created:<20} {layers}")
    return 0


async def _show(args: argparse.Namespace) -> int:
    from ._manifests import require_manifest

    nc, js = await _js(args)
    try:
        m = await require_manifest(js, args.name)
    finally:
        await nc.close()
    _print_json(msgspec.to_builtins(m))
    return 0


async def _rm(args: argparse.Namespace) -> int:
    from ._build import prune_unreferenced, remove_template

    nc, js = await _js(args)
    store = _store(js, args)
    rc = 0
    removed: list[str] = []
    try:
        for name in args.names:
            try:
                await remove_template(js, name)
                removed.append(name)
            except DsecError as exc:
                print(f"dsec: {exc}", file=sys.stderr)
                rc = 1
        pruned = await prune_unreferenced(js, store=store, data_dir=args.data_dir) if args.prune else {}
    finally:
        await store.close()
        await nc.close()
    if args.json:
        _print_json({"removed": removed, "pruned": pruned})
    else:
        for name in removed:
            print(f"removed {name}")
        if pruned:
            print(f"pruned {pruned['layers']} layer(s), {pruned['chunks']} chunk(s), {pruned['blobs']} local blob(s)")
    return rc


async def _gc(args: argparse.Namespace) -> int:
    from ._gc import LOCAL_GRACE_S, collect
    from ._util import data_dir

    nc, js = await _js(args)
    store = _store(js, args)
    try:
        out = await collect(js, store, data_dir=data_dir(args.data_dir), local_grace_s=LOCAL_GRACE_S if args.grace is None else args.grace)
    finally:
        await store.close()
        await nc.close()
    if args.json:
        _print_json(out)
    else:
        print(f"collected {out['layers']} layer(s), {out['chunks']} chunk(s), {out['local_files']} local leftover(s) "
              f"({_human(out['local_bytes'])}) in {out['ms']} ms")
    return 0


async def _stats(args: argparse.Namespace) -> int:
    from ._stats import template_stats

    nc, js = await _js(args)
    try:
        st = await template_stats(js, args.name, host_id=args.host_id, data_dir=args.data_dir, timeout=args.timeout)
    finally:
        await nc.close()
    if args.json:
        _print_json(st)
        return 0
    print(
        f"{st['name']} on {st['host_id']}: fetched {_human(st['fetched_bytes'])} of {_human(st['total_bytes'])}"
        f" ({100 * st['fetched_ratio']:.1f}%, from {st['source']})"
    )
    for lay in st["layers"]:
        print(f"  {lay['role']:<9} {lay['digest'][:19]}  {_human(lay['fetched_bytes']):>10} / {_human(lay['total_bytes'])}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m imaged.cli")
    ap.add_argument("--nats-url", default=None, help="default: $DSEC_NATS_URL or nats://127.0.0.1:4222")
    sub = ap.add_subparsers(dest="cmd", required=True)
    register(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
