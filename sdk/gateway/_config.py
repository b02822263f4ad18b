"""The gateway's settings (``python -m sdk.gateway --help`` lists them with their defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field

from bus.config import setting


@dataclass(frozen=True)
class GatewayConfig:
    nats_url: str | None = field(default=None, metadata=setting(
        "the NATS server(s); no credentials: each API key is its own NATS user",
        default_text="$DSEC_NATS_URL, else the context `dsec up` wrote, else nats://127.0.0.1:4222"))
    http_port: int = field(default=3000, metadata=setting("the port the gateway listens on"))
    host: str = field(default="127.0.0.1", metadata=setting("the address the gateway listens on"))
    domain: str = field(default="", metadata=setting("sandbox host names are <port>-<id>.<domain>", default_text="localhost:<http-port>"))
    pool: str = field(default="default", metadata=setting("the placement pool sandboxes are created in"))
    max_upload_mb: int = field(default=1024, metadata=setting("the largest file upload, in MiB"))
    template_files_max_mb: int = field(default=4096, metadata=setting(
        "MiB of template build sources (COPY uploads) kept per tenant; older ones are dropped to make room, else quota_exceeded (0: no limit)",
        env="DSEC_TEMPLATE_FILES_MAX_MB"))
    template_ready_timeout_s: float = field(default=300.0, metadata=setting(
        "seconds an E2B template's readyCmd may take to succeed after its startCmd, at build and at each create",
        env="DSEC_TEMPLATE_READY_TIMEOUT_S"))
    e2b_profile: str = field(default="default", metadata=setting(
        "the security profile of sandboxes created through E2B's API (a create's metadata `dsec.profile` picks another); "
        "`e2b`: every path writable, as E2B clients such as Harbor expect", env="DSEC_GATEWAY_E2B_PROFILE"))

    @property
    def sandbox_domain(self) -> str:
        return self.domain or f"localhost:{self.http_port}"

    @property
    def max_upload(self) -> int:
        """The largest upload in bytes."""
        return self.max_upload_mb * 1024 * 1024

    @property
    def template_files_max(self) -> int:
        """The bytes of COPY sources one tenant's builds may keep here (0: no limit)."""
        return self.template_files_max_mb * 1024 * 1024


__all__ = ["GatewayConfig"]
