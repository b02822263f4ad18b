"""The blob store: content-addressed chunks and layer records.

Two backends behind one small async interface:

* ``NatsBlobStore`` - a JetStream object store (bucket ``bus.subjects.OBJ_CHUNKS``), the default;
* ``S3BlobStore`` - any S3-compatible bucket (tested against SeaweedFS), selected with
  ``DSEC_BLOB_STORE=s3://bucket[/prefix]`` and the endpoint / credential variables below.

Keys: ``chunks/<sha256 hex>`` (raw chunk bytes) and ``layers/<sha256 hex>`` (a msgpack ``LayerRef``).

A store that cannot be reached (refused, timed out, 5xx, no JetStream responder) raises
``BlobStoreUnavailable`` from ``get``/``exists``/``get_layer``/``put`` (so a snapshot or a build fails
typed too): the lazy loader waits for it or fails
at once by its configuration (``imaged._cache``), and never mistakes it for a missing object.

S3 configuration (first one set wins):
  endpoint    DSEC_S3_ENDPOINT, AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL
  access key  DSEC_S3_ACCESS_KEY, AWS_ACCESS_KEY_ID          (default "dsec")
  secret key  DSEC_S3_SECRET_KEY, AWS_SECRET_ACCESS_KEY      (default "dsec")
  region      DSEC_S3_REGION, AWS_REGION, AWS_DEFAULT_REGION (default "us-east-1")
"""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
import nats.errors as nats_errors
from nats.js.errors import APIError, BucketNotFoundError, NotFoundError, ObjectNotFoundError, ServiceUnavailableError

from bus import subjects as S
from bus.errors import BlobStoreUnavailable, ImageError, NoSpace
from bus.messages import LayerRef
from bus.runtime import nc_of

from ._util import digest_hex


class BlobNotFound(ImageError):
    """A chunk or layer record is not in the blob store."""

    code = "image_error"


def chunk_key(digest: str) -> str:
    return f"chunks/{digest_hex(digest)}"


def layer_key(digest: str) -> str:
    return f"layers/{digest_hex(digest)}"


_layer_dec = msgspec.msgpack.Decoder(LayerRef)
_enc = msgspec.msgpack.Encoder()


class BlobStore:
    """Async key -> bytes store. Subclasses implement the five primitives."""

    kind = "abstract"
    url = ""

    async def exists(self, key: str) -> bool:
        raise NotImplementedError

    async def put(self, key: str, data: bytes) -> None:
        raise NotImplementedError

    async def get(self, key: str) -> bytes:
        """The object's bytes; raises ``BlobNotFound``."""
        raise NotImplementedError

    async def delete(self, key: str) -> None:
        raise NotImplementedError

    async def keys(self, prefix: str = "") -> list[str]:
        raise NotImplementedError

    async def close(self) -> None:
        return None

    # --- layer records ---------------------------------------------------------------
    async def put_layer(self, ref: LayerRef) -> None:
        rec = msgspec.structs.replace(ref, role="", path="")
        await self.put(layer_key(ref.digest), _enc.encode(rec))

    async def get_layer(self, digest: str) -> LayerRef | None:
        try:
            raw = await self.get(layer_key(digest))
        except BlobNotFound:
            return None
        try:
            return _layer_dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None


# What a JetStream object store that is away looks like (its stream has no leader, the connection is
# gone or reconnecting): nothing says the object is missing.
_NATS_AWAY = (
    nats_errors.TimeoutError, nats_errors.NoRespondersError, nats_errors.ConnectionClosedError,
    nats_errors.ConnectionReconnectingError, nats_errors.StaleConnectionError, ServiceUnavailableError, asyncio.TimeoutError,
)


