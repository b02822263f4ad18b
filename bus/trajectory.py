"""What the trajectory log (DSEC_TRAJ) holds of a step and how a step is recognised again.

A host logs each numbered request (``step >= 0``) it answers; a client replaying the log compares
its request's digest with the logged one. Both sides compute it here, from the request without
what differs between two runs of the same step: the reply inboxes, the step and client, a
snapshot's client-chosen id and fork ids.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import msgspec

from . import codec
from .errors import ErrorReply
from .messages import ExecRequest, ExecResult, FileMakeDir, FileRemove, FileRename, FileWrite, SnapshotRequest, TrajStep

# Requests a trajectory numbers: everything that changes a sandbox (a background exec is not: its
# reply names a process that a replay cannot bring back).
LOGGED: tuple[type, ...] = (ExecRequest, FileWrite, FileRemove, FileMakeDir, FileRename, SnapshotRequest)
DEFAULT_OUTPUT_CAP = 64 << 10  # bytes of each output (stdout, stderr, written data) a step keeps; the rest by digest


def output_cap() -> int:
    raw = os.environ.get("DSEC_TRAJ_OUTPUT_CAP", "")
    return int(raw) if raw.isdigit() else DEFAULT_OUTPUT_CAP


def is_logged(req: Any) -> bool:
    return isinstance(req, LOGGED) and not (isinstance(req, ExecRequest) and req.background)


def normalize(req: Any) -> Any:
    """``req`` without what two runs of the same step do not share."""
    changes: dict[str, Any] = {"step": -1, "client_id": ""}
    if isinstance(req, ExecRequest):
        changes.update(stream_to="", acks=False)
    elif isinstance(req, SnapshotRequest):
        changes.update(snapshot_id="", fork_ids=[])
    return msgspec.structs.replace(req, **changes)


def digest(req: Any) -> str:
    return hashlib.sha256(codec.encode(normalize(req))).hexdigest()


def normalized(req: Any) -> tuple[bytes, str]:
    """``normalize(req)`` encoded and its digest: what a host both compares and logs (encoded once)."""
    raw = codec.encode(normalize(req))
    return raw, hashlib.sha256(raw).hexdigest()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def make_step(
    sandbox_id: str, op: str, req: Any, result: Any, *, started_at: float, duration_ms: float, host_id: str,
    req_digest: str = "", req_encoded: bytes = b"", cap: int | None = None,
) -> TrajStep:
    """The log entry of ``req`` answered with ``result`` (a reply Struct or an ``ErrorReply``);
    ``req_digest`` and ``req_encoded`` (``normalized(req)``) and ``cap`` (``output_cap()``, an
    environment read) when the caller has them already."""
    cap = output_cap() if cap is None else cap
    digests: dict[str, str] = {}
    if not req_encoded or (isinstance(req, FileWrite) and len(req.data) > cap):
        logged_req = normalize(req)
        if isinstance(logged_req, FileWrite) and len(logged_req.data) > cap:
            digests["data"] = _sha(logged_req.data)
            logged_req.data = logged_req.data[:cap]
        req_encoded = codec.encode(logged_req)
    step = TrajStep(
        sandbox_id=sandbox_id, client_id=req.client_id, step=req.step, op=op, kind=type(req).__name__,
        digest=req_digest or digest(req), request=req_encoded, started_at=started_at, duration_ms=duration_ms, host_id=host_id,
    )
    if isinstance(result, ErrorReply):
        step.error_code, step.error = result.code, result.description
        step.result = codec.encode(result)
        return step
    if isinstance(result, ExecResult) and (len(result.stdout) > cap or len(result.stderr) > cap):
        kept = msgspec.structs.replace(result)
        for name in ("stdout", "stderr"):
            data: bytes = getattr(result, name)
            if len(data) > cap:
                digests[name] = _sha(data)
                setattr(kept, name, data[:cap])
                setattr(kept, f"{name}_truncated", True)
                setattr(kept, f"{name}_bytes", max(getattr(result, f"{name}_bytes"), len(data)))
        result = kept
    step.result = codec.encode(result)
    step.digests = digests
    return step


STEP_DECODER = msgspec.msgpack.Decoder(TrajStep)
_REQUEST_DECODER = msgspec.msgpack.Decoder(ExecRequest | FileWrite | FileRemove | FileMakeDir | FileRename | SnapshotRequest)


def decode_request(step: TrajStep) -> Any:
    return _REQUEST_DECODER.decode(step.request)


__all__ = ["LOGGED", "DEFAULT_OUTPUT_CAP", "STEP_DECODER", "output_cap", "is_logged", "normalize", "digest", "normalized", "make_step", "decode_request"]
