"""What the service sets up on the host: a compressed swap (zram) when the host has no swap, and
ksmd. Both are recorded in ``<data-dir>/reclaim/host.json`` so that a restarted service adopts what
an earlier one set up (a crash leaves sandboxes' pages in the swap, still theirs) and the last one
stopped puts the host back as it found it."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import structlog

log = structlog.get_logger("dsec.reclaim")

ZRAM_CONTROL = Path("/sys/class/zram-control")
KSM = Path("/sys/kernel/mm/ksm")
MAX_AUTO_SWAP_MB = 4096


class SwapRefused(ValueError):
    """A swap size the host cannot back (the service refuses to start)."""


def mem_total_mb() -> int:
    with open("/proc/meminfo") as f:
        return int(next(line for line in f if line.startswith("MemTotal:")).split()[1]) // 1024


def swaps() -> list[str]:
    """Active swap devices (``/proc/swaps``)."""
    with open("/proc/swaps") as f:
        return [line.split()[0] for line in f.read().splitlines()[1:] if line.strip()]


def swap_size_mb(asked: int) -> int:
    """The zram size to set up for ``asked`` (-1: automatic); a size beyond the host is refused."""
    total = mem_total_mb()
    if asked < 0:
        return min(total // 4, MAX_AUTO_SWAP_MB)
    if asked > total:
        raise SwapRefused(f"swap of {asked} MiB refused: beyond the host's {total} MiB of memory (zram stores its pages in memory)")
    return asked


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


@dataclass
class HostSetup:
    state_file: Path
    zram: int = -1  # the zram device the service set up (-1: none)
    ksm_before: dict[str, str] = field(default_factory=dict)  # ksmd's settings before the service changed them

    @classmethod
    def load(cls, data_dir: str) -> "HostSetup":
        path = Path(data_dir) / "reclaim" / "host.json"
        try:
            d = json.loads(path.read_text())
            return cls(path, int(d.get("zram", -1)), dict(d.get("ksm_before", {})))
        except (OSError, ValueError):
            return cls(path)

    def save(self) -> None:
        self.state_file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"zram": self.zram, "ksm_before": self.ksm_before}))
        os.replace(tmp, self.state_file)

    @property
    def zram_path(self) -> str:
        return f"/dev/zram{self.zram}" if self.zram >= 0 else ""

    # --- swap ---------------------------------------------------------------------------------
    def ensure_swap(self, size_mb: int, algorithm: str) -> str:
        """The swap the service reclaims anonymous memory into: the host's own, or a zram device
        set up here; "" when there is none (``size_mb`` 0)."""
        active = swaps()
        if self.zram_path and self.zram_path in active:
            return self.zram_path  # ours, from before a restart
        self.zram = -1
        if active:
            return active[0]
        if size_mb <= 0 or not ZRAM_CONTROL.is_dir():
            self.save()
            return ""
        n = int((ZRAM_CONTROL / "hot_add").read_text())
        self.zram = n
        self.save()  # before anything else: a crash from here on leaves a device the next one removes
        blk = Path(f"/sys/block/zram{n}")
        try:
            if algorithm in (blk / "comp_algorithm").read_text().replace("[", " ").replace("]", " ").split():
                (blk / "comp_algorithm").write_text(algorithm)
            (blk / "disksize").write_text(f"{size_mb}M")
            _run("mkswap", f"/dev/zram{n}")
            _run("swapon", "-p", "100", f"/dev/zram{n}")
        except (OSError, subprocess.CalledProcessError) as exc:
            log.error("zram_setup_failed", device=n, error=str(getattr(exc, "stderr", "") or exc))
            self.remove_swap()
            return ""
        log.info("zram_swap", device=f"/dev/zram{n}", size_mb=size_mb, algorithm=algorithm)
        return f"/dev/zram{n}"

    def remove_swap(self) -> None:
        """Take the service's zram swap away (its pages come back into memory first)."""
        if self.zram < 0:
            return
        path = self.zram_path
        if path in swaps():
            try:
                _run("swapoff", path)
            except subprocess.CalledProcessError as exc:
                log.error("swapoff_failed", device=path, error=exc.stderr)
                return  # kept (and recorded): the next service retries
        try:
            (ZRAM_CONTROL / "hot_remove").write_text(str(self.zram))
        except OSError as exc:
            log.warning("zram_remove_failed", device=path, error=str(exc))
        self.zram = -1
        self.save()

    def swap_stored(self) -> tuple[int, int]:
        """(bytes stored, bytes of memory they take compressed) of the service's zram; (0, 0) else."""
        if self.zram < 0:
            return 0, 0
        try:
            f = Path(f"/sys/block/zram{self.zram}/mm_stat").read_text().split()
            return int(f[0]), int(f[2])  # orig_data_size, mem_used_total
        except (OSError, ValueError, IndexError):
            return 0, 0

    # --- ksmd ---------------------------------------------------------------------------------
    def start_ksm(self, pages_to_scan: int, sleep_ms: int) -> None:
        want = {"pages_to_scan": str(pages_to_scan), "sleep_millisecs": str(sleep_ms), "run": "1"}
        if not (KSM / "run").exists():
            return
        for k, v in want.items():
            cur = (KSM / k).read_text().strip()
            if cur != v:
                self.ksm_before.setdefault(k, cur)
                (KSM / k).write_text(v)
        self.save()

    def stop_ksm(self) -> None:
        """ksmd back as it was (``run`` 0 keeps pages merged: nothing grows at once)."""
        for k, v in self.ksm_before.items():
            try:
                (KSM / k).write_text(v)
            except OSError as exc:
                log.warning("ksm_restore_failed", setting=k, error=str(exc))
        self.ksm_before = {}
        self.save()


def ksm_saved_bytes() -> int:
    try:
        return int((KSM / "pages_sharing").read_text()) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


__all__ = ["HostSetup", "SwapRefused", "ksm_saved_bytes", "mem_total_mb", "swap_size_mb", "swaps"]
