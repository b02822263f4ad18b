"""What a host has cached: from its lazy loader over NATS, or from the loader's index file."""

from __future__ import annotations

import os
from typing import Any

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from bus import codec
from bus import subjects as S
from bus.errors import Unavailable
from bus.runtime import nc_of

from ._manifests import require_manifest
from ._messages import HostImageStats, HostImageStatsRequest
from ._util import data_dir as _data_dir
from ._util import digest_hex, host_id as _host_id, read_json


def read_cache_index(data_dir: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """``<data_dir>/cache/index.json``: {"sha256:<hex>": {"total_bytes", "fetched_bytes", ...}} ({} if none)."""
    idx = read_json(_data_dir(data_dir) / "cache" / "index.json", {})
    return idx if isinstance(idx, dict) else {}


async def host_image_stats(nc: NATS, host_id: str | None = None, *, digests: list[str] | None = None, timeout: float = 2.0) -> HostImageStats:
    """Ask a host's lazy loader for its cache stats (core request on ``host_img_stats(host_id)``)."""
    hid = _host_id(host_id)
    try:
        msg = await nc.request(S.host_img_stats(hid), codec.encode(HostImageStatsRequest(digests=digests or [])), timeout=timeout)
    except Exception as exc:  # noqa: BLE001 - no responder / timeout
        raise Unavailable(f"no lazy loader answers for host {hid}: {exc}") from None
    return codec.decode_reply(msg.data, HostImageStats)


async def template_stats(
    js: JetStreamContext,
    name: str,
    *,
    host_id: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    timeout: float = 2.0,
) -> dict[str, Any]:
    """Per-layer and total ``total_bytes`` / ``fetched_bytes`` of template ``name`` in this host's cache.

    Asks the host's lazy loader over NATS; when it does not answer, reads its index file."""
    m = await require_manifest(js, name)
    hid = _host_id(host_id)
    per: dict[str, int] = {}
    source = "none"
    try:
        st = await host_image_stats(nc_of(js), hid, digests=[lay.digest for lay in m.layers], timeout=timeout)
        per = {digest_hex(ls.digest): ls.fetched_bytes for ls in st.layers}
        source = "nats"
    except Exception:  # noqa: BLE001 - fall back to the file
        idx = read_cache_index(data_dir)
        if idx:
            source = "file"
        for k, v in idx.items():
            try:
                per[digest_hex(k)] = int(v.get("fetched_bytes", 0))
            except (ValueError, AttributeError):
                continue
    layers: list[dict[str, Any]] = []
    for lay in m.layers:
        layers.append(
            {
                "role": lay.role,
                "digest": lay.digest,
                "total_bytes": lay.size,
                "fetched_bytes": per.get(digest_hex(lay.digest), 0),
            }
        )
    total = sum(x["total_bytes"] for x in layers)
    fetched = sum(x["fetched_bytes"] for x in layers)
    return {
        "name": name,
        "host_id": hid,
        "source": source,
        "total_bytes": total,
        "fetched_bytes": fetched,
        "fetched_ratio": round(fetched / total, 4) if total else 0.0,
        "layers": layers,
    }
