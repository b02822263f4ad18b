"""The ``container`` backend: containerd + runc, overlay rootfs over read-only layers, agent as PID 1.
The class composes its parts: layer mounts, shim groups, warm pool, CRIU, cgroups, recovery."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, cast

import structlog

from bus.errors import BlobStoreUnavailable, CreateFailed, DsecError, ImageError, SandboxNotFound
from bus.messages import (
    BackendName,
    ExecRequest,
    ExecResult,
    FileOp,
    FileWrite,
    HostBackend,
    LayerRef,
    NetworkSpec,
    SandboxMetrics,
    SandboxSpec,
)
from bus.profiles import default_profile

from ... import _storage as storage
from ..._agent import AgentClient, AgentError, AgentInfo, ensure_agent_binary
from ..._agentops import DEFAULT_ENV, agent_exec, agent_files, agent_of
from ..._config import DEFAULT_WARM_POOL
from ..._backend import Handle, HostCapacity, OnOutput, OnStart, Usage
from ..._profiles import Enforcement, compile_profile
from ..._quota import ScratchError, ScratchFS
from ..._rootfs import RootfsLayout, overlay_mount
from ...network import Attachment, NetworkConfig, NetworkManager, Prepared, write_hosts_file
from . import criu
from .cgroups import MEM_CGROUP, START_CPU, Meter, cgroup_path, cpu_class, memory_bytes, remove_cgroups, set_class, set_cpu, set_limits
from .containerd import ContainerdError, ContainerRuntime, ContainerSpec
from .daemon import ContainerdDaemon
from .fnreset import NsResetters
from .freezer import freeze, frozen, thaw
from .layers import LayerMounts
from .reconcile import LABEL_CONTAINER, LABEL_SANDBOX, Recovery, Tables
from .shims import ShimGroups, reap_idle_shims
from .warmpool import Recipe, Warm, WarmKey, WarmPool, rebinds, takes_restore
from .warmroot import HELPER as WARMROOT
from .warmroot import STAGE_NAME, WARM_OLD, fresh_upper

log = structlog.get_logger("dsec.hostagent.container")

AGENT_DIR_IN_SANDBOX = "/.dsec/bin"
RUN_DIR_IN_SANDBOX = "/.dsec/run"
WARMROOT_HELPERS = 16  # restores given a warm root at once (a fork of 64 queues on these)
AGENT_LOG = "agent.log"  # the agent's own stderr, in the sandbox's host-side dir (not visible inside)
AGENT_LAST_WORDS = "agent.exit"  # why the agent exited, beside its socket (dsec-agent.c: die)


async def _all(*aws: Awaitable[Any]) -> list[Any]:
    """``asyncio.gather`` that lets every part end before it raises the first failure: a part still
    running (a network being made) would outlive the caller's clean-up."""
    done = await asyncio.gather(*aws, return_exceptions=True)
    for r in done:
        if isinstance(r, BaseException):
            raise r
    return done


