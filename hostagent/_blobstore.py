"""What this host's lazy loader says of the blob store: whether a create that failed did so because
the store is away and the host does not hold the layers it needed (``blob_store_unavailable``),
whatever backend and step noticed it. The loader writes its ``daemon.json`` (store state) before it
fails the read, and keeps an index of the layers it holds (``index.json``), both under
``<data dir>/cache`` (imaged/lazy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from bus.errors import BlobStoreUnavailable
from bus.messages import LayerRef


def _alive(pid: object) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def store_unavailable(data_dir: Path, refs: list[LayerRef]) -> BlobStoreUnavailable | None:
    """Why a create on ``refs`` failed, when the lazy loader of the host at ``data_dir`` says the blob
    store is away and some of them come through it without being all on this host; None otherwise."""
    cache = data_dir / "cache"
    try:
        info = json.loads((cache / "daemon.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or info.get("store_available", True) or not _alive(info.get("pid")):
        return None
    try:
        index = json.loads((cache / "index.json").read_text())
    except (OSError, ValueError):
        index = {}
    lazy = [r.digest for r in refs if r.kind == "erofs" and not (r.path and os.path.exists(r.path))]
    missing = [d for d in lazy if not (index.get(d) or {}).get("complete")]
    if not missing:
        return None
    return BlobStoreUnavailable(
        f"the blob store {info.get('store', '')} is unavailable ({info.get('store_error') or 'unreachable'}) and this host does not "
        f"hold layer(s) {', '.join(missing)}; cached templates still start",
        layers=",".join(missing), store=str(info.get("store", "")), wait_s=info.get("store_wait_s"),
    )


__all__ = ["store_unavailable"]
