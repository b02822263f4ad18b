"""Overlay root filesystem assembly for container sandboxes.

A sandbox's root is an overlayfs: read-only lower dirs (image layers; later mounted EROFS
images), plus a per-sandbox writable upper dir and its overlay work dir. The mount itself is
not done here: `overlay_mount()` returns a `Mount` that is passed to containerd's Tasks.Create
so the runc shim mounts it at `<bundle>/rootfs` and unmounts it on task delete.

`RootfsLayout(sandbox_dir)` names the per-sandbox paths. `sandbox_dir` should be the directory
returned by `ScratchFS.allocate()` (hostagent._quota) so that everything the sandbox can write --
the overlay upper/work dirs and the agent run dir bind-mounted at /.dsec/run -- is charged to the
sandbox's disk quota. upper and work must be on the same filesystem (an overlayfs requirement).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

__all__ = ["Mount", "RootfsLayout", "overlay_mount", "bind_mount"]


@dataclass(frozen=True)
class Mount:
    """A mount in containerd's terms (containerd.types.Mount): type, source, options."""

    type: str
    source: str
    options: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class RootfsLayout:
    """Paths of one sandbox's writable state under `sandbox_dir`."""

    sandbox_dir: str

    @property
    def upper(self) -> str:
        return os.path.join(self.sandbox_dir, "upper")

    @property
    def work(self) -> str:
        return os.path.join(self.sandbox_dir, "work")

    @property
    def run(self) -> str:
        """Host side of /.dsec/run (agent socket dir)."""
        return os.path.join(self.sandbox_dir, "run")

    def create(self) -> "RootfsLayout":
        """Create upper, work and run dirs (idempotent). Returns self."""
        os.makedirs(self.sandbox_dir, mode=0o711, exist_ok=True)
        # upper becomes the container's "/" (its mode shows through): 0755 like a normal root.
        for path, mode in ((self.upper, 0o755), (self.work, 0o700), (self.run, 0o755)):
            try:
                os.mkdir(path, mode)
            except FileExistsError:
                pass
            os.chmod(path, mode)
        return self


_FORBIDDEN = (",", ":", "\n", "\0")


def _check_path(p: str, what: str) -> str:
    if not os.path.isabs(p):
        raise ValueError(f"{what} must be absolute: {p!r}")
    for ch in _FORBIDDEN:
        if ch in p:
            raise ValueError(f"{what} contains {ch!r}, not allowed in overlay options: {p!r}")
    return os.path.normpath(p)


def overlay_mount(
    lowerdirs: list[str],
    upper: str | None,
    work: str | None,
    *,
    volatile: bool = False,
    extra_options: list[str] | None = None,
) -> Mount:
    """Build an overlay `Mount`. `lowerdirs` is ordered top-most first (overlayfs order).

    With `upper`/`work` None the overlay is read-only (needs at least two lower dirs, or a
    single lower dir -- then the result is just a read-only view).
    `volatile` skips all syncs to the upper fs (faster; the upper is unusable after a host
    crash, which is fine for ephemeral sandboxes).
    """
    if not lowerdirs:
        raise ValueError("overlay needs at least one lower dir")
    lowers = [_check_path(p, "lowerdir") for p in lowerdirs]
    opts: list[str] = []
    if (upper is None) != (work is None):
        raise ValueError("upper and work must be given together")
    if upper is not None and work is not None:
        opts.append("upperdir=" + _check_path(upper, "upperdir"))
        opts.append("workdir=" + _check_path(work, "workdir"))
        if volatile:
            opts.append("volatile")
    elif len(lowers) == 1:
        # overlayfs refuses a single lowerdir without upper; a read-only bind does the job.
        return Mount(type="bind", source=lowers[0], options=["rbind", "ro"])
    # containerd's mount helper puts lowerdir first (it compacts long lowerdir lists).
    opts.insert(0, "lowerdir=" + ":".join(lowers))
    # index=off: hard-link/NFS-export indexing is useless here and complicates reuse of lowers.
    opts.append("index=off")
    if extra_options:
        opts.extend(extra_options)
    return Mount(type="overlay", source="overlay", options=opts)


def bind_mount(source: str, readonly: bool = True) -> Mount:
    """A bind mount usable as a rootfs (e.g. a prepared directory used as-is)."""
    return Mount(type="bind", source=os.path.abspath(source), options=["rbind", "ro" if readonly else "rw"])
