"""A placement replica's settings (``python -m placement --help`` lists them with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nats.js.api import StorageType

from bus.config import METRICS_PORT, NATS_URL, setting
from bus.streams import StreamOptions

from ._table import Policy

MEMORY_EVENTS_MAX_BYTES = 512 * 1024**2  # memory streams share the server's memory store


@dataclass(frozen=True)
class PlacementConfig:
    nats_url: str | None = field(default=None, metadata=NATS_URL)
    replica_id: str | None = field(default=None, metadata=setting("this replica's name", default_text="<hostname>-<pid>-<random>"))
    # a request is held until its host answers, for the whole create: room for every host's concurrency
    capacity: int = field(default=512, metadata=setting("requests held at once by this replica (until their hosts answer)"))
    strategy: Literal["spread", "pack"] = field(default=Policy.strategy, metadata=setting("spread load over hosts, or pack them"))
    sample_k: int = field(default=Policy.sample_k, metadata=setting("candidate hosts scored per decision"))
    coalesce: int = field(
        default=Policy.coalesce,
        metadata=setting("single creates that arrive together go to one host in runs of at least this many (one hand-off, record batch and ready event each)"),
    )
    ack_wait_s: float = field(default=10.0, metadata=setting("seconds before a dead replica's requests are redelivered", flag="--ack-wait"))
    pending_delay_s: float = field(default=0.5, metadata=setting("first re-try delay of a request no host fits", flag="--pending-delay"))
    max_attempts: int = field(default=5, metadata=setting("hand-offs of one request before it fails (no_capacity)"))
    handoff_timeout_s: float = field(default=10.0, metadata=setting("seconds a silent host is given before its work is placed again", flag="--handoff-timeout"))
    quota_grace_s: float = field(
        default=60.0, metadata=setting("seconds a tenant's quota holds a create that has no sandbox record yet", flag="--quota-grace"),
    )
    host_down_s: float = field(
        default=60.0, metadata=setting("seconds without a heartbeat before a host is marked down and its sandboxes lost", flag="--host-down"),
    )
    grace_s: float = field(default=10.0, metadata=setting("seconds to finish held requests on SIGTERM", flag="--grace"))
    stream_storage: Literal["file", "memory"] = field(
        default="file", metadata=setting("storage of the streams this replica creates (memory: scale benchmarks)"),
    )
    control_key_file: str | None = field(
        default=None, metadata=setting("hex key to sign host work with", default_text="$DSEC_CONTROL_KEY; neither: unsigned"),
    )
    metrics_port: int | None = field(default=None, metadata=METRICS_PORT)
    # Set by programs (python -m placement fills control_key from control_key_file or $DSEC_CONTROL_KEY):
    control_key: bytes | None = None  # signs every hand-off to a host (bus.sign); None: unsigned (dev)
    policy: Policy | None = None  # None: the default Policy with this config's strategy and sample_k
    stream_options: StreamOptions | None = None  # None: the defaults, on stream_storage

    def placement_policy(self) -> Policy:
        return self.policy if self.policy is not None else Policy(sample_k=self.sample_k, strategy=self.strategy, coalesce=max(1, self.coalesce))

    def streams(self) -> StreamOptions:
        if self.stream_options is not None:
            return self.stream_options
        if self.stream_storage == "memory":
            return StreamOptions(storage=StorageType.MEMORY, events_max_bytes=MEMORY_EVENTS_MAX_BYTES)
        return StreamOptions()


__all__ = ["PlacementConfig"]
