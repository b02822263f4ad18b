"""dsec's bus: the only thing services share. Subjects, messages, errors, streams and the service runtime."""

from . import codec, messages, subjects
from .codec import decode_reply, encode
from .errors import DsecError, ErrorReply, from_reply
from .natsd import NatsServer, NatsServerError, free_port
from .runtime import PullWorker, Service, connect, error_of, nats_url, now, respond
from .streams import StreamOptions, ensure_all, ensure_kv

__all__ = [
    "codec",
    "messages",
    "subjects",
    "encode",
    "decode_reply",
    "DsecError",
    "ErrorReply",
    "from_reply",
    "NatsServer",
    "NatsServerError",
    "free_port",
    "PullWorker",
    "Service",
    "connect",
    "error_of",
    "nats_url",
    "now",
    "respond",
    "StreamOptions",
    "ensure_all",
    "ensure_kv",
]
