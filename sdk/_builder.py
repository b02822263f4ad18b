"""Building templates from steps (a Dockerfile's, or E2B's template API's), client-side.

Like any client, the builder creates a build sandbox through the bus, runs each ``RUN`` in it, writes
each ``COPY``/``ADD`` into it, and after every step that touches files takes a snapshot: the step's
layer is that snapshot's (only what changed since the previous one). The last snapshot becomes the
template (``BuildImage(from_snapshot=...)``: imaged writes the manifest; nothing is packed twice).

Step cache: every step extends a key, ``sha256(parent key, the step's canonical text, the digest of the
files it copies)``, seeded with the base's layer digests; a step's snapshot is named after its key
(``build-<key>``), so an unchanged prefix is found by id and not rebuilt, on any machine of the cluster.
A build sandbox is only created when a step misses the cache, from the last hit's snapshot.

A failing ``RUN`` fails the build with ``BuildFailed`` (its step, exit code and output tail); no
template is written; build sandboxes are killed in every case. The snapshots of the steps that
succeeded stay: they are the cache (``dsec snapshot rm`` removes them).

E2B's start and ready commands (``start_cmd``/``ready_cmd`` of ``build``): after the last step the
build starts the start command in a sandbox of the result and waits for the ready command (at most
``ready_timeout`` s); one that never succeeds fails the build (``BuildFailed``, the step after the
last) and no template is written. The template keeps both in its defaults; creates through the
gateway run them again (``sdk._startcmd`` says why there is no running-state snapshot)."""

from __future__ import annotations

import asyncio
import fnmatch
import glob
import hashlib
import io
import json
import os
import posixpath
import shlex
import stat
import tarfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors

from bus import codec
from bus import subjects as S
from bus.errors import BuildFailed, DsecError, InvalidArgument, SandboxTimeout, Unavailable, UnknownSnapshot
from bus.messages import BuildImage, ImageBuilt, ImageDefaults, SnapshotRecord, SnapshotRequest, TemplateManifest
from bus.runtime import KV, tenant_of

from . import _snapshots as _snap
from ._async import AsyncSandbox, _nc
from ._dockerfile import Step, parse_dockerfile
from ._startcmd import start_and_wait_ready
from .errors import CommandExitError

LogFn = Callable[[str], Any]
BUILD_TIMEOUT_S = 3600.0  # a registry pull (imaged) or a snapshot (the host) may take this long
OUTPUT_TAIL = 4000
_TEMPLATE_NAME = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_"


@dataclass
class StepReport:
    index: int
    text: str
    cached: bool = False
    seconds: float = 0.0
    snapshot: str = ""


@dataclass
class BuildReport:
    name: str
    manifest: TemplateManifest
    steps: list[StepReport] = field(default_factory=list)
    seconds: float = 0.0
    sandboxes: int = 0  # build sandboxes created (0: every step came from the cache)

    def as_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "layers": len(self.manifest.layers), "seconds": round(self.seconds, 3), "sandboxes": self.sandboxes,
            "steps": [{"index": s.index, "step": s.text, "cached": s.cached, "seconds": round(s.seconds, 3), "snapshot": s.snapshot} for s in self.steps],
        }


@dataclass
class _State:
    template: str
    key: str
    snapshot: str = ""
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str = ""
    user: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    shell: list[str] = field(default_factory=list)
    start_cmd: str = ""
    ready_cmd: str = ""


def _sha(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode("utf-8", "surrogateescape")).hexdigest()


def _abs(path: str, workdir: str) -> str:
    return posixpath.normpath(posixpath.join(workdir or "/", path))