class ContainerBackend:
    """Sandboxes as runc containers driven through containerd's gRPC API."""

    name: BackendName = "container"
    enforces_profiles: Literal[True] = True  # create() takes security=Enforcement (the sandbox's guard profile)

    def __init__(
        self,
        data_dir: str,
        *,
        containerd_address: str | None = None,
        scratch_size_gb: int | None = 256,
        shim_group_size: int = 16,
        lazy_mount: str | None = None,
        pids_max: int = 1024,
        network: NetworkConfig | None = None,
        warm_pool: int = DEFAULT_WARM_POOL,
        containerd_calls: int = 32,
        write_reserve_mb: int = storage.WRITE_RESERVE_MB,
    ) -> None:
        self.data_dir = Path(data_dir)
        self.write_reserve_mb = write_reserve_mb  # the data dir's free space creates and uploads leave alone
        self.containerd_calls = containerd_calls  # containerd calls in flight at once; a burst queues
        self.containerd_address = containerd_address
        self.daemon: ContainerdDaemon | None = None
        self._rt: ContainerRuntime | None = None
        self.scratch = ScratchFS(str(self.data_dir), scratch_size_gb)
        self.layers = LayerMounts(self.data_dir, lazy_mount or str(self.data_dir / "lazy"))
        self.shims = ShimGroups(shim_group_size)
        self.pids_max = pids_max
        self.agent_bin = ""
        self.t = Tables()
        self.meter = Meter()
        self._default_enf: Enforcement | None = None
        self.net = NetworkManager(network or NetworkConfig.from_env())  # per-sandbox netns + egress allowlist
        self.pool = WarmPool(warm_pool, self._start_warm, lambda cid: self._remove(cid, None))
        self.fnreset = NsResetters()
        self.warmroot = NsResetters(WARMROOT_HELPERS, helper=WARMROOT)  # gives a warm container a restore's root
        self._bg: set[asyncio.Future[Any]] = set()  # the helpers' start
        self._bg_helpers = False
        self.warm_restores = True  # a restore may take a warm container of its template (off: always cold; benchmarks compare)
        self.recovery = Recovery(self.t, self.scratch, self.shims, self.layers, self.pool, self.net, self._remove)

    @property
    def rt(self) -> ContainerRuntime:
        assert self._rt is not None, "the container backend is not started"
        return self._rt

    # --- lifecycle ------------------------------------------------------------------------------
    async def start(self) -> None:
        self.layers.ensure_dir()
        self.agent_bin = await asyncio.to_thread(ensure_agent_binary, str(self.data_dir))
        await self.scratch.ensure_async()
        if self.containerd_address is None:
            self.daemon = ContainerdDaemon(str(self.data_dir))
            await self.daemon.start()
            address = self.daemon.address
            runc_root = self.daemon.runc_root
        else:
            address, runc_root = self.containerd_address, None
        self._rt = ContainerRuntime(address, runc_root=runc_root, max_calls=self.containerd_calls)
        await self.net.start()

    async def stop(self) -> None:
        await self.pool.stop()
        await self.fnreset.stop()
        await asyncio.gather(*self._bg, return_exceptions=True)
        await self.warmroot.stop()
        if self._rt is not None:
            # Warm containers (also one a cancelled refill was starting) serve no sandbox: remove them.
            for c in await self.rt.list():
                if c.labels.get(LABEL_CONTAINER) and not c.labels.get(LABEL_SANDBOX):
                    await self._remove(c.id, None)
            alive = [c for c in await self.rt.list() if c.labels.get(LABEL_SANDBOX)]
            await self.rt.close()
        else:
            alive = []
        # Leave containerd up while sandboxes live: a restarted agent recovers them through it.
        if self.daemon is not None and not alive:
            await reap_idle_shims(self.daemon.address)
            await self.daemon.stop()
            await self.layers.unmount_all()
        await self.net.stop()  # kernel state (netns, veths, nft) stays for the sandboxes that live on

    # --- what the host agent advertises ------------------------------------------------------------
    def cached_layers(self) -> list[str]:
        return self.layers.cached()

    def warm_ready(self) -> int:
        return self.pool.ready()

    def capacity(self) -> HostCapacity:
        return HostCapacity.of_host(self.data_dir)

    def advertise(self) -> HostBackend:
        return HostBackend(name=self.name)  # a sandbox may ask for the whole host

    # --- create / destroy -------------------------------------------------------------------
    async def create(
        self, spec: SandboxSpec, layers: list[LayerRef], *, security: Enforcement | None = None, memory: LayerRef | None = None,
    ) -> Handle:
        """Start the sandbox confined by ``security`` (the built-in default profile when None); with
        ``memory`` (a snapshot's CRIU dump, packed as a layer) its processes are restored instead.

        A start that failed while the blob store is away, on layers this host does not hold (a read
        of an uncached chunk failed: the mount, or the sandbox's first exec), is
        ``blob_store_unavailable``, whatever step noticed it."""
        try:
            return await self._create(spec, layers, security, memory)
        except BlobStoreUnavailable:
            raise
        except Exception as exc:
            if isinstance(exc, DsecError) and not isinstance(exc, (ImageError, CreateFailed)):
                raise  # a refusal of its own (bad input, quota, no space): not the store's doing
            away = self.layers.store_unavailable([*layers, *([memory] if memory else [])])
            if away is None:
                raise
            raise away from exc

    async def _create(self, spec: SandboxSpec, layers: list[LayerRef], security: Enforcement | None, memory: LayerRef | None) -> Handle:
        sid = spec.sandbox_id
        if security is None:
            security = self._default_security()
        if not layers:
            raise ImageError(f"template {spec.template!r} has no layers")
        lowers = [await self.layers.path(layer) for layer in reversed(layers)]  # overlay wants the top layer first
        prepared: Prepared | None = None
        # Any profile takes a warm container (guard finds the sandbox through its record's container_id,
        # so a kill or quarantine reaches it). A restore takes one of its template only where the profile lets
        # its root be swapped (``takes_restore``); a plain create's names for /etc/hosts would have to go
        # into a mounted root's upper dir, so such a create starts cold. A restore of a snapshot that added
        # nothing to its template (a fork of an unchanged sandbox) has the template's very layers: a warm
        # container of them is that sandbox already.
        key = WarmKey.of(layers, spec.disk_mb, security)
        unchanged = self.warm_restores and bool(spec.snapshot) and memory is None and bool(self.pool.entries().get(key))
        plain = self.pool.size > 0 and (not spec.snapshot or unchanged)
        warm_root = self.warm_restores and self.pool.size > 0 and bool(spec.snapshot) and memory is None and takes_restore(security)
        if (plain or warm_root) and self.net.wanted(spec.network) and spec.network is not None:
            prepared = await self.net.prepare(spec.network)  # checked and resolved first: a bad allowlist costs no warm container
        if plain and not (prepared is not None and prepared.names):
            warm = await self.pool.claim(key, Recipe(tuple(lowers), spec.disk_mb, security), lambda w: self._configure_warm(w, spec, security, prepared))
            if warm is not None:
                return self._serve_warm(sid, warm, security, self.net.attachment(sid) if prepared is not None else None)
        elif warm_root:
            # A restore (a fork's child): a warm container of its template, given the restore's root.
            warm = await self.pool.claim_under(key, lambda w: self._configure_restore(w, spec, lowers, security, prepared))
            if warm is not None:
                handle = self._serve_warm(sid, warm, security, self.net.attachment(sid) if prepared is not None else None)
                handle.extra["warm_root"] = True  # (no memory snapshot of it: see Snapshots._memory_supported)
                return handle
        net = None
        if self.net.wanted(spec.network):
            assert spec.network is not None
            net = await self.net.setup(sid, spec.network, prepared=prepared)  # torn down by destroy() if anything below fails
        labels = {LABEL_SANDBOX: sid, "dsec.template": spec.template}
        # A later incarnation (a resumed pause, a restore after its host was lost) gets a container id,
        # and so cgroups and scratch, of its own: the earlier one may still linger on a host that was cut
        # off, and hosts sharing a kernel (dsec up --hosts) must not touch each other's.
        cid = sid if spec.generation <= 0 else f"{sid}-g{spec.generation}"
        self.t.cid[sid] = cid  # before the start: a failed one's teardown (destroy) removes this container
        if memory is None:
            pid, sdir, group, info = await self._start(cid, lowers, spec.disk_mb, spec.cpu, spec.memory_mb, security, net, labels, priority=spec.priority)
        else:
            async with criu.restore_work_dir(self.data_dir, sid) as work:
                restore = (await self.layers.path(memory), work)
                pid, sdir, group, info = await self._start(
                    cid, lowers, spec.disk_mb, spec.cpu, spec.memory_mb, security, net, labels, restore, priority=spec.priority,
                )
        if cid != sid:
            self.t.clients[sid] = self.t.clients.pop(cid)  # ops find a sandbox's agent by its id
        return Handle(sid, pid, self._extra(cid, sdir, group, security, info, net))

    async def _confine(self, w: Warm, security: Enforcement) -> None:
        """A claimed warm container's agent applies its confinement now (its root final), as a cold
        start's agent does before it serves (``--confine-on-claim``)."""
        info = await self.t.clients[w.cid].confine()
        if security.landlock_required and not info.landlock:
            raise CreateFailed(f"sandbox agent runs without the Landlock rules profile {security.profile!r} requires")
        w.info = info

    def _serve_warm(self, sid: str, warm: Warm, security: Enforcement, net: Attachment | None = None) -> Handle:
        self.t.cid[sid] = warm.cid
        self.t.clients[sid] = self.t.clients.pop(warm.cid)
        return Handle(sid, warm.pid, self._extra(warm.cid, warm.sdir, self.shims.group_of(warm.cid), security, warm.info, net))

    async def _configure_restore(self, w: Warm, spec: SandboxSpec, lowers: list[str], security: Enforcement, net: Prepared | None) -> None:
        """The warm container's root becomes the restore's: its lowers over a fresh upper, the profile's
        read-only binds of its directories made again in it (``warmroot``); then its agent confines itself
        there (Landlock's rules bind to the new root's inodes). With ``net`` (the restore's allowlist,
        prepared) the container's own empty netns gets the sandbox's veth, addresses and rules, as a
        cold start's pre-made one has them, and the fresh upper its /etc/hosts."""
        try:
            await self._configure_restore_once(w, spec, lowers, security, net)
        except BaseException:
            if net is not None:
                await self.net.teardown(spec.sandbox_id)  # the next warm container, or the cold start, makes it again
            raise

    async def _configure_restore_once(self, w: Warm, spec: SandboxSpec, lowers: list[str], security: Enforcement, net: Prepared | None) -> None:
        t0 = time.perf_counter()
        layout = RootfsLayout(w.sdir)
        old = os.path.join(w.sdir, WARM_OLD)
        fresh_upper(layout, old)  # two renames and three mkdirs on the container's own disk: inline
        wire = self._wire(w, spec, net) if net is not None else None
        if net is not None and net.names and wire is not None:  # lines for /etc/hosts: in the fresh upper before the root is mounted
            att = await wire
            wire = None
            if att.hosts:
                await asyncio.to_thread(write_hosts_file, layout.upper, lowers, att.hosts)
        t1 = time.perf_counter()
        ms: dict[str, float] = {}

        async def timed(name: str, work: Awaitable[Any]) -> Any:
            t = time.perf_counter()
            try:
                return await work
            finally:
                ms[name] = round((time.perf_counter() - t) * 1000, 1)

        root = self.warmroot.run({"pid": w.pid, "cgroup": cgroup_path(w.cid), "lowers": lowers, "upper": layout.upper, "work": layout.work,
                                  "rebind": rebinds(security)})
        try:  # the labels (and network) meanwhile: they do not touch the root (any failing, the container is removed)
            done = await _all(timed("root_ms", root), timed("labels_ms", self._configure_warm(w, spec, None)),
                              *([timed("net_ms", wire)] if wire is not None else []))
            out = cast(dict[str, Any], done[0])
            await timed("confine_ms", self._confine(w, security))
            self._share(w, spec)
        finally:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(layout.run, STAGE_NAME))
        log.info("warm_restore", sandbox_id=spec.sandbox_id, container=w.cid, upper_ms=round((t1 - t0) * 1000, 1),
                 helper_ms=round(float(out.get("ms", 0.0)), 1), ms=round((time.perf_counter() - t1) * 1000, 1), **ms)
        shutil.rmtree(old, True)  # the old root is detached: what its upper held (next to nothing: it served nothing) goes

    async def _configure_warm(self, w: Warm, spec: SandboxSpec, security: Enforcement | None, net: Prepared | None = None) -> None:
        """Labels; with ``security`` (a plain create: its root is the one it started with) the agent's
        confinement and the network ``net`` asks for (in the container's own netns), then the sandbox's
        limits and CPU class (without: the caller does those)."""
        labels = self.rt.set_labels(w.cid, {LABEL_SANDBOX: spec.sandbox_id, "dsec.template": spec.template})
        if security is None:
            await labels
            return
        try:
            await _all(labels, self._confine(w, security), *([self._wire(w, spec, net)] if net is not None else []))
        except BaseException:
            if net is not None:
                await self.net.teardown(spec.sandbox_id)  # the next warm container, or the cold start, makes it again
            raise
        self._share(w, spec)

    def _wire(self, w: Warm, spec: SandboxSpec, net: Prepared) -> Awaitable[Attachment]:
        """The sandbox's veth, address, route and rules in the warm container's own (empty) netns, pinned
        at the sandbox's netns path as a cold start's network is."""
        assert spec.network is not None
        return self.net.setup(spec.sandbox_id, spec.network, prepared=net, netns_of=f"/proc/{w.pid}/ns/net")

    @staticmethod
    def _share(w: Warm, spec: SandboxSpec) -> None:
        """The sandbox's limits and CPU class, once its agent is confined (as at a cold start: a small
        share, or best-effort's SCHED_IDLE, would leave the agent confining itself behind every busy
        sandbox). A few small cgroupfs writes, inline: a hop to the default executor (a few threads)
        queues behind a burst's, and a fork of 64 claims 64 at once."""
        set_limits(w.cid, spec.cpu, spec.memory_mb)
        set_class(w.cid, spec.cpu, spec.priority)

    async def _start_warm(self, cid: str, r: Recipe) -> Warm:
        if self.warm_restores and takes_restore(r.security) and not self._bg_helpers:
            self._bg_helpers = True  # the helpers that give restores a root, started before the first one
            task = asyncio.ensure_future(self.warmroot.prestart())
            self._bg.add(task)
            task.add_done_callback(self._bg.discard)
        pid, sdir, _, info = await self._start(cid, list(r.lowers), r.disk_mb, START_CPU, 64, r.security, None, confine_on_claim=True)
        return Warm(cid, pid, sdir, info)

    @staticmethod
    def _extra(cid: str, sdir: str, group: str, security: Enforcement, info: AgentInfo, net: Attachment | None) -> dict[str, Any]:
        return {
            "cid": cid, "dir": sdir, "group": group or "", "profile": security.profile, "profile_version": security.version,
            "landlock_abi": info.landlock_abi, "seccomp_log": info.seccomp_log, "audit_session": info.audit_session,
            **({"net": net.to_extra()} if net else {}),
        }

    async def _start(
        self, cid: str, lowers: list[str], disk_mb: int, cpu: float, memory_mb: int, security: Enforcement, net: Attachment | None,
        labels: dict[str, str] | None = None, restore: tuple[str, str] = ("", ""), *, priority: str = "latency-sensitive",
        confine_on_claim: bool = False,
    ) -> tuple[int, str, str, AgentInfo]:
        """Cold start of one container ``cid``: scratch disk, overlay, runc, agent ready; its CPU class
        once the agent answers (a warm container starts latency-sensitive: its claim sets the class).
        ``confine_on_claim``: a warm container's: its agent confines itself only when it is claimed
        (``_confine``), and serves nothing before."""
        self.t.starting.add(cid)
        try:
            return await self._start_once(cid, lowers, disk_mb, cpu, memory_mb, security, net, labels, restore, priority, confine_on_claim)
        finally:
            self.t.starting.discard(cid)

    async def _start_once(
        self, cid: str, lowers: list[str], disk_mb: int, cpu: float, memory_mb: int, security: Enforcement, net: Attachment | None,
        labels: dict[str, str] | None, restore: tuple[str, str], priority: str, confine_on_claim: bool = False,
    ) -> tuple[int, str, str, AgentInfo]:
        storage.ensure_room(self.data_dir, 0, "create", self.write_reserve_mb)  # no_space, typed, before the scratch image and its mkfs
        try:
            sdir = await self.scratch.allocate_async(cid, disk_mb)
        except ScratchError as exc:
            raise CreateFailed(f"cannot allocate {disk_mb} MB of disk: {exc}") from None
        layout = RootfsLayout(sdir).create()
        if net is not None and net.hosts:
            await asyncio.to_thread(write_hosts_file, layout.upper, lowers, net.hosts)
        group = self.shims.pick(cid)
        try:
            pid = await self.rt.create_and_start(ContainerSpec(
                cid,
                rootfs_mounts=[overlay_mount(lowers, layout.upper, layout.work)],
                args=[f"{AGENT_DIR_IN_SANDBOX}/dsec-agent", "--socket", f"{RUN_DIR_IN_SANDBOX}/agent.sock", *security.agent_args,
                      *(["--confine-on-claim"] if confine_on_claim else [])],
                env=DEFAULT_ENV,
                cpu=max(cpu, START_CPU),  # its own share once its agent answers (below)
                memory_mb=memory_mb,
                pids_max=self.pids_max,
                bind_mounts=[(os.path.dirname(self.agent_bin), AGENT_DIR_IN_SANDBOX, True), (layout.run, RUN_DIR_IN_SANDBOX, False)],
                hostname="sandbox",
                labels={LABEL_CONTAINER: cid, **(labels or {})},
                group=group,
                netns_path=net.netns if net else None,
                stdout_path=os.path.join(sdir, AGENT_LOG),
                seccomp_profile=security.seccomp,
                capabilities=security.capabilities,
                masked_paths=security.masked_paths,
                readonly_paths=security.readonly_paths,
                no_new_privileges=security.no_new_privileges,
                setup_capabilities=security.setup_capabilities,
                restore_from=restore[0],
                restore_work=restore[1],
            ))
        except ContainerdError as exc:
            self.shims.leave(cid)
            if restore[0]:
                log.warning("criu_restore_failed", sandbox_id=cid, error=str(exc), criu=criu.criu_log(restore[1], "restore.log"))
                raise criu.restore_failed(exc, restore[1]) from None
            raise CreateFailed(f"containerd could not start the sandbox: {exc}") from None
        if group:
            self.shims.started(group)
        if restore[0]:
            if frozen(cgroup_path(cid)):
                await thaw(cgroup_path(cid))  # dumped while frozen: CRIU brings the cgroup back frozen
            if net is None:
                await asyncio.to_thread(criu.loopback_up, pid)
        client = AgentClient(os.path.join(layout.run, "agent.sock"), expected_pid=pid)
        info = await self._wait_agent(cid, sdir, client)
        # Before the create is answered (and recorded): a host agent that dies in between
        # leaves an unrecorded container, which recovery removes. A few small cgroupfs writes,
        # inline: a hop to the default executor can queue behind a burst's disk work.
        try:
            if cpu < START_CPU:
                set_cpu(cid, cpu)
            set_class(cid, cpu, priority)
        except OSError as exc:
            raise CreateFailed(f"cannot apply the sandbox's CPU share: {exc}") from None
        if security.landlock_required and not info.landlock and not confine_on_claim:
            raise CreateFailed(f"sandbox agent runs without the Landlock rules profile {security.profile!r} requires")
        self.t.clients[cid] = client
        return pid, sdir, group or "", info

    def _default_security(self) -> Enforcement:
        if self._default_enf is None:
            self._default_enf = compile_profile(default_profile())
        return self._default_enf

    async def _wait_agent(self, sid: str, sdir: str, client: AgentClient) -> AgentInfo:
        """The agent's ping, or CreateFailed with its last words as soon as it exits (say, a
        confinement it could not apply) instead of after the whole ready timeout."""
        ready = asyncio.ensure_future(client.wait_ready(15.0, 0.002))
        exited = asyncio.ensure_future(self.rt.wait(sid))
        try:
            await asyncio.wait({ready, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            exited.cancel()
        if ready.done() and not ready.cancelled() and ready.exception() is None:
            return ready.result()
        if not ready.done() and exited.done() and not exited.cancelled() and exited.exception() is not None:
            try:  # could not watch the task: just wait for the agent
                return await ready
            except AgentError as exc:
                raise CreateFailed(f"sandbox agent did not start: {exc}") from None
        ready.cancel()
        try:
            await ready
        except (asyncio.CancelledError, AgentError):
            pass
        # Its last words: the file it writes beside its socket (there as soon as it exited), else
        # its stderr, which the shim copies to the log on its own schedule (give that a moment).
        last = await asyncio.to_thread(_last_words, os.path.dirname(client.socket_path))
        deadline = asyncio.get_running_loop().time() + 5.0
        while not last and asyncio.get_running_loop().time() < deadline:
            try:
                with open(os.path.join(sdir, AGENT_LOG), errors="replace") as f:
                    last = f.read()[-2000:].strip()
            except OSError:
                pass
            if not last:
                await asyncio.sleep(0.05)  # poll interval while the shim flushes
        err = ready.exception() if ready.done() and not ready.cancelled() else None
        status = exited.result() if exited.done() and not exited.cancelled() and exited.exception() is None else None
        why = f"exited: {last}" if last else (str(err) if err else "exited" if status is None else f"exited with status {status}")
        raise CreateFailed(f"sandbox agent did not start: {why}")

    async def destroy(self, sandbox_id: str) -> None:
        # The container id is kept until leftovers() finds nothing: a retried kill of a sandbox
        # from the warm pool removes the same container.
        await self._remove(self.t.cid.get(sandbox_id, sandbox_id), sandbox_id)

    async def leftovers(self, sandbox_id: str) -> list[str]:
        return await self.recovery.leftovers(self.rt, sandbox_id)

    async def _remove(self, cid: str, sandbox_id: str | None) -> None:
        for key in (cid, sandbox_id):
            client = self.t.clients.pop(key, None) if key is not None else None
            if client is not None:
                client.close_idle()
        self.pool.discard(cid)
        self.meter.forget(cid)
        # Leave the shim group before the delete: a container started meanwhile must not join a shim
        # whose last member is going away (that shim would exit under it).
        self.shims.leave(cid)
        # Nothing below while the task may still run (a delete that failed: containerd slow or down):
        # a scratch fs unmounted under a live task would only be detached, its loop device kept.
        await self.rt.delete(cid)
        await asyncio.to_thread(remove_cgroups, cid)
        if sandbox_id is not None:
            await self.net.teardown(sandbox_id)  # after the task is gone: the kernel then frees the netns
        await self.scratch.release_async(cid)

    # --- recovery and usage ------------------------------------------------------------------
    async def reconcile(self, holds: Callable[[str], bool], running: dict[str, int]) -> tuple[set[str], list[str]]:
        return await self.recovery.reconcile(self.rt, holds, running)

    async def recover(self, known: dict[str, Handle]) -> dict[str, Handle]:
        return await self.recovery.recover(self.rt, known)

    async def usage(self) -> Usage:
        per: dict[str, int] = {}
        total = 0
        for sid, cid in list(self.t.cid.items()):
            b = memory_bytes(cid)
            if b is None:
                continue
            per[sid] = b // (1 << 20)
            total += b
        idle_class = [cid for cid in self.t.cid.values() if cpu_class(cid) == "best-effort"]
        return Usage(mem_resident_mb=total // (1 << 20), cpu_busy=self.meter.host_busy(idle_class), per_sandbox_mem_mb=per)

    # --- the agent channel ---------------------------------------------------------------------------
    def agent_client(self, handle: Handle) -> AgentClient:
        """The sandbox's agent, for the ops that drive it directly (hostagent._execio)."""
        return agent_of(self.t.clients, handle.sandbox_id)

    async def exec(self, handle: Handle, req: ExecRequest, on_output: OnOutput | None, *, on_start: OnStart | None = None) -> ExecResult:
        return await agent_exec(self.agent_client(handle), handle.sandbox_id, req, on_output, on_start)

    async def files(self, handle: Handle, op: FileOp) -> Any:
        if isinstance(op, FileWrite):
            storage.ensure_room(self.data_dir, len(op.data), "file upload", self.write_reserve_mb)  # the sandbox's disk is a sparse file here
        return await agent_files(self.agent_client(handle), handle.sandbox_id, op)

    # --- optional abilities: metrics, freezing, checkpoints ----------------------------------------
    def _container_of(self, handle: Handle) -> str:
        cid = self.t.cid.get(handle.sandbox_id)
        if cid is None:
            raise SandboxNotFound(f"sandbox {handle.sandbox_id} is not running on this host")
        return cid

    async def set_network(self, handle: Handle, network: NetworkSpec | None) -> dict[str, Any]:
        att = await self.net.update(handle.sandbox_id, network)
        return handle.extra if att is None else {**handle.extra, "net": att.to_extra()}

    async def metrics(self, handle: Handle) -> SandboxMetrics:
        """CPU and memory from the sandbox's cgroups (v1), disk from its scratch filesystem."""
        return await asyncio.to_thread(self.meter.sandbox, self._container_of(handle), handle.extra.get("dir", ""))

    def _cgroup(self, handle: Handle) -> str:
        return cgroup_path(handle.extra.get("cid") or handle.sandbox_id)

    def cgroup_of(self, handle: Handle) -> str:
        """The sandbox's cgroup path under each v1 hierarchy (what the reclaim service is told)."""
        return self._cgroup(handle)

    async def before_freeze(self, handle: Handle) -> None:
        """Hang up the idle connections to the sandbox's agent (hostagent._snapshots, before it
        freezes the sandbox): a frozen agent cannot close its ends, and CRIU cannot dump them."""
        client = self.t.clients.get(handle.sandbox_id)
        if client is not None:
            await client.hang_up_idle()

    async def freeze(self, handle: Handle) -> None:
        await freeze(self._cgroup(handle))

    async def thaw(self, handle: Handle) -> None:
        await thaw(self._cgroup(handle))

    def set_memory_limit(self, handle: Handle, memory_mb: int) -> None:
        """Change a running sandbox's memory limit (an fn call's own); memory+swap follows it."""
        mem = MEM_CGROUP / cgroup_path(self._container_of(handle)).lstrip("/")
        limit = str(memory_mb * 1024 * 1024)
        mem_file, memsw = mem / "memory.limit_in_bytes", mem / "memory.memsw.limit_in_bytes"
        # memory+swap must stay >= memory: raise it first when growing, lower memory first when shrinking.
        growing = memory_mb * 1024 * 1024 >= int(mem_file.read_text())
        for f in ([memsw, mem_file] if growing else [mem_file, memsw]):
            if f.exists():
                f.write_text(limit)

    def oom_kills(self, handle: Handle) -> int:
        """Processes of the sandbox the kernel killed for its memory limit (cgroup v1 ``oom_kill``)."""
        path = MEM_CGROUP / cgroup_path(self._container_of(handle)).lstrip("/") / "memory.oom_control"
        try:
            for line in path.read_text().splitlines():
                key, _, n = line.partition(" ")
                if key == "oom_kill":
                    return int(n)
        except OSError:
            pass
        return 0

    async def fn_reset(self, handle: Handle, writable: tuple[str, ...], size_mb: int, first: bool) -> tuple[tuple[str, ...], int]:
        """Reset an fn pool member to its template's state (``fnreset``); ``first``: the member has
        served nothing yet, this copies its writable paths' content aside. The paths reset on each
        call, and the cgroup's OOM kill count now (which cannot be zeroed)."""
        cg = cgroup_path(self._container_of(handle))
        if first:
            handle.extra["mnt_ino"] = os.stat(f"/proc/{handle.pid}/ns/mnt").st_ino
        out = await self.fnreset.run({
            "pid": handle.pid, "mnt_ino": handle.extra["mnt_ino"], "cgroup": cg, "paths": list(writable), "size_mb": size_mb, "first": first,
        })
        return tuple(out["paths"]), int(out["oom_kills"])

    def frozen(self, handle: Handle) -> bool:
        return frozen(self._cgroup(handle))

    def scratch_dir(self, handle: Handle) -> str:
        return str(handle.extra["dir"])

    async def checkpoint(self, handle: Handle, image_dir: str, work_dir: str) -> None:
        """CRIU-dump the sandbox's processes into ``image_dir``; the sandbox runs on (or stays frozen)."""
        await criu.checkpoint(self.rt, self.t.cid.get(handle.sandbox_id, handle.sandbox_id), image_dir, work_dir)


__all__ = ["AGENT_DIR_IN_SANDBOX", "ContainerBackend", "DEFAULT_ENV", "RUN_DIR_IN_SANDBOX"]


def _last_words(run_dir: str) -> str:
    """What an agent that exited at start wrote beside its socket ('' if nothing). Read only while
    no command has run in the sandbox; never through a link."""
    try:
        fd = os.open(os.path.join(run_dir, AGENT_LAST_WORDS), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return os.read(fd, 2000).decode(errors="replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)
