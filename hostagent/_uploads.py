"""File uploads a tenant may make this host hold: a bound per tenant, on top of each sandbox's disk.

Every upload path (the SDK's ``files.write`` and ``write_files`` over the bus, the gateway's REST,
envd and signed upload URLs) ends as ``FileWrite`` ops on the sandbox's host agent, so the bound is
kept here: the bytes of a tenant's uploads held in its sandboxes on this host, counted when a write
arrives (before it is written: what is in flight counts), by the size each uploaded path reaches
(a chunk at an offset extends it; a write that truncates replaces it; the first chunk of an upload
whose writer knows its size, ``FileWrite.size``: the SDK's ``files.write``, the gateway's uploads
with a Content-Length, reserves all of it, so such an upload is refused whole or not at all), so
rewriting a file does not count twice. An upload that would take the tenant past ``HostAgentConfig.upload_max_bytes_per_tenant``
(flag ``--upload-max-bytes-per-tenant``, env ``DSEC_UPLOAD_MAX_BYTES_PER_TENANT``; 0: no limit) is
refused with ``quota_exceeded`` naming the limit, and nothing is written. A path's bytes are given
back when it is removed or renamed over through the files API, a write fails, or its sandbox ends
(files the sandbox's own processes delete stay counted until then: the count is an upper bound).

Cost on the hot path: an upload chunk pays two dict look-ups and an addition; other ops nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus.errors import QuotaExceeded

LIMIT = "upload_bytes_per_tenant"


class Uploads:
    def __init__(self, limit: int, live: Callable[[str], bool]) -> None:
        self.limit = limit  # 0: none
        self._live = live  # whether a sandbox id is still held here (an ended one's uploads are freed)
        self._paths: dict[str, dict[str, int]] = {}  # sandbox id -> uploaded path -> its size
        self._tenant_of: dict[str, str] = {}  # sandbox id -> its tenant
        self._used: dict[str, int] = {}  # tenant -> bytes
        self.refused = 0

    def charge(self, tenant: str, sandbox_id: str, path: str, offset: int, nbytes: int, truncate: bool, size: int = -1) -> int:
        """Count a write of ``nbytes`` at ``offset`` of ``path`` (``size``: the whole upload's, when
        known, reserved at its first chunk); the bytes it added (give them back with ``refund`` when
        the write fails). Raises QuotaExceeded, counting nothing."""
        paths = self._paths.get(sandbox_id)
        old = paths.get(path, 0) if paths is not None else 0
        end = offset + nbytes
        new = max(end, size) if truncate else max(old, end)
        delta = new - old
        used = self._used.get(tenant, 0)
        if delta > 0 and self.limit and used + delta > self.limit:
            used = self._prune(tenant)
            if used + delta > self.limit:
                self.refused += 1
                raise QuotaExceeded(
                    f"this upload would add {delta} bytes to the {used} the uploads of tenant {tenant!r} hold on this host: that passes "
                    f"the per-tenant upload limit of {self.limit} bytes (--upload-max-bytes-per-tenant)",
                    limit=LIMIT, max=str(self.limit), used=str(used), wanted=str(delta),
                )
        if paths is None:
            paths = self._paths[sandbox_id] = {}
            self._tenant_of[sandbox_id] = tenant
        paths[path] = new
        self._used[tenant] = used + delta
        return delta

    def refund(self, sandbox_id: str, path: str, delta: int) -> None:
        paths = self._paths.get(sandbox_id)
        if paths is None or path not in paths or not delta:
            return
        paths[path] -= delta
        t = self._tenant_of[sandbox_id]
        self._used[t] = self._used.get(t, 0) - delta

    def removed(self, sandbox_id: str, path: str) -> None:
        """``path`` was removed (or renamed away) through the files API: its bytes are free again."""
        paths = self._paths.get(sandbox_id)
        if paths is None:
            return
        size = paths.pop(path, 0)
        prefix = path.rstrip("/") + "/"  # a directory: everything uploaded under it
        for p in [p for p in paths if p.startswith(prefix)]:
            size += paths.pop(p)
        t = self._tenant_of[sandbox_id]
        self._used[t] = self._used.get(t, 0) - size

    def renamed(self, sandbox_id: str, src: str, dst: str) -> None:
        """The uploaded ``src`` is ``dst`` now (whatever ``dst`` held before is gone)."""
        paths = self._paths.get(sandbox_id)
        if paths is None or src not in paths:
            if paths is not None and dst in paths:
                self.removed(sandbox_id, dst)
            return
        size = paths.pop(src)
        self.removed(sandbox_id, dst)
        paths[dst] = size

    def _prune(self, tenant: str) -> int:
        """Free the uploads of the tenant's sandboxes that ended; what it holds then."""
        for sid in [s for s, t in self._tenant_of.items() if t == tenant and not self._live(s)]:
            self.ended(sid)
        return self._used.get(tenant, 0)

    def ended(self, sandbox_id: str) -> None:
        paths = self._paths.pop(sandbox_id, None)
        t = self._tenant_of.pop(sandbox_id, None)
        if paths is None or t is None:
            return
        left = self._used.get(t, 0) - sum(paths.values())
        if left > 0:
            self._used[t] = left
        else:
            self._used.pop(t, None)

    def by_tenant(self) -> dict[str, int]:
        """What each tenant's uploads hold here (the heartbeat and /metrics), ended sandboxes freed."""
        for sid in [s for s in self._tenant_of if not self._live(s)]:
            self.ended(sid)
        return {t: b for t, b in self._used.items() if b > 0}


def register_metrics(reg: Any, uploads: Uploads) -> None:
    """``dsec_upload_bytes{tenant}`` (what each tenant's uploads hold on this host) at each scrape;
    the limit is ``dsec_storage_limit_bytes{limit="upload_bytes_per_tenant"}`` (hostagent._storage)."""
    g = reg.gauge("dsec_upload_bytes", "Bytes of file uploads held in sandboxes on this host, by tenant", ["tenant"])
    lim = reg.gauge("dsec_storage_limit_bytes", "What a sandbox may make this host store, by limit (0: none)", ["limit"])

    def fill() -> None:
        g.clear()
        for tenant, nbytes in uploads.by_tenant().items():
            g.set(nbytes, tenant=tenant)
        lim.set(uploads.limit, limit=LIMIT)

    reg.collector(fill)


__all__ = ["LIMIT", "Uploads", "register_metrics"]
