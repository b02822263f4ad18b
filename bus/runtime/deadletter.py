"""Dead-lettering: work that can never succeed (malformed, unsigned) is kept, not dropped, then acked.

The message goes to ``dsec.dlq.<origin with dots as underscores>`` (stream DSEC_DLQ) with its
bytes unchanged and the reason in headers: ``Dsec-Error-Code`` (the stable code), ``Dsec-Error``
(the human description, at most 512 characters) and ``Dsec-Origin`` (the subject it came in on).
The original (a JetStream delivery) is acked only once the dead letter is stored: if that fails, it
stays un-acked and JetStream redelivers it. A core message (a hand-off) has nothing to ack.
"""

from __future__ import annotations

from nats.aio.msg import Msg

from .. import log as _log
from .. import subjects as S
from .publisher import PubAck, Publisher

logger = _log.get_logger("dsec.bus.dlq")


def dead_letter_headers(origin: str, code: str, description: str = "") -> dict[str, str]:
    return {S.HDR_ERROR_CODE: code, S.HDR_ERROR: (description or code)[:512], S.HDR_ORIGIN: origin}


async def dead_letter(publisher: Publisher, msg: Msg, code: str, description: str = "") -> PubAck:
    """Store ``msg`` on the DLQ with the reason, then ack it (when JetStream delivered it)."""
    logger.warning("dead_letter", subject=msg.subject, code=code, error=description[:200])
    ack = await publisher.store(S.dlq(msg.subject), msg.data, dead_letter_headers(msg.subject, code, description))
    if (msg.reply or "").startswith("$JS.ACK."):
        await msg.ack()
    return ack


__all__ = ["dead_letter", "dead_letter_headers"]
