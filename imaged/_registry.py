"""A client of the OCI distribution API (registry v2): image references, mirrors, auth, manifests by
tag or digest, platform selection in an index, and digest-verified blob downloads.

Why not containerd: imaged is its own process (the host agent's containerd is private to its data
dir), and containerd 1.6 pulls client-side (its resolver lives in the Go client, not in the gRPC API).
So imaged speaks the registry protocol itself, which also lets it skip fetching a layer it has
already converted (a layer is keyed by its OCI digest; see ``imaged._oci``).

Configuration (environment, or the ``Registry`` constructor):

* ``DSEC_REGISTRY_MIRRORS`` — ``docker.io=127.0.0.1:5000,ghcr.io=mirror.local`` : the host a
  registry's pulls go to instead (an air-gapped cluster maps public registries to its own).
* ``DSEC_REGISTRY_INSECURE`` — hosts spoken to over plain HTTP (loopback hosts always are).
* ``DSEC_REGISTRY_AUTH_FILE`` — a Docker ``config.json`` / containers ``auth.json``
  (``{"auths": {host: {"auth": base64(user:pass)}}}``); default ``~/.docker/config.json``.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform as _platform
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bus.errors import ImageError, ImageNotFound, InvalidArgument, RegistryUnavailable

DOCKER_HUB = "docker.io"
_HUB_API = "registry-1.docker.io"

MANIFEST_TYPES = (
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
INDEX_TYPES = MANIFEST_TYPES[:2]

_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_REPO = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*$")
_TAG = re.compile(r"^[\w][\w.-]{0,127}$")


@dataclass(frozen=True)
class ImageRef:
    """A parsed image reference: ``registry/repository`` plus a tag and/or a digest."""

    registry: str
    repository: str
    tag: str = ""
    digest: str = ""

    @property
    def reference(self) -> str:
        """What to ask the registry's manifests endpoint for (the digest wins over the tag)."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        s = f"{self.registry}/{self.repository}"
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def parse_ref(ref: str) -> ImageRef:
    """``busybox`` -> ``docker.io/library/busybox:latest``; ``host:5000/a/b:t@sha256:...`` as written."""
    s = (ref or "").strip()
    if not s or any(c.isspace() for c in s):
        raise InvalidArgument(f"bad image reference {ref!r}")
    digest = ""
    if "@" in s:
        s, _, digest = s.partition("@")
        if not _DIGEST.match(digest):
            raise InvalidArgument(f"bad digest in image reference {ref!r} (want sha256:<64 hex>)")
    first, sep, rest = s.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        registry, path = first, rest
    else:
        registry, path = DOCKER_HUB, s
    tag = ""
    last = path.rsplit("/", 1)[-1]
    if ":" in last:
        path, _, tag = path.rpartition(":")
        if not _TAG.match(tag):
            raise InvalidArgument(f"bad tag in image reference {ref!r}")
    if registry in (DOCKER_HUB, "index.docker.io") and "/" not in path:
        path = f"library/{path}"
    if registry == "index.docker.io":
        registry = DOCKER_HUB
    if not _REPO.match(path):
        raise InvalidArgument(f"bad repository in image reference {ref!r}")
    if not tag and not digest:
        tag = "latest"
    return ImageRef(registry=registry, repository=path, tag=tag, digest=digest)


