"""The image service (``python -m imaged serve``): makes sure the ``base`` template exists and answers
the ``dsec.img.*`` core requests (list, build, remove, stats, snapshot removal). Replicas share a queue group.
Builds and removals are answered on the bare subjects (the operator's) and on each tenant's
(``<subject>.<tenant>``), checked against the owner of what they change (``_tenancy``)."""

from __future__ import annotations

import asyncio
import os
from typing import Any

from nats.aio.msg import Msg

from bus.codec import SNAP_REMOVE_REQ
from bus import subjects as S
from bus.errors import InvalidArgument
from bus.messages import Done
from bus.runtime import Endpoint, Service
from bus.streams import ensure_all

from ._build import ImageBuilder, ensure_base_template, remove_template
from ._compose import compose_template
from ._gc import collect
from ._oci import build_from_image
from ._manifests import list_manifests, require_manifest
from ._quota import DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT
from ._messages import (
    IMG_BUILD_REQ,
    IMG_REMOVE_REQ,
    IMG_STATS_REQ,
    ImageBuilt,
    ImageList,
    ImageStats,
)
from ._snapshots import remove_snapshot
from ._tenancy import check_build, check_remove, is_operator
from ._store import BlobStore, open_blob_store
from ._util import data_dir as _data_dir

QUEUE = "imaged"
GC_INTERVAL_S = 3600.0


class ImagedService(Service):
    name = "imaged"

    def __init__(
        self, nats_url: str | None = None, *, data_dir: str | os.PathLike[str] | None = None, ensure_base: bool = True, gc_interval_s: float | None = None,
        template_max_bytes_per_tenant: int = DEFAULT_TEMPLATE_MAX_BYTES_PER_TENANT, **kw: Any,
    ) -> None:
        super().__init__(nats_url, **kw)
        self.template_max_bytes_per_tenant = template_max_bytes_per_tenant  # what a tenant's templates may hold (imaged._quota)
        # periodic collection of the blob store and this data dir ($DSEC_GC_INTERVAL_S; 0: only `dsec gc`)
        self.gc_interval_s = float(os.environ.get("DSEC_GC_INTERVAL_S", GC_INTERVAL_S)) if gc_interval_s is None else gc_interval_s
        self.data_dir = _data_dir(data_dir)
        self.ensure_base = ensure_base
        self.store: BlobStore | None = None
        self.base_ready = asyncio.Event()
        self._build_lock = asyncio.Lock()
        self.endpoints: list[Endpoint] = []

    async def setup(self) -> None:
        assert self.nc is not None and self.js is not None
        await ensure_all(self.js)
        self.store = open_blob_store(self.js)
        for subject, handler, decoder, tenants in (
            (S.IMG_LIST, self._on_list, None, False),  # takes no arguments: any payload lists
            (S.IMG_BUILD, self._on_build, IMG_BUILD_REQ, True),
            (S.IMG_REMOVE, self._on_remove, IMG_REMOVE_REQ, True),
            (S.IMG_STATS, self._on_stats, IMG_STATS_REQ, False),
            (S.SNAP_REMOVE, self._on_snapshot_remove, SNAP_REMOVE_REQ, True),
        ):
            for served in (subject, f"{subject}.*") if tenants else (subject,):
                ep = Endpoint(self.nc, subject, handler, decoder=decoder)
                await ep.serve(served, queue=QUEUE)
                self.endpoints.append(ep)
        if self.ensure_base:
            self.spawn(self._ensure_base())
        else:
            self.base_ready.set()
        if self.gc_interval_s > 0:
            self.spawn(self._gc_loop())

    async def _gc_loop(self) -> None:
        assert self.js is not None and self.store is not None
        while not await self.pause(self.gc_interval_s):
            try:
                out = await collect(self.js, self.store, data_dir=self.data_dir)
                self.log.info("gc_done", **out)
            except Exception as exc:  # noqa: BLE001 - the next period tries again; nothing referenced is ever at risk
                self.log.warning("gc_failed", error=str(exc))

    async def _ensure_base(self) -> None:
        delay = 0.5
        assert self.js is not None
        for attempt in range(8):
            try:
                m = await ensure_base_template(self.js, self.data_dir, store=self.store)
                self.log.info("base_template_ready", digest=m.layers[0].digest if m.layers else "")
                self.base_ready.set()
                return
            except Exception as exc:  # noqa: BLE001 - retried, bounded
                self.log.warning("base_template_failed", attempt=attempt, error=str(exc))
                await asyncio.sleep(delay)  # retry back-off
                delay = min(delay * 2, 10.0)

    async def _on_list(self, msg: Msg, _: Any) -> Any:
        assert self.js is not None
        return ImageList(templates=await list_manifests(self.js))

    async def _on_build(self, msg: Msg, req: Any) -> Any:
        assert self.js is not None
        tenant = S.img_request_tenant(msg.subject, S.IMG_BUILD)
        async with self._build_lock:  # the owner checked and the manifest written with no other build between
            owner = await check_build(self.js, req, tenant)
            builder = ImageBuilder(self.js, self.data_dir, store=self.store)
            if req.from_snapshot or req.from_template:
                if req.base or req.workspace or req.toolkit or req.from_ref:
                    raise InvalidArgument("from_snapshot/from_template name every layer: leave the sources empty")
                res = await compose_template(self.js, req.name, snapshot=req.from_snapshot, template=req.from_template,
                                             defaults=req.defaults, description=req.description, owner=owner,
                                             max_bytes_per_owner=self.template_max_bytes_per_tenant)
            elif req.from_ref:
                if req.base or req.workspace or req.toolkit:
                    raise InvalidArgument("from_ref builds the whole template: leave base, workspace and toolkit empty")
                res, _ = await build_from_image(
                    builder, req.name, req.from_ref, platform=req.platform, description=req.description, owner=owner,
                    charge="" if is_operator(tenant) else tenant, max_bytes_per_tenant=self.template_max_bytes_per_tenant,
                )
            else:
                res = await builder.build_template(
                    req.name, req.base, req.workspace or None, req.toolkit or None, description=req.description, owner=owner,
                )
        return ImageBuilt(manifest=res.manifest, uploaded_bytes=res.uploaded_bytes, seconds=res.seconds)

    async def _on_remove(self, msg: Msg, req: Any) -> Any:
        assert self.js is not None
        async with self._build_lock:  # not a build of the name by its owner between the check and the removal
            await check_remove(self.js, req.name, S.img_request_tenant(msg.subject, S.IMG_REMOVE))
            await remove_template(self.js, req.name, prune=req.prune, store=self.store, data_dir=self.data_dir)
        return Done(detail=f"removed {req.name}")

    async def _on_stats(self, msg: Msg, req: Any) -> Any:
        assert self.js is not None
        m = await require_manifest(self.js, req.name)
        return ImageStats(name=m.name, total_bytes=sum(lay.size for lay in m.layers), layers=m.layers)

    async def _on_snapshot_remove(self, msg: Msg, req: Any) -> Any:
        assert self.js is not None and self.store is not None
        removed = await remove_snapshot(self.js, self.store, req.snapshot_id, data_dir=self.data_dir,
                                        tenant=S.img_request_tenant(msg.subject, S.SNAP_REMOVE))
        return Done(detail=f"removed {req.snapshot_id}: {removed['chunks']} chunks ({removed['bytes']} bytes) freed")

    async def teardown(self) -> None:
        for ep in self.endpoints:
            await ep.stop(self.grace_s)
        if self.store is not None:
            await self.store.close()