class TemplateBuilder:
    """Runs build steps against a stack (``nats_url``). ``on_log`` gets every log line (progress,
    commands' output); ``network`` (``{"allow_out": [...]}``) lets RUN reach package mirrors."""

    def __init__(
        self, *, nats_url: str | None = None, on_log: LogFn | None = None, network: dict[str, list[str]] | None = None,
        cpu: float = 1.0, memory_mb: int = 1024, disk_mb: int = 4096, run_timeout: float = 1800.0, no_cache: bool = False,
        pool: str = "default", profile: str = "build", client: str = "", ready_timeout: float = 300.0,
    ) -> None:
        self.nats_url = nats_url
        self.on_log = on_log or (lambda line: None)
        self.network = network
        self.shape: dict[str, Any] = {"cpu": cpu, "memory_mb": memory_mb, "disk_mb": disk_mb, "pool": pool, "profile": profile, "client": client}
        self.run_timeout = run_timeout
        self.ready_timeout = ready_timeout
        self.no_cache = no_cache
        self._sb: AsyncSandbox | None = None
        self._sb_at = ""  # the snapshot the build sandbox stands on ("" = the bare template)
        self._created = 0

    def log(self, line: str) -> None:
        self.on_log(line)

    # --- the bus ------------------------------------------------------------------------------
    async def _image_request(self, req: BuildImage) -> ImageBuilt:
        nc = await _nc(self.nats_url)
        try:
            # under this connection's tenant: the image service makes the template its own (imaged._tenancy)
            msg = await nc.request(S.img_build(tenant_of(nc)), codec.encode(req), timeout=BUILD_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            raise Unavailable("the image service does not answer (is `dsec up` running?)") from None
        except nats.errors.TimeoutError:
            raise SandboxTimeout(f"building template {req.name} took over {BUILD_TIMEOUT_S:g}s") from None
        return codec.decode_reply(msg.data, ImageBuilt)

    async def _template(self, name: str) -> TemplateManifest | None:
        if not name or len(name) > 128 or any(c not in _TEMPLATE_NAME for c in name):
            return None
        return await template_manifest((await _nc(self.nats_url)).jetstream(), name)

    # --- FROM ---------------------------------------------------------------------------------
    async def _from(self, step: Step) -> _State:
        src = step.args[0]
        snapshot = ""
        if src.startswith("snapshot:"):
            rec = await _snap.get_record(await _nc(self.nats_url), src[9:])
            snapshot, name = rec.snapshot_id, rec.template
            m = await self._template(name)
        elif src == "scratch":
            raise InvalidArgument("FROM scratch is not supported: start from an image, a template or a snapshot")
        else:
            name = src[9:] if src.startswith("template:") else src
            m = await self._template(name)
            if m is None and src.startswith("template:"):
                raise InvalidArgument(f"FROM {src}: no such template")
            if m is None:  # an image in a registry: imaged pulls it (each layer once) into a template of its own
                platform = step.flags.get("platform", "")
                name = S.pull_cache_template(src, platform)
                self.log(f"pulling {src}{' for ' + platform if platform else ''}")
                m = (await self._image_request(BuildImage(name=name, base="", from_ref=src, platform=platform, description=src))).manifest
        if m is None:
            raise InvalidArgument(f"FROM {src}: the snapshot's template {name!r} is gone")
        seed = _sha("from", name, *[lay.digest for lay in m.layers])  # a step's snapshot restores on its template: the name counts
        if snapshot:
            rec = await _snap.get_record(await _nc(self.nats_url), snapshot)
            seed = _sha(seed, *[lay.digest for lay in rec.layers])
        d = m.defaults or ImageDefaults()
        return _State(template=name, key=seed, snapshot=snapshot, env=dict(d.env), workdir=d.workdir, user=d.user,
                      entrypoint=list(d.entrypoint), cmd=list(d.cmd), start_cmd=d.start_cmd, ready_cmd=d.ready_cmd)

    # --- the build sandbox ----------------------------------------------------------------------
    async def _sandbox(self, st: _State) -> AsyncSandbox:
        if self._sb is not None and self._sb_at == st.snapshot:
            return self._sb
        await self._drop_sandbox()
        self._sb = await AsyncSandbox.create(
            st.template, nats_url=self.nats_url, snapshot=st.snapshot or None, timeout=self.run_timeout + 600, network=self.network,
            metadata={"dsec.build": "1"}, **self.shape,
        )
        self._created += 1
        self._sb_at = st.snapshot
        return self._sb

    async def _drop_sandbox(self) -> None:
        sb, self._sb = self._sb, None
        if sb is not None:
            try:
                await sb.kill()
            except DsecError as exc:
                self.log(f"warning: could not remove build sandbox {sb.sandbox_id}: {exc}")

    # --- steps --------------------------------------------------------------------------------
    async def build(
        self, name: str, steps: list[Step], context: str | os.PathLike[str] | None = None, *, description: str = "", owner: str = "",
        start_cmd: str | None = None, ready_cmd: str | None = None,
    ) -> BuildReport:
        """Run ``steps`` (the first FROM, after any ARGs) and write template ``name``. ``start_cmd`` and
        ``ready_cmd`` (E2B's; None: the base template's) must come up before the template is written."""
        if not name or len(name) > 128 or any(c not in _TEMPLATE_NAME for c in name):
            raise InvalidArgument(f"bad template name {name!r}: use letters, digits, '-' and '_' (max 128)")
        ctx = Path(context).resolve() if context is not None else None
        if ctx is not None and not ctx.is_dir():
            raise InvalidArgument(f"the build context {context} is not a directory")
        t0 = time.monotonic()
        pre_args = {}
        while steps and steps[0].kind == "ARG":
            pre_args.update(dict(zip(steps[0].args[::2], steps[0].args[1::2], strict=True)))
            steps = steps[1:]
        if not steps or steps[0].kind != "FROM":
            raise InvalidArgument("a build starts with FROM")
        total = len(steps)
        reports: list[StepReport] = []
        try:
            self.log(f"[1/{total}] {steps[0].text}")
            st = await self._from(steps[0])
            reports.append(StepReport(1, steps[0].text, seconds=time.monotonic() - t0))
            for i, step in enumerate(steps[1:], 2):
                reports.append(await self._step(i, total, step, st, ctx))
            if start_cmd is not None:
                st.start_cmd, st.ready_cmd = start_cmd, ready_cmd or ""
            if st.start_cmd:
                reports.append(await self._start(total + 1, st))
            defaults = ImageDefaults(env=dict(st.env), workdir=st.workdir, user=st.user, entrypoint=st.entrypoint, cmd=st.cmd,
                                     source=f"build {st.key[:16]}", start_cmd=st.start_cmd, ready_cmd=st.ready_cmd)
            req = BuildImage(name=name, base="", description=description, defaults=defaults, owner=owner,
                             **({"from_snapshot": st.snapshot} if st.snapshot else {"from_template": st.template}))
            built = await self._image_request(req)
        finally:
            await self._drop_sandbox()
        self.log(f"template {name}: {len(built.manifest.layers)} layers, {time.monotonic() - t0:.1f}s")
        return BuildReport(name=name, manifest=built.manifest, steps=reports, seconds=time.monotonic() - t0, sandboxes=self._created)

    async def _step(self, i: int, total: int, step: Step, st: _State, ctx: Path | None) -> StepReport:
        t0 = time.monotonic()
        self.log(f"[{i}/{total}] {step.text}")
        rep = StepReport(i, step.text)
        if step.kind == "FROM":
            raise InvalidArgument(f"step {i}: a second FROM (multi-stage builds are not supported)")
        if step.kind in ("ENV", "ARG"):
            pairs = dict(zip(step.args[::2], step.args[1::2], strict=True))
            (st.env if step.kind == "ENV" else st.args).update(pairs)
            if step.kind == "ENV":  # an ARG's value reaches the key where it is used (RUN's env, expanded text), as in Docker
                st.key = _sha(st.key, step.text)
            return rep
        if step.kind in ("USER", "CMD", "ENTRYPOINT", "SHELL"):
            if step.kind == "USER":
                st.user = step.args[0]
            else:
                argv = step.args if step.exec_form else [*(st.shell or ["/bin/sh", "-c"]), step.args[0]]
                if step.kind == "SHELL":
                    st.shell = list(step.args)
                else:
                    setattr(st, step.kind.lower(), argv)
            st.key = _sha(st.key, step.text)
            return rep
        files: list[tuple[str, str, int, bytes | str]] = []  # (kind, dest, mode, data | link target)
        if step.kind in ("COPY", "ADD"):
            files = _collect(step, ctx, st.workdir)
            digest = _sha(*[f"{k}\0{d}\0{m:o}\0" + (hashlib.sha256(v).hexdigest() if isinstance(v, bytes) else v) for k, d, m, v in files])
        elif step.kind == "WORKDIR":
            st.workdir = _abs(step.args[0], st.workdir)
            digest = ""
        else:
            digest = ""
        # RUN sees the build's ARGs and ENVs: a different value is a different step
        env_key = json.dumps([st.args, st.env, st.user, st.workdir, st.shell], sort_keys=True) if step.kind == "RUN" else ""
        key = _sha(st.key, step.text, digest, env_key)
        force = self.no_cache or bool(step.flags.get("force"))
        if force:  # built afresh, and so is every step after it (their keys descend from a new one)
            key = _sha(key, uuid.uuid4().hex)
        snap_id = f"build-{key[:40]}"
        if not force:
            rec = await self._cached(snap_id, st.template)
            if rec is not None:
                st.key, st.snapshot = key, rec.snapshot_id
                rep.cached, rep.snapshot, rep.seconds = True, rec.snapshot_id, time.monotonic() - t0
                self.log("  cached")
                return rep
        sb = await self._sandbox(st)
        await sb.set_timeout(self.run_timeout + 600)
        if step.kind == "RUN":
            await self._run(sb, i, total, step, st)
        elif step.kind == "WORKDIR":
            await sb.files.make_dir(st.workdir)
        else:
            await _upload(sb, files, step.flags.get("chown", ""))
        rec = await self._snapshot(sb, snap_id, key, step.text)
        st.key, st.snapshot = key, rec.snapshot_id
        self._sb_at = rec.snapshot_id
        rep.snapshot, rep.seconds = rec.snapshot_id, time.monotonic() - t0
        return rep

    async def _start(self, i: int, st: _State) -> StepReport:
        """The start command, and the ready command until it succeeds, in a sandbox of the result;
        its files are not kept (each create starts the command afresh)."""
        t0 = time.monotonic()
        text = f"startCmd {st.start_cmd}" + (f" readyCmd {st.ready_cmd}" if st.ready_cmd else "")
        self.log(f"[{i}/{i}] {text}")
        sb = await self._sandbox(st)
        try:
            res = await start_and_wait_ready(sb, st.start_cmd, st.ready_cmd, timeout_s=self.ready_timeout, user=st.user or None,
                                             cwd=st.workdir or None, envs={**st.env} or None)
        finally:
            await self._drop_sandbox()  # running: a later step could not use it, and its files are not the template's
        if not res.ready:
            message = res.describe(st.start_cmd, st.ready_cmd, self.ready_timeout)
            raise BuildFailed(f"step {i}/{i} `{text}` failed: {message}", step=i, instruction=text,
                              exit_code=-1 if res.last_exit is None else res.last_exit, output=res.start_output)
        self.log(f"  ready after {res.seconds:.1f}s ({res.attempts} tries of the ready command)")
        return StepReport(i, text, seconds=time.monotonic() - t0)

    async def _cached(self, snap_id: str, template: str) -> SnapshotRecord | None:
        try:
            rec = await _snap.get_record(await _nc(self.nats_url), snap_id)
        except UnknownSnapshot:
            return None
        return rec if rec.template == template else None

    async def _snapshot(self, sb: AsyncSandbox, snap_id: str, key: str, text: str) -> SnapshotRecord:
        req = SnapshotRequest(snapshot_id=snap_id, name="build step", metadata={"dsec.build.key": key, "dsec.build.step": text[:512]})
        try:
            rec: SnapshotRecord = await sb._request("snapshot", req, SnapshotRecord, timeout=_snap.SNAPSHOT_TIMEOUT_S)
            return rec
        except InvalidArgument:
            # another build took the same step at the same time: its snapshot is as good as ours
            got = await self._cached(snap_id, (sb.spec.template if sb.spec else ""))
            if got is None:
                raise
            return got

    async def _run(self, sb: AsyncSandbox, i: int, total: int, step: Step, st: _State) -> None:
        cmd = shlex.join(step.args) if step.exec_form else step.args[0]
        if st.shell and not step.exec_form:
            cmd = shlex.join([*st.shell, cmd])
        tail: list[str] = []

        def out(data: str) -> None:
            tail.append(data)
            if sum(len(t) for t in tail) > 2 * OUTPUT_TAIL:
                del tail[: len(tail) // 2]
            for line in data.splitlines():
                self.log(f"  {line}")

        try:
            user = step.flags.get("user") or st.user or None  # E2B's run_cmd(user=...) is for that step only
            await sb.commands.run(cmd, envs={**st.args, **st.env}, cwd=st.workdir or None, user=user, timeout=self.run_timeout,
                                  on_stdout=out, on_stderr=out)
        except CommandExitError as exc:
            text = "".join(tail)[-OUTPUT_TAIL:]
            raise BuildFailed(
                f"step {i}/{total} `{step.text}` failed with exit code {exc.exit_code}:\n{text}",
                step=i, instruction=step.text, exit_code=exc.exit_code, output=text,
            ) from None
        except SandboxTimeout as exc:
            raise BuildFailed(f"step {i}/{total} `{step.text}` did not finish within {self.run_timeout:g}s ({exc.description})",
                              step=i, instruction=step.text, exit_code=-1, output="".join(tail)[-OUTPUT_TAIL:]) from None


# --- COPY / ADD -------------------------------------------------------------------------------------
def _inside(ctx: Path, p: str) -> Path:
    real = Path(os.path.realpath(p))
    if real != ctx and ctx not in real.parents:
        raise InvalidArgument(f"COPY source {p!r} is outside the build context {ctx}", path=p)
    return real


def _collect(step: Step, ctx: Path | None, workdir: str) -> list[tuple[str, str, int, bytes | str]]:
    """What a COPY/ADD writes: (kind dir|file|link, absolute destination, mode, data or link target)."""
    if ctx is None:
        raise InvalidArgument(f"{step.kind} needs a build context")
    *srcs, dest = step.args
    chmod = int(step.flags["chmod"], 8) if step.flags.get("chmod") else None
    dest_abs = _abs(dest, workdir)
    into_dir = dest.endswith("/") or len(srcs) > 1
    out: list[tuple[str, str, int, bytes | str]] = []
    for src in srcs:
        if "://" in src:
            raise InvalidArgument(f"{step.kind} from a URL is not supported ({src}): RUN a download instead", path=src)
        rel = posixpath.normpath("/" + src).lstrip("/")  # Docker resolves sources inside the context, '..' included
        if src.startswith("..") or "/../" in f"/{src}/":
            raise InvalidArgument(f"{step.kind} source {src!r} climbs out of the build context", path=src)
        pattern = str(ctx / rel) if rel else str(ctx)
        matches = sorted(glob.glob(pattern)) if glob.has_magic(rel) else [pattern]
        if not matches or not os.path.lexists(matches[0]):
            raise InvalidArgument(f"{step.kind} source {src!r} is not in the build context", path=src)
        into = into_dir or len(matches) > 1
        for m in matches:
            real = _inside(ctx, m)
            if real.is_dir():
                out += _tree(ctx, real, dest_abs, chmod)
            elif step.kind == "ADD" and tarfile.is_tarfile(real):
                out += _untar(real, dest_abs, chmod)
            else:
                target = posixpath.join(dest_abs, os.path.basename(m)) if into else dest_abs
                out.append(("file", target, chmod if chmod is not None else stat.S_IMODE(real.stat().st_mode), real.read_bytes()))
    return out


def _tree(ctx: Path, root: Path, dest: str, chmod: int | None) -> list[tuple[str, str, int, bytes | str]]:
    out: list[tuple[str, str, int, bytes | str]] = [("dir", dest, chmod if chmod is not None else 0o755, b"")]
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        rel = os.path.relpath(dirpath, root)
        base = dest if rel == "." else posixpath.join(dest, rel.replace(os.sep, "/"))
        for n in dirnames + sorted(filenames):
            p = os.path.join(dirpath, n)
            d = posixpath.join(base, n)
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                target = os.readlink(p)
                # a link is copied as a link; one that leads out of the context is refused like a source would be
                _inside(ctx, os.path.join(dirpath, target))
                out.append(("link", d, 0o777, target))
            elif stat.S_ISDIR(st.st_mode):
                out.append(("dir", d, chmod if chmod is not None else stat.S_IMODE(st.st_mode), b""))
            elif stat.S_ISREG(st.st_mode):
                out.append(("file", d, chmod if chmod is not None else stat.S_IMODE(st.st_mode), Path(p).read_bytes()))
    return out


def _untar(path: Path, dest: str, chmod: int | None) -> list[tuple[str, str, int, bytes | str]]:
    out: list[tuple[str, str, int, bytes | str]] = []
    with tarfile.open(path) as tf:
        for ti in tf:
            name = posixpath.normpath("/" + ti.name).lstrip("/")
            if not name or name == ".":
                continue
            d = posixpath.join(dest, name)
            mode = chmod if chmod is not None else ti.mode & 0o7777
            if ti.isdir():
                out.append(("dir", d, mode, b""))
            elif ti.issym():
                out.append(("link", d, 0o777, ti.linkname))
            elif ti.isreg():
                f = tf.extractfile(ti)
                out.append(("file", d, mode, f.read() if f is not None else b""))
    return out


async def _upload(sb: AsyncSandbox, files: list[tuple[str, str, int, bytes | str]], chown: str) -> None:
    made: set[str] = set()
    links = []
    for kind, dest, mode, data in files:
        parent = posixpath.dirname(dest)
        if parent not in made:
            await sb.files.make_dir(parent)
            made.add(parent)
        if kind == "dir":
            await sb.files.make_dir(dest, mode=mode)
            made.add(dest)
        elif kind == "file":
            assert isinstance(data, bytes)
            await sb.files.write(dest, data, mode=mode)
        else:
            links.append(f"ln -sfn {shlex.quote(str(data))} {shlex.quote(dest)}")
    fixups = list(links)
    if chown:
        fixups.append("chown -h " + shlex.quote(chown) + " " + " ".join(shlex.quote(d) for _, d, _, _ in files))
    fixups += [f"chmod {m:o} {shlex.quote(d)}" for k, d, m, _ in files if k == "dir"]  # make_dir leaves an existing dir's mode
    for i in range(0, len(fixups), 200):  # a few commands per exec, well under the argument size limit
        await sb.commands.run(" && ".join(fixups[i:i + 200]), timeout=300)


# --- entry points --------------------------------------------------------------------------------
async def build_dockerfile(
    name: str, dockerfile: str | os.PathLike[str], context: str | os.PathLike[str] | None = None, *,
    build_args: dict[str, str] | None = None, description: str = "", **opts: Any,
) -> BuildReport:
    """Build template ``name`` from a Dockerfile (a path; its directory is the default context)."""
    path = Path(dockerfile)
    try:
        text = path.read_text()
    except OSError as exc:
        raise InvalidArgument(f"cannot read the Dockerfile {dockerfile}: {exc.strerror}") from None
    steps = parse_dockerfile(text, build_args)
    return await TemplateBuilder(**opts).build(name, steps, context if context is not None else path.parent, description=description)


async def template_manifest(js: Any, name: str) -> TemplateManifest | None:
    """The catalogue's manifest of template ``name``; None when it has none (or an unreadable one)."""
    kv: KV[TemplateManifest] = await KV.open(js, S.KV_IMAGES, codec.TEMPLATE)
    return await kv.get(name)


async def build_from_image(name: str, image: str, *, platform: str = "", nats_url: str | None = None, description: str = "") -> TemplateManifest:
    """Template ``name`` from an image in a registry (imaged pulls it; each layer is fetched and stored once)."""
    req = BuildImage(name=name, base="", from_ref=image, platform=platform, description=description)
    return (await TemplateBuilder(nats_url=nats_url)._image_request(req)).manifest


def tar_context(data: bytes, dest: str | os.PathLike[str]) -> None:
    """Unpack an uploaded context (a tar, maybe gzip) into ``dest``, refusing names that climb out."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tf:
        for ti in tf:
            if ti.name.startswith("/") or ".." in Path(ti.name).parts or fnmatch.fnmatch(ti.name, "*\0*"):
                raise InvalidArgument(f"archive member {ti.name!r} climbs out of the build context", path=ti.name)
        tf.extractall(dest, filter="data")


async def run_steps(name: str, steps: list[Step], context: str | os.PathLike[str] | None = None, **opts: Any) -> BuildReport:
    return await TemplateBuilder(**opts).build(name, steps, context)


def cli_build(args: Any) -> int:
    """``dsec image build NAME --dockerfile PATH [--context DIR] [--build-arg K=V]... [--no-cache] [--allow-out HOST]...``
    (the arguments are declared by imaged's CLI; the build runs here, as a client of the stack)."""
    import sys

    build_args = {}
    for item in args.build_arg or []:
        k, eq, v = item.partition("=")
        if not eq:
            v = os.environ.get(k, "")
        build_args[k] = v
    opts: dict[str, Any] = {"nats_url": getattr(args, "nats_url", None), "no_cache": args.no_cache}
    if args.allow_out:
        opts["network"] = {"allow_out": list(args.allow_out)}
    if not args.json:
        opts["on_log"] = lambda line: print(line, file=sys.stderr, flush=True)
    report = asyncio.run(build_dockerfile(args.name, args.dockerfile, args.context, build_args=build_args, description=args.description, **opts))
    if args.json:
        print(json.dumps(report.as_json(), indent=2))
    else:
        cached = sum(1 for s in report.steps if s.cached)
        print(f"template {report.name}: {len(report.manifest.layers)} layers, {len(report.steps)} steps ({cached} cached), {report.seconds:.1f}s")
    return 0


__all__ = ["BuildReport", "StepReport", "TemplateBuilder", "build_dockerfile", "build_from_image", "cli_build", "run_steps", "tar_context"]
