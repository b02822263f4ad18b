"""Per-sandbox report limits shared by the guard's kernel readers."""

from __future__ import annotations

import time


class _Bucket:
    __slots__ = ("tokens", "at", "held")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens, self.at, self.held = tokens, at, 0


class SandboxBuckets:
    """One token bucket per sandbox, so one sandbox's flood cannot crowd out another's reports; what
    a bucket holds back is counted, so the sandbox's next report can say how much it stands for."""

    def __init__(self, rate_per_s: float, burst: int, *, max_sandboxes: int = 100_000) -> None:
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_sandboxes = max_sandboxes
        self.buckets: dict[str, _Bucket] = {}
        self.held = 0  # held back in total

    def take(self, sid: str) -> bool:
        """True when ``sid`` may report now; else the report is counted as held back."""
        now = time.monotonic()
        b = self.buckets.get(sid)
        if b is None:
            b = self.buckets[sid] = _Bucket(float(self.burst), now)
            if len(self.buckets) > self.max_sandboxes:  # bounded memory: ended sandboxes are forgotten anyway
                for k in list(self.buckets)[: self.max_sandboxes // 2]:
                    del self.buckets[k]
        b.tokens = min(float(self.burst), b.tokens + (now - b.at) * self.rate_per_s)
        b.at = now
        if b.tokens < 1.0:
            b.held += 1
            self.held += 1
            return False
        b.tokens -= 1.0
        return True

    def held_back(self, sid: str) -> int:
        """Reports of ``sid`` held back since its last one (and reset)."""
        b = self.buckets.get(sid)
        if b is None:
            return 0
        n, b.held = b.held, 0
        return n

    def forget(self, sid: str) -> None:
        self.buckets.pop(sid, None)
