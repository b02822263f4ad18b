"""The error envelope: stable codes on the wire, one exception class per condition in Python."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec


class ErrorReply(msgspec.Struct, tag=True, kw_only=True):
    """What any reply carries instead of a result when the work could not be done."""

    code: str
    description: str
    context: dict[str, Any] = {}


class DsecError(Exception):
    """Root of every dsec error; ``code`` is stable, ``description`` is for people."""

    code: ClassVar[str] = "internal"
    http_status: ClassVar[int] = 500  # what the gateway answers an HTTP client with (declared once per class)

    def __init__(self, description: str = "", **context: Any) -> None:
        super().__init__(description or self.code)
        self.description = description or self.code
        self.context = context

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, description=self.description, context=_plain(self.context))

    def __str__(self) -> str:
        return f"[{self.code}] {self.description}"


def _plain(ctx: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in ctx.items()}


class BadRequest(DsecError):
    code = "bad_request"
    http_status = 400


class InvalidArgument(DsecError):
    code = "invalid_argument"
    http_status = 400


class UnknownTemplate(DsecError):
    code = "unknown_template"
    http_status = 404


class NoCapacity(DsecError):
    code = "no_capacity"
    http_status = 503


class HostRejected(DsecError):
    code = "host_rejected"
    http_status = 500


class HostUnreachable(DsecError):
    """Nobody took work handed to a host (not subscribed), or it went silent: placed again elsewhere."""

    code = "host_unreachable"
    http_status = 503


class SandboxNotFound(DsecError):
    code = "sandbox_not_found"
    http_status = 404


class SandboxTimeout(DsecError):
    """The sandbox (or a request to it) ran out of time."""

    code = "timeout"
    http_status = 504


class KillPending(DsecError):
    """The sandbox is being stopped but its teardown is not finished yet; its host retries it."""

    code = "kill_pending"
    http_status = 409


class CreateFailed(DsecError):
    code = "create_failed"
    http_status = 500


class FileNotFound(DsecError):
    code = "file_not_found"
    http_status = 404


class FileError(DsecError):
    code = "file_error"
    http_status = 400


class NotSupported(DsecError):
    code = "not_supported"
    http_status = 501


class PortClosed(DsecError):
    """Nothing listens on that port inside the sandbox (connection refused)."""

    code = "port_closed"
    http_status = 502


class Unavailable(DsecError):
    """The control plane did not answer (no NATS, no responder)."""

    code = "unavailable"
    http_status = 503


class PermissionDenied(DsecError):
    code = "permission_denied"
    http_status = 403


class ImageError(DsecError):
    code = "image_error"
    http_status = 500


class ImageNotFound(ImageError):
    """The registry answered that the image reference (repository, tag or digest) does not exist."""

    code = "image_not_found"
    http_status = 404


class RegistryUnavailable(ImageError):
    """The registry could not be reached, timed out or failed (5xx); trying again later may work."""

    code = "registry_unavailable"
    http_status = 502


class BlobStoreUnavailable(ImageError):
    """The blob store (image chunks, snapshot layers) could not be reached and the host does not hold
    what the work needs; layers the host has cached keep working, and trying again once the store is
    back will."""

    code = "blob_store_unavailable"
    http_status = 503


class BuildFailed(ImageError):
    """A build step failed (a RUN exited non-zero); the context names the step, its exit code and output tail."""

    code = "build_failed"
    http_status = 422


class TemplateTaken(DsecError):
    """The template name is in use by a template the caller does not own (another client's, or the operator's)."""

    code = "template_taken"
    http_status = 409


class UnknownSnapshot(DsecError):
    code = "unknown_snapshot"
    http_status = 404


class SnapshotUnsupported(DsecError):
    """The sandbox holds something a snapshot cannot capture (CRIU's reason in the description)."""

    code = "snapshot_unsupported"
    http_status = 400


class SnapshotInUse(DsecError):
    """A snapshot other snapshots build on (or a paused sandbox needs) cannot be removed."""

    code = "snapshot_in_use"
    http_status = 409


class SandboxNotRunning(DsecError):
    """The operation needs a running sandbox (this one is paused, stopping or being created)."""

    code = "not_running"
    http_status = 409


class InternalError(DsecError):
    code = "internal"
    http_status = 500


class ProcessNotFound(DsecError):
    """No such (background) process in the sandbox: never started, or already ended."""

    code = "process_not_found"
    http_status = 404


class UnknownUser(DsecError):
    """The user a command should run as is not in the sandbox's /etc/passwd."""

    code = "unknown_user"
    http_status = 400


class ReplyTooLarge(DsecError):
    """The answer would not fit the NATS server's payload limit (``max_payload``)."""

    code = "reply_too_large"
    http_status = 413


class OutputLost(DsecError):
    """Streamed output (or watch events) arrived with a gap: some messages were lost on the way."""

    code = "output_lost"
    http_status = 502


class UnsupportedBackend(DsecError):
    """No host runs the backend the sandbox asks for; the description names those that are run."""

    code = "unsupported_backend"
    http_status = 400


class QuotaExceeded(DsecError):
    """A limit of the tenant or the sandbox would be passed; the description names the limit."""

    code = "quota_exceeded"
    http_status = 429


class NoSpace(DsecError):
    """The host's disk (data dir, chunk store or scratch) is full; nothing half-written was kept."""

    code = "no_space"
    http_status = 507



class TrajectoryConflict(DsecError):
    """A replayed step differs from the one the trajectory log holds for it (context: ``step``)."""

    code = "trajectory_conflict"
    http_status = 409


class TrajectoryTrimmed(DsecError):
    """A replay reaches back past what the trajectory log still holds (its age or size limit trimmed it)."""

    code = "trajectory_trimmed"
    http_status = 410


class TrajectoryGap(DsecError):
    """A client's steps in the trajectory log skip one (a step its host answered but the stream never
    took): replaying past it would run that step again."""

    code = "trajectory_gap"
    http_status = 409


class UnknownJob(DsecError):
    """No rollout job has this id."""

    code = "unknown_job"
    http_status = 404


class PolicyError(DsecError):
    """The policy endpoint's reply could not be acted on (not JSON, an unknown tool, arguments of the wrong type)."""

    code = "policy_error"
    http_status = 502


class PolicyTimeout(DsecError):
    """The policy endpoint did not answer in time."""

    code = "policy_timeout"
    http_status = 504

# Every condition of this module, by its stable code (a class added here is on the wire at once).
_BY_CODE: dict[str, type[DsecError]] = {
    cls.code: cls for cls in list(globals().values()) if isinstance(cls, type) and issubclass(cls, DsecError) and cls is not DsecError
}
HTTP_STATUS: dict[str, int] = {code: cls.http_status for code, cls in _BY_CODE.items()}  # code -> HTTP status


def error_class(code: str) -> type[DsecError]:
    return _BY_CODE.get(code, DsecError)


def from_reply(reply: ErrorReply) -> DsecError:
    """Turn a wire error back into the typed exception the caller can catch."""
    cls = error_class(reply.code)
    err = cls(reply.description, **reply.context)
    if cls is DsecError:
        err.code = reply.code  # type: ignore[misc]  # unknown codes survive round trips
    return err


__all__ = ["ErrorReply", "DsecError", "HTTP_STATUS", "error_class", "from_reply", *[c.__name__ for c in _BY_CODE.values()]]
