"""The image service's payloads live in ``bus.messages``; this module keeps the local names."""

from bus.codec import HOST_IMG_STATS as HOST_STATS
from bus.codec import HOST_IMG_STATS_REQ as HOST_STATS_REQUEST
from bus.codec import IMG_BUILD_REQ, IMG_LIST_REQ, IMG_REMOVE_REQ, IMG_STATS_REQ
from bus.messages import (
    BuildImage,
    HostImageStats,
    HostImageStatsRequest,
    ImageBuilt,
    ImageList,
    ImageStats,
    ImageStatsRequest,
    LayerCacheStats,
    ListImages,
    RemoveImage,
)

__all__ = [
    "HOST_STATS", "HOST_STATS_REQUEST", "IMG_BUILD_REQ", "IMG_LIST_REQ", "IMG_REMOVE_REQ", "IMG_STATS_REQ",
    "BuildImage", "HostImageStats", "HostImageStatsRequest", "ImageBuilt", "ImageList", "ImageStats",
    "ImageStatsRequest", "LayerCacheStats", "ListImages", "RemoveImage",
]
