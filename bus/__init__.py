"""dsec's bus: the only thing services share. Subjects, messages, errors, streams and the service runtime."""

from . import codec, messages, subjects
from .codec import decode_reply, encode
from .errors import DsecError, ErrorReply, from_reply
from .natsd import NatsServer, NatsServerError, free_port
from .runtime import PullConsumer, Service, connect, error_of, nats_url
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
    "PullConsumer",
    "Service",
    "connect",
    "error_of",
    "nats_url",
    "StreamOptions",
    "ensure_all",
    "ensure_kv",
]