class NatsBlobStore(BlobStore):
    """Chunks as objects in a JetStream object store."""

    kind = "nats"

    def __init__(self, js: JetStreamContext, bucket: str = S.OBJ_CHUNKS, *, storage: StorageType = StorageType.FILE):
        self.js = js
        self.bucket = bucket
        self.storage = storage
        self.url = f"nats-obj://{bucket}"
        self._obs: Any = None
        self._lock = asyncio.Lock()

    def _away(self, exc: BaseException) -> BlobStoreUnavailable:
        return BlobStoreUnavailable(f"object store {self.bucket}: {type(exc).__name__}: {exc}", store=self.url)

    async def _store(self) -> Any:
        if self._obs is None:
            async with self._lock:
                if self._obs is None:
                    try:
                        self._obs = await self.js.object_store(self.bucket)
                    except (BucketNotFoundError, NotFoundError):
                        self._obs = await self.js.create_object_store(
                            self.bucket,
                            config=ObjectStoreConfig(
                                description="dsec image chunks (content-addressed)", storage=self.storage
                            ),
                        )
        return self._obs

    async def exists(self, key: str) -> bool:
        try:
            obs = await self._store()
            await obs.get_info(key)
            return True
        except (ObjectNotFoundError, NotFoundError):
            return False
        except _NATS_AWAY as exc:
            raise self._away(exc) from None

    def _max_msg(self) -> int:
        try:
            return max(128 * 1024, int(nc_of(self.js).max_payload) - 8192)
        except Exception:  # noqa: BLE001
            return 128 * 1024

    async def put(self, key: str, data: bytes) -> None:
        """Store one object; a chunk that fits in one NATS message is stored as one message."""
        try:
            obs = await self._store()
        except _NATS_AWAY as exc:
            raise self._away(exc) from None
        size = min(max(len(data), 1), self._max_msg())
        meta = ObjectMeta(name=key, options=ObjectMetaOptions(max_chunk_size=max(size, 128 * 1024)))
        try:
            await obs.put(key, bytes(data), meta=meta)
        except APIError as exc:
            # JetStream refuses a full bucket (its max_bytes) or a server out of storage -- with a 503,
            # like a stream that is away: a typed no_space for the caller, not "unavailable"
            why = exc.description or ""
            if "maximum bytes" in why or "insufficient resources" in why:
                raise NoSpace(f"object store {self.bucket} is full: {why}", bucket=self.bucket) from None
            if isinstance(exc, _NATS_AWAY):
                raise self._away(exc) from None
            raise
        except _NATS_AWAY as exc:
            raise self._away(exc) from None

    async def get(self, key: str) -> bytes:
        """The object's bytes. Single-message objects take two direct gets (meta, data) instead of an
        ordered consumer; callers verify content against the chunk digest anyway."""
        try:
            return await self._get(key)
        except _NATS_AWAY as exc:
            raise self._away(exc) from None

    async def _get(self, key: str) -> bytes:
        obs = await self._store()
        try:
            info = await obs.get_info(key)
        except (ObjectNotFoundError, NotFoundError):
            raise BlobNotFound(f"not in object store {self.bucket}: {key}", key=key) from None
        if info.chunks == 1 and info.size and info.nuid and not info.is_link():
            try:
                msg = await self.js.get_last_msg(f"OBJ_{self.bucket}", f"$O.{self.bucket}.C.{info.nuid}", direct=True)
                if msg.data is not None and len(msg.data) == info.size:
                    return bytes(msg.data)
            except NotFoundError:
                pass  # replaced meanwhile: take the slow path
        try:
            res = await obs.get(key)
        except (ObjectNotFoundError, NotFoundError):
            raise BlobNotFound(f"not in object store {self.bucket}: {key}", key=key) from None
        return bytes(res.data or b"")

    async def delete(self, key: str) -> None:
        obs = await self._store()
        try:
            await obs.delete(key)
        except (ObjectNotFoundError, NotFoundError):
            pass

    async def keys(self, prefix: str = "") -> list[str]:
        obs = await self._store()
        try:
            infos = await obs.list(ignore_deletes=True)
        except NotFoundError:
            return []
        return sorted(i.name for i in infos if not i.deleted and i.name.startswith(prefix))


