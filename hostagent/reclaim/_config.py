"""The reclaim service's settings (``python -m hostagent.reclaim --help`` lists them with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.config import METRICS_PORT, NATS_URL, setting


@dataclass(frozen=True)
class ReclaimConfig:
    nats_url: str | None = field(default=None, metadata=NATS_URL)
    host_id: str | None = field(default=None, metadata=setting("the host agent whose sandboxes to reclaim", default_text="this machine's hostname"))
    data_dir: str = field(default="/var/lib/dsec", metadata=setting("where the service keeps what it set up (its zram device, ksmd's earlier settings)"))
    enabled: bool = field(default=True, metadata=setting("reclaim (off: only report, for comparison)", flag="--reclaim"))
    interval_s: float = field(default=5.0, metadata=setting("seconds between two reclaim passes", flag="--interval"))
    idle_s: float = field(default=30.0, metadata=setting("a sandbox idle this long (no operation, no CPU use) is reclaimed", flag="--idle"))
    idle_cpu: float = field(default=0.01, metadata=setting("CPU (cores, averaged over a pass) under which a sandbox counts as idle"))
    step_mb: int = field(default=256, metadata=setting("memory taken from one idle sandbox per pass, at most"))
    keep_mb: int = field(default=16, metadata=setting(
        "memory left to an idle sandbox, at least: its most recently used pages (its agent, the binaries of its last "
        "commands) stay, so that its next exec does not wait on swap"))
    pageout: bool = field(default=True, metadata=setting(
        "first page out an idle sandbox's own processes, all but its agent (process_madvise MADV_PAGEOUT): their pages "
        "go, below keep-mb, while the agent's and the pages other processes share stay"))
    agent_hot: bool = field(default=True, metadata=setting(
        "after a limit step, fault the in-sandbox agent's pages (about 1.6 MiB, mostly shared) back in: the "
        "sandbox's next operation starts there, and does not wait on the swap", flag="--agent-hot"))
    swap_mb: int = field(default=-1, metadata=setting(
        "size of the zram swap the service sets up when the host has no swap (0: none, page cache only; "
        "-1: a quarter of the host's memory, at most 4096)"))
    swap_algorithm: str = field(default="lz4", metadata=setting("zram compression algorithm"))
    ksm: bool = field(default=True, metadata=setting("run ksmd (merges the pages sandbox processes opted in)"))
    ksm_pages_to_scan: int = field(default=1000, metadata=setting("ksmd pages per wake-up"))
    ksm_sleep_ms: int = field(default=50, metadata=setting("ksmd sleep between wake-ups"))
    grace_s: float = field(default=5.0, metadata=setting("seconds to finish a pass on SIGTERM", flag="--grace"))
    metrics_port: int | None = field(default=None, metadata=METRICS_PORT)


__all__ = ["ReclaimConfig"]
