"""Progress reporting: a one-line bar on a TTY, silence elsewhere."""

from __future__ import annotations

import sys
import time
from typing import Callable, TextIO

ProgressFn = Callable[[str, int, int], None]  # (stage, done, total)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return f"{n:.1f}GiB"


class TtyProgress:
    """Callable progress sink drawing ``stage [#####.....] done/total`` on one line of a TTY."""

    def __init__(self, stream: TextIO | None = None, width: int = 30, min_interval: float = 0.1) -> None:
        self.stream = stream or sys.stderr
        self.enabled = bool(getattr(self.stream, "isatty", lambda: False)())
        self.width = width
        self.min_interval = min_interval
        self._last = 0.0
        self._stage = ""
        self._dirty = False

    def __call__(self, stage: str, done: int, total: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if stage == self._stage and done < total and now - self._last < self.min_interval:
            return
        if stage != self._stage and self._dirty:
            self.stream.write("\n")
        self._stage = stage
        self._last = now
        if total > 0:
            frac = min(1.0, done / total)
            filled = int(frac * self.width)
            bar = "#" * filled + "." * (self.width - filled)
            text = f"\r{stage:<28} [{bar}] {_human(done)}/{_human(total)}"
        else:
            text = f"\r{stage:<28} ..."
        self.stream.write(text)
        self.stream.flush()
        self._dirty = True

    def close(self) -> None:
        if self.enabled and self._dirty:
            self.stream.write("\n")
            self.stream.flush()
            self._dirty = False


def null_progress(stage: str, done: int, total: int) -> None:
    return None