class S3BlobStore(BlobStore):
    """Chunks as objects in an S3-compatible bucket (boto3 in a small thread pool)."""

    kind = "s3"

    def __init__(
        self,
        bucket: str,
        *,
        prefix: str = "",
        endpoint: str | None = None,
        access_key: str | None = None,
        secret_key: str | None = None,
        region: str | None = None,
        create_bucket: bool = True,
        max_workers: int = 8,
    ) -> None:
        try:
            import boto3
            import botocore.config
        except ImportError as exc:  # pragma: no cover - optional dependency
            raise ImageError("the S3 blob store needs boto3 (pip install boto3)") from exc
        env = os.environ
        self.bucket = bucket
        self.prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
        self.endpoint = endpoint or env.get("DSEC_S3_ENDPOINT") or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
        self.url = f"s3://{bucket}/{self.prefix}"
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=access_key or env.get("DSEC_S3_ACCESS_KEY") or env.get("AWS_ACCESS_KEY_ID") or "dsec",
            aws_secret_access_key=secret_key or env.get("DSEC_S3_SECRET_KEY") or env.get("AWS_SECRET_ACCESS_KEY") or "dsec",
            region_name=region or env.get("DSEC_S3_REGION") or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1",
            config=botocore.config.Config(
                s3={"addressing_style": "path"},
                retries={"max_attempts": 2, "mode": "standard"},
                connect_timeout=5,
                read_timeout=30,
                max_pool_connections=max_workers * 2,
            ),
        )
        self._pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="dsec-s3")
        self._create_bucket = create_bucket
        self._ready = False
        self._lock = asyncio.Lock()

    async def _run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def _is_missing(self, exc: Exception) -> bool:
        resp = getattr(exc, "response", None) or {}
        code = str(resp.get("Error", {}).get("Code", ""))
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket") or status == 404

    def _away(self, exc: Exception) -> BlobStoreUnavailable | None:
        """The typed error when ``exc`` says the store is away (refused, timed out, 5xx, throttled)."""
        import botocore.exceptions as bx

        resp = getattr(exc, "response", None) or {}
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        code = str(resp.get("Error", {}).get("Code", ""))
        if isinstance(exc, (bx.HTTPClientError, bx.ConnectionError, OSError)) or status >= 500 or code in ("SlowDown", "ServiceUnavailable"):
            return BlobStoreUnavailable(f"{self.url} ({self.endpoint or 'AWS'}): {type(exc).__name__}: {exc}", store=self.url)
        return None

    async def _ensure(self) -> None:
        if self._ready:
            return
        async with self._lock:
            if self._ready:
                return
            try:
                await self._run(self._client.head_bucket, Bucket=self.bucket)
            except Exception as exc:  # noqa: BLE001 - botocore's ClientError
                away = self._away(exc)
                if away is not None:
                    raise away from None
                if not (self._create_bucket and self._is_missing(exc)):
                    raise ImageError(f"S3 bucket {self.bucket} not reachable: {exc}") from exc
                try:
                    await self._run(self._client.create_bucket, Bucket=self.bucket)
                except Exception as exc2:  # noqa: BLE001 - created meanwhile by someone else is fine
                    if "BucketAlready" not in str(exc2):
                        raise ImageError(f"cannot create S3 bucket {self.bucket}: {exc2}") from exc2
            self._ready = True

    async def exists(self, key: str) -> bool:
        await self._ensure()
        try:
            await self._run(self._client.head_object, Bucket=self.bucket, Key=self.prefix + key)
            return True
        except Exception as exc:  # noqa: BLE001
            if self._is_missing(exc):
                return False
            raise self._away(exc) or exc from None

    async def put(self, key: str, data: bytes) -> None:
        await self._ensure()
        try:
            await self._run(self._client.put_object, Bucket=self.bucket, Key=self.prefix + key, Body=bytes(data))
        except Exception as exc:  # noqa: BLE001 - botocore's
            raise self._away(exc) or exc from None

    async def get(self, key: str) -> bytes:
        await self._ensure()

        def _get() -> bytes:
            resp = self._client.get_object(Bucket=self.bucket, Key=self.prefix + key)
            body: bytes = resp["Body"].read()
            return body

        try:
            data: bytes = await self._run(_get)
            return data
        except Exception as exc:  # noqa: BLE001
            if self._is_missing(exc):
                raise BlobNotFound(f"not in {self.url}: {key}", key=key) from None
            raise self._away(exc) or exc from None

    async def delete(self, key: str) -> None:
        await self._ensure()
        await self._run(self._client.delete_object, Bucket=self.bucket, Key=self.prefix + key)

    async def keys(self, prefix: str = "") -> list[str]:
        await self._ensure()

        def _list() -> list[str]:
            out: list[str] = []
            pag = self._client.get_paginator("list_objects_v2")
            for page in pag.paginate(Bucket=self.bucket, Prefix=self.prefix + prefix):
                for o in page.get("Contents", []) or []:
                    out.append(o["Key"][len(self.prefix) :])
            return sorted(out)

        keys: list[str] = await self._run(_list)
        return keys

    async def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def blob_store_url(url: str | None = None) -> str:
    """The configured store: the argument, else env ``DSEC_BLOB_STORE``, else ``nats``."""
    return url or os.environ.get("DSEC_BLOB_STORE") or "nats"


def open_blob_store(js: JetStreamContext | None, url: str | None = None) -> BlobStore:
    """Open the blob store named by ``url`` / ``DSEC_BLOB_STORE``: ``nats`` (default),
    ``nats-obj://<bucket>`` (a JetStream object store), ``s3://bucket[/prefix]``."""
    u = blob_store_url(url)
    if u.startswith("s3://"):
        rest = u[5:]
        bucket, _, prefix = rest.partition("/")
        if not bucket:
            raise ImageError(f"bad blob store url {u!r}: expected s3://bucket[/prefix]")
        return S3BlobStore(bucket, prefix=prefix)
    if u in ("nats", "") or u.startswith("nats-obj://"):
        bucket = u.split("://", 1)[1] if "://" in u else S.OBJ_CHUNKS
        if js is None:
            raise ImageError("the NATS blob store needs a JetStream connection")
        return NatsBlobStore(js, bucket or S.OBJ_CHUNKS)
    raise ImageError(f"unknown blob store {u!r} (use 'nats' or 's3://bucket[/prefix]')")