def default_platform() -> tuple[str, str, str]:
    arch = {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm"}.get(_platform.machine(), _platform.machine())
    return "linux", arch, "v7" if arch == "arm" else ""


def parse_platform(spec: str) -> tuple[str, str, str]:
    if not spec:
        return default_platform()
    parts = spec.split("/")
    if len(parts) not in (2, 3) or not all(parts):
        raise InvalidArgument(f"bad platform {spec!r} (want os/arch[/variant])")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else ""


def _parse_map(value: str) -> dict[str, str]:
    out = {}
    for item in re.split(r"[,\s;]+", value or ""):
        if "=" in item:
            k, _, v = item.partition("=")
            if k.strip() and v.strip():
                out[k.strip()] = v.strip()
    return out


def _is_loopback(host: str) -> bool:
    h = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return h in ("localhost", "::1", "[::1]") or h.startswith("127.")


@dataclass
class Manifest:
    """An image manifest picked for one platform, with its config (parsed)."""

    digest: str  # of the image manifest (not of an index that pointed at it)
    layers: list[dict[str, Any]]
    config: dict[str, Any]
    index_digest: str = ""


@dataclass
class Registry:
    """Talks to registries for imaged. One instance per pull (it caches bearer tokens per scope)."""

    mirrors: dict[str, str] = field(default_factory=lambda: _parse_map(os.environ.get("DSEC_REGISTRY_MIRRORS", "")))
    insecure: set[str] = field(default_factory=lambda: {h for h in re.split(r"[,\s]+", os.environ.get("DSEC_REGISTRY_INSECURE", "")) if h})
    auth_file: str = field(default_factory=lambda: os.environ.get("DSEC_REGISTRY_AUTH_FILE", "") or str(Path.home() / ".docker" / "config.json"))
    timeout_s: float = 30.0
    _tokens: dict[str, str] = field(default_factory=dict)
    _client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> Registry:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=min(10.0, self.timeout_s)), follow_redirects=True)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    # --- endpoints ---------------------------------------------------------------------------
    def host_of(self, ref: ImageRef) -> str:
        host = self.mirrors.get(ref.registry)
        if host:
            return host
        return _HUB_API if ref.registry == DOCKER_HUB else ref.registry

    def _base(self, ref: ImageRef) -> str:
        host = self.host_of(ref)
        scheme = "http" if host in self.insecure or ref.registry in self.insecure or _is_loopback(host) else "https"
        return f"{scheme}://{host}/v2/{ref.repository}"

    def _credentials(self, host: str) -> tuple[str, str] | None:
        try:
            auths = json.loads(Path(self.auth_file).read_text()).get("auths") or {}
        except (OSError, ValueError, AttributeError):
            return None
        for key in (host, f"https://{host}", f"http://{host}", *(["https://index.docker.io/v1/"] if host == _HUB_API else [])):
            entry = auths.get(key)
            if isinstance(entry, dict) and entry.get("auth"):
                try:
                    user, _, pw = base64.b64decode(entry["auth"]).decode().partition(":")
                    return user, pw
                except (ValueError, UnicodeDecodeError):
                    return None
        return None

    # --- requests ----------------------------------------------------------------------------
    async def _request(self, ref: ImageRef, path: str, accept: str = "", stream: bool = False) -> httpx.Response:
        assert self._client is not None, "use `async with Registry() as r`"
        url = f"{self._base(ref)}/{path}"
        host = self.host_of(ref)
        headers = {"Accept": accept} if accept else {}
        for attempt in range(2):
            tok = self._tokens.get(ref.repository)
            if tok:
                headers["Authorization"] = tok
            try:
                req = self._client.build_request("GET", url, headers=headers)
                resp = await self._client.send(req, stream=stream)
            except httpx.TimeoutException as exc:
                raise RegistryUnavailable(f"registry {host} timed out: {exc!r}", registry=host, ref=str(ref)) from None
            except httpx.HTTPError as exc:
                raise RegistryUnavailable(f"registry {host} unreachable: {exc!r}", registry=host, ref=str(ref)) from None
            if resp.status_code == 401 and attempt == 0:
                challenge = resp.headers.get("www-authenticate", "")
                await resp.aclose()
                self._tokens[ref.repository] = await self._authorize(ref, host, challenge)
                continue
            return resp
        return resp

    async def _authorize(self, ref: ImageRef, host: str, challenge: str) -> str:
        assert self._client is not None
        creds = self._credentials(host)
        scheme, _, params_s = challenge.partition(" ")
        params = dict(re.findall(r'(\w+)="([^"]*)"', params_s))
        if scheme.lower() == "basic":
            if creds is None:
                raise ImageError(f"registry {host} wants credentials for {ref} (none in {self.auth_file})", registry=host, status=401)
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme.lower() != "bearer" or "realm" not in params:
            raise ImageError(f"registry {host} sent an auth challenge dsec does not speak: {challenge!r}", registry=host, status=401)
        query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
        if params.get("service"):
            query["service"] = params["service"]
        try:
            resp = await self._client.get(params["realm"], params=query, auth=creds)
        except httpx.HTTPError as exc:
            raise RegistryUnavailable(f"token service of {host} unreachable: {exc!r}", registry=host) from None
        if resp.status_code != 200:
            raise ImageError(f"registry {host} refused a token for {ref}: HTTP {resp.status_code}", registry=host, status=resp.status_code)
        body = resp.json()
        token = body.get("token") or body.get("access_token")
        if not token:
            raise ImageError(f"token service of {host} answered no token", registry=host)
        return f"Bearer {token}"

    def _fail(self, ref: ImageRef, resp: httpx.Response, what: str) -> None:
        host = self.host_of(ref)
        code = resp.status_code
        if code == 404:
            raise ImageNotFound(f"{what} not found in {host}: {ref}", ref=str(ref), registry=host)
        if code in (401, 403):
            raise ImageError(f"registry {host} denied {what} of {ref}: HTTP {code}", ref=str(ref), registry=host, status=code)
        if code >= 500 or code == 429:
            raise RegistryUnavailable(f"registry {host} failed on {what} of {ref}: HTTP {code}", ref=str(ref), registry=host, status=code)
        raise ImageError(f"registry {host} answered HTTP {code} to {what} of {ref}", ref=str(ref), registry=host, status=code)

    async def _get_json(self, ref: ImageRef, path: str, accept: str, want_digest: str = "") -> tuple[str, dict[str, Any], str]:
        resp = await self._request(ref, path, accept)
        if resp.status_code != 200:
            self._fail(ref, resp, "manifest" if path.startswith("manifests/") else "blob")
        body = resp.content
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if want_digest and digest != want_digest:
            raise ImageError(f"{path} of {ref} does not match its digest ({digest} != {want_digest})", ref=str(ref))
        try:
            doc = json.loads(body)
        except ValueError:
            raise ImageError(f"{path} of {ref} is not JSON", ref=str(ref)) from None
        if not isinstance(doc, dict):
            raise ImageError(f"{path} of {ref} is not a JSON object", ref=str(ref))
        return digest, doc, resp.headers.get("content-type", "")

    # --- the API imaged uses -------------------------------------------------------------------
    async def manifest(self, ref: ImageRef, platform: str = "") -> Manifest:
        """The image manifest of ``ref`` for ``platform`` (an index is resolved), and its config."""
        want = parse_platform(platform)
        reference = ref.reference
        digest, doc, ctype = await self._get_json(ref, f"manifests/{reference}", ",".join(MANIFEST_TYPES), ref.digest)
        index_digest = ""
        if doc.get("mediaType", ctype.split(";")[0]) in INDEX_TYPES or "manifests" in doc:
            index_digest = digest
            pick = _pick_platform(doc.get("manifests") or [], want, str(ref))
            digest, doc, _ = await self._get_json(ref, f"manifests/{pick['digest']}", ",".join(MANIFEST_TYPES[2:]), pick["digest"])
        if doc.get("schemaVersion") != 2 or not isinstance(doc.get("config"), dict):
            raise ImageError(f"{ref}: unsupported manifest (schema {doc.get('schemaVersion')!r}, type {doc.get('mediaType')!r})", ref=str(ref))
        cfg_digest = doc["config"].get("digest", "")
        if not _DIGEST.match(cfg_digest):
            raise ImageError(f"{ref}: bad config digest {cfg_digest!r}", ref=str(ref))
        _, config, _ = await self._get_json(ref, f"blobs/{cfg_digest}", "", cfg_digest)
        layers = [lay for lay in doc.get("layers") or [] if isinstance(lay, dict)]
        for lay in layers:
            if not _DIGEST.match(str(lay.get("digest", ""))):
                raise ImageError(f"{ref}: bad layer digest {lay.get('digest')!r}", ref=str(ref))
        return Manifest(digest=digest, layers=layers, config=config, index_digest=index_digest)

    async def fetch_blob(self, ref: ImageRef, digest: str, dest: str | os.PathLike[str]) -> int:
        """Download blob ``digest`` of ``ref``'s repository to ``dest``, verified; returns its size."""
        resp = await self._request(ref, f"blobs/{digest}", stream=True)
        try:
            if resp.status_code != 200:
                await resp.aread()
                self._fail(ref, resp, f"layer {digest}")
            h = hashlib.sha256()
            size = 0
            with open(dest, "wb") as out:
                try:
                    async for chunk in resp.aiter_bytes(1 << 20):
                        h.update(chunk)
                        out.write(chunk)
                        size += len(chunk)
                except httpx.HTTPError as exc:
                    raise RegistryUnavailable(f"download of {digest} from {self.host_of(ref)} broke: {exc!r}", ref=str(ref)) from None
        finally:
            await resp.aclose()
        if "sha256:" + h.hexdigest() != digest:
            raise ImageError(f"layer {digest} of {ref} does not match its digest", ref=str(ref), layer=digest)
        return size


def _pick_platform(descs: list[dict[str, Any]], want: tuple[str, str, str], ref: str) -> dict[str, Any]:
    os_, arch, variant = want
    fits = [
        d for d in descs
        if isinstance(d, dict) and (d.get("platform") or {}).get("os") == os_ and (d.get("platform") or {}).get("architecture") == arch
    ]
    if variant:
        fits = [d for d in fits if (d.get("platform") or {}).get("variant", variant) == variant] or fits
    if not fits:
        have = sorted({f"{(d.get('platform') or {}).get('os')}/{(d.get('platform') or {}).get('architecture')}" for d in descs if isinstance(d, dict)})
        raise ImageNotFound(f"{ref} has no image for {'/'.join(p for p in want if p)} (it has {', '.join(have) or 'none'})", ref=ref)
    if not _DIGEST.match(str(fits[0].get("digest", ""))):
        raise ImageError(f"{ref}: bad manifest digest in the index", ref=ref)
    return fits[0]
