"""imaged: layered EROFS images, a chunked content-addressed blob store, and the host-side lazy loader.

Public surface (everything else is internal, in ``_modules``):

* building: ``ImageBuilder``, ``build_template``, ``ensure_base_template``, ``build_python_template``
* templates: ``get_template``, ``list_templates``, ``remove_template``, ``prune_unreferenced``
* blob store: ``open_blob_store`` (``DSEC_BLOB_STORE``: ``nats`` or ``s3://bucket[/prefix]``),
  ``BlobStore``, ``NatsBlobStore``, ``S3BlobStore``
* sources: ``parse_source`` (a directory, a tarball, an OCI layout, ``layer:<digest>``, ``template:<name>``)
* host side: ``python -m imaged.lazy`` (FUSE); ``read_cache_index`` / ``host_image_stats`` to read what
  a host has cached.

The lazy loader (``imaged.lazy``) speaks the FUSE protocol itself (``imaged._fuse``): no libfuse.
"""

from ._build import (
    BuildResult,
    ImageBuilder,
    LayerBuild,
    build_template,
    ensure_base_template,
    get_template,
    list_templates,
    prune_unreferenced,
    remove_template,
)
from ._debootstrap import build_python_template, python_rootfs
from ._erofs import EROFS_UUID, mkfs_erofs
from ._messages import HostImageStats, HostImageStatsRequest, LayerCacheStats
from ._sources import Source, apply_tar, parse_source
from ._stats import host_image_stats, read_cache_index, template_stats
from ._store import BlobNotFound, BlobStore, NatsBlobStore, S3BlobStore, open_blob_store
from ._util import DEFAULT_CHUNK_SIZE

__all__ = [
    "BuildResult",
    "ImageBuilder",
    "LayerBuild",
    "build_template",
    "ensure_base_template",
    "build_python_template",
    "python_rootfs",
    "get_template",
    "list_templates",
    "remove_template",
    "prune_unreferenced",
    "EROFS_UUID",
    "mkfs_erofs",
    "Source",
    "parse_source",
    "apply_tar",
    "BlobStore",
    "BlobNotFound",
    "NatsBlobStore",
    "S3BlobStore",
    "open_blob_store",
    "DEFAULT_CHUNK_SIZE",
    "HostImageStats",
    "HostImageStatsRequest",
    "LayerCacheStats",
    "host_image_stats",
    "read_cache_index",
    "template_stats",
]
