"""The Python template (debootstrap from the Debian mirror: about a minute).

The rootfs is cached under DSEC_DATA_DIR (default: a temp dir) so a second run only rebuilds the layer."""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import time
from pathlib import Path


from imaged import build_python_template
from imaged._util import digest_hex

from .conftest import await_for, mount_erofs, needs_fuse

pytestmark = [
    needs_fuse,
]


async def test_python_template_runs_lazily(js, tmp_path: Path, uid: str, lazy_daemons, mounts) -> None:
    data = Path(os.environ.get("DSEC_DATA_DIR") or tempfile.mkdtemp(prefix="dsec-py-"))
    t0 = time.monotonic()
    res = await build_python_template(js, data, f"python-{uid}")
    took = time.monotonic() - t0
    layer = res.manifest.layers[0]
    print(f"python template: {layer.size / 2**20:.1f} MiB, {len(layer.chunks)} chunks, built in {took:.1f}s")
    d = lazy_daemons()
    lower = tmp_path / "lower"
    await asyncio.to_thread(mount_erofs, d.mount / digest_hex(layer.digest), lower)
    mounts.append(lower)
    r = await asyncio.to_thread(
        subprocess.run,
        ["chroot", str(lower), "/bin/sh", "-c", "python3 -c 'import json, sqlite3; print(json.dumps(1))' && pip --version && git --version"],
        capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "pip " in r.stdout and "git version" in r.stdout
    fetched = await await_for(lambda: d.index().get(layer.digest, {}).get("fetched_bytes", 0), 10, "index.json")
    print(f"fetched {fetched / 2**20:.1f} MiB = {100 * fetched / layer.size:.1f}% of the image")
    assert fetched < layer.size / 2
