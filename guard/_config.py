"""Guard's settings (``python -m guard --help`` lists them with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bus import subjects as S
from bus.config import METRICS_PORT, NATS_URL, setting
from bus.messages import SecurityProfile
from bus.streams import StreamOptions


@dataclass(frozen=True)
class GuardConfig:
    nats_url: str | None = field(default=None, metadata=NATS_URL)
    host_id: str | None = field(default=None, metadata=setting("reported in violations", default_text="this machine's hostname"))
    kernel_audit: bool = field(default=True, metadata=setting(
        "read this host's kernel audit records and its dropped sandbox packets (run one guard with them per sandbox host)"))
    drops_only: bool = field(default=False, metadata=setting(
        "read only the dropped sandbox packets of this network namespace and report them: a host in a namespace of "
        "its own on a machine whose guard does the rest (dsec up --hosts runs one in each host's namespace)"))
    enable_audit: bool = field(default=True, metadata=setting("switch kernel audit on when it is off (else Landlock denials are not reported)"))
    readonly_audit: bool = field(default=True, metadata=setting(
        "install the kernel audit rules that report writes refused by read-only system paths "
        "(they cost every syscall on the host some tens of ns)"))
    cgroup_parent: str = field(default="/dsec", metadata=setting("cgroup under which the host agent puts sandboxes"))
    nflog_group: int | None = field(default=S.NFLOG_GROUP, metadata=setting(
        "NFLOG group the host agent logs dropped sandbox packets to; -1: don't read them", env="DSEC_NFLOG_GROUP"))
    report_interval_s: float = field(default=1.0, metadata=setting(
        "seconds between two reports of the same denial of one sandbox", flag="--report-interval"))
    net_report_rate_per_s: float = field(default=5.0, metadata=setting("dropped-packet reports per second (token bucket)", flag="--net-report-rate"))
    net_report_burst: int = field(default=20, metadata=setting("dropped-packet reports in one burst"))
    grace_s: float = field(default=5.0, metadata=setting("seconds to finish work on SIGTERM", flag="--grace"))
    metrics_port: int | None = field(default=None, metadata=METRICS_PORT)
    # Set by programs (tests): the profiles published at start (None: bus.profiles.builtin_profiles()).
    profiles: dict[str, SecurityProfile] | None = None
    stream_options: StreamOptions = field(default_factory=StreamOptions)

    def nflog(self) -> int | None:
        """The NFLOG group to read, None for none."""
        return None if self.nflog_group is None or self.nflog_group < 0 else self.nflog_group


__all__ = ["GuardConfig"]
