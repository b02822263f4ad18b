"""The disk watch's arithmetic (``hostagent._diskwatch``): which sandbox is blamed for a full disk.
The real disk (a small loop file system filled by a sandbox) is test_storage's; here, the snapshot
bytes a sandbox stored within the window, on a host whose backend has no scratch disks to sample."""

from __future__ import annotations

import time
from pathlib import Path

from hostagent._backend import Capabilities
from hostagent._diskwatch import MIN_GROWTH, DiskWatch
from hostagent._registry import Registry


def _watch(tmp_path: Path, window_s: float = 60.0) -> DiskWatch:
    async def publish(v: object) -> None:
        raise AssertionError("not published here")

    return DiskWatch("h", tmp_path, Registry(tmp_path / "reg", persist=False), Capabilities(name="sim"), reserve_mb=64, window_s=window_s,
                     publish=publish)


def test_the_largest_recent_growth_is_blamed_and_noise_is_not(tmp_path: Path) -> None:
    w = _watch(tmp_path)
    assert w.culprit() is None  # nothing grew
    w.note_stored("a", MIN_GROWTH - 1)
    assert w.culprit() is None  # under the noise floor
    w.note_stored("b", 40 << 20)
    w.note_stored("a", 20 << 20)
    w.note_stored("b", 0)  # nothing stored: not counted
    assert w.culprit() == ("b", 40 << 20)
    assert w.growth("a") == MIN_GROWTH - 1 + (20 << 20)  # both of its snapshots


def test_growth_older_than_the_window_does_not_count(tmp_path: Path) -> None:
    w = _watch(tmp_path, window_s=10.0)
    w.note_stored("old", 100 << 20)
    w.note_stored("new", 20 << 20)
    later = time.monotonic() + 5.0
    assert w.culprit(later) == ("old", 100 << 20)
    w.stored["old"][0] = (time.monotonic() - 20.0, 100 << 20)  # stored 20 s ago: out of a 10 s window
    assert w.culprit() == ("new", 20 << 20)
