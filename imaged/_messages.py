"""Local message types of the image service (candidates for ``bus/messages.py``; see the report).

They are msgpack-encoded msgspec Structs like every other payload on the bus.
"""

from __future__ import annotations

import msgspec
from msgspec import Struct

from bus.messages import LayerRef, TemplateManifest


class LayerCacheStats(Struct, kw_only=True):
    """One layer as this host's lazy loader sees it (a nested value)."""

    digest: str  # sha256:<hex>
    total_bytes: int
    fetched_bytes: int  # bytes of this layer's chunks present in the local cache
    chunks: int = 0
    cached_chunks: int = 0


class HostImageStatsRequest(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.host_img_stats(host_id)``; empty digests = every known layer."""

    digests: list[str] = []


class HostImageStats(Struct, kw_only=True, tag=True):
    """Reply from a host's lazy loader (core request/reply on ``host_img_stats(host_id)``)."""

    host_id: str
    at: float
    mode: str = "lazy"  # lazy | prefetch
    pid: int = 0
    layers: list[LayerCacheStats] = []
    cache_bytes: int = 0  # bytes of chunks on local disk
    max_cache_bytes: int = 0
    downloaded_bytes: int = 0  # fetched from the blob store since the daemon started
    cache_written_bytes: int = 0  # written to the local cache since the daemon started
    evicted_bytes: int = 0
    fetch_failures: int = 0
    corrupt_chunks: int = 0


HOST_STATS_REQUEST = msgspec.msgpack.Decoder(HostImageStatsRequest)
HOST_STATS = msgspec.msgpack.Decoder(HostImageStats)


# --- the image service's core request/reply subjects (dsec.img.*) ------------------------------------
class ListImages(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_LIST``."""


class ImageList(Struct, kw_only=True, tag=True):
    templates: list[TemplateManifest] = []


class BuildImage(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_BUILD``: sources are paths on the image service's machine,
    ``layer:<digest>`` or ``template:<name>``."""

    name: str
    base: str
    workspace: str = ""
    toolkit: str = ""
    description: str = ""


class ImageBuilt(Struct, kw_only=True, tag=True):
    manifest: TemplateManifest
    uploaded_bytes: int = 0
    seconds: float = 0.0


class RemoveImage(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_REMOVE``."""

    name: str
    prune: bool = False


class ImageStatsRequest(Struct, kw_only=True, tag=True):
    """Request on ``bus.subjects.IMG_STATS``: a template's size and layers."""

    name: str


class ImageStats(Struct, kw_only=True, tag=True):
    name: str
    total_bytes: int
    layers: list[LayerRef] = []


IMG_LIST_REQ = msgspec.msgpack.Decoder(ListImages)
IMG_BUILD_REQ = msgspec.msgpack.Decoder(BuildImage)
IMG_REMOVE_REQ = msgspec.msgpack.Decoder(RemoveImage)
IMG_STATS_REQ = msgspec.msgpack.Decoder(ImageStatsRequest)
