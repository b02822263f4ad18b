"""mkfs.erofs, deterministic: the same tree always gives the same blob (and so the same digest)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

from bus.errors import ImageError

# A fixed filesystem UUID and timestamp: identical trees -> identical bytes (mkfs.erofs sorts entries).
EROFS_UUID = "d5ecd5ec-0000-4000-8000-00000000e05f"
EROFS_TIMESTAMP = 0


def mkfs_binary() -> str:
    found = shutil.which("mkfs.erofs")
    if not found:
        raise ImageError("mkfs.erofs not found: apt-get install erofs-utils")
    return found


def mkfs_version() -> str:
    try:
        out = subprocess.run([mkfs_binary(), "--version"], capture_output=True, text=True, timeout=10)
        return (out.stdout or out.stderr).strip().splitlines()[0] if (out.stdout or out.stderr) else "unknown"
    except (OSError, subprocess.TimeoutExpired, IndexError):
        return "unknown"


def mkfs_args(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, compress: str | None = None, all_root: bool = False, exact_times: bool = False,
) -> list[str]:
    # exact_times (snapshots): every file keeps its own mtime, to the nanosecond; images get one fixed
    # time instead so that the same tree always gives the same bytes.
    args = [mkfs_binary(), "--quiet", "--preserve-mtime" if exact_times else f"-T{EROFS_TIMESTAMP}", f"-U{EROFS_UUID}"]
    if compress:
        args.append(f"-z{compress}")
    if all_root:
        args.append("--all-root")
    args += [str(out), str(src)]
    return args


async def mkfs_erofs(
    src: str | os.PathLike[str], out: str | os.PathLike[str], *, compress: str | None = None, all_root: bool = False, exact_times: bool = False,
) -> None:
    """Build ``out`` (an EROFS image) from directory ``src``."""
    if not Path(src).is_dir():
        raise ImageError(f"not a directory: {src}")
    proc = await asyncio.create_subprocess_exec(
        *mkfs_args(src, out, compress=compress, all_root=all_root, exact_times=exact_times),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await proc.communicate()
    if proc.returncode != 0:
        try:
            os.unlink(out)
        except FileNotFoundError:
            pass
        msg = (stderr or stdout).decode(errors="replace").strip()[-2000:]
        raise ImageError(f"mkfs.erofs failed ({proc.returncode}): {msg}")
