"""Small shared helpers: digests, paths, atomic writes, the data dir."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import tempfile
from pathlib import Path
from typing import Any

DEFAULT_DATA_DIR = "/var/lib/dsec"
DEFAULT_CHUNK_SIZE = 128 * 1024  # see tests/bench/bench_images.py: smaller chunks fetch less, cost no time here

_HEX = re.compile(r"^[0-9a-f]{64}\Z")


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The data dir: the argument, else env ``DSEC_DATA_DIR``, else ``/var/lib/dsec``."""
    return Path(path or os.environ.get("DSEC_DATA_DIR") or DEFAULT_DATA_DIR)


def host_id(value: str | None = None) -> str:
    """This host's id: the argument, else env ``DSEC_HOST_ID``, else the short hostname (as ``dsec up``
    names its host agent), made a valid subject token."""
    hid = value or os.environ.get("DSEC_HOST_ID") or socket.gethostname().split(".")[0]
    hid = re.sub(r"[^A-Za-z0-9_-]", "-", hid)[:128]
    return hid or "host"


def is_hex_digest(s: str) -> bool:
    return bool(_HEX.match(s))


def digest_hex(digest: str) -> str:
    """'sha256:<hex>' or '<hex>' -> '<hex>' (validated)."""
    hexpart = digest[7:] if digest.startswith("sha256:") else digest
    if not is_hex_digest(hexpart):
        raise ValueError(f"not a sha256 digest: {digest!r}")
    return hexpart


def full_digest(hexpart: str) -> str:
    return "sha256:" + digest_hex(hexpart)


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str], bufsize: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(bufsize)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def chunk_digests(path: str | os.PathLike[str], chunk_size: int) -> tuple[str, list[str]]:
    """(sha256 hex of the whole file, [sha256 hex of each chunk]) in one pass."""
    whole = hashlib.sha256()
    chunks: list[str] = []
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(chunk_size)
            if not b:
                break
            whole.update(b)
            chunks.append(hashlib.sha256(b).hexdigest())
    return whole.hexdigest(), chunks


def atomic_write(path: str | os.PathLike[str], data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through a temp file and rename (readers never see half a file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write(path, json.dumps(obj, indent=1, sort_keys=True).encode())


def read_json(path: str | os.PathLike[str], default: Any = None) -> Any:
    try:
        return json.loads(Path(path).read_bytes())
    except (FileNotFoundError, ValueError):
        return default
