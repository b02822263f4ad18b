"""Netlink framing shared by the guard's kernel readers (audit records, NFLOG packets)."""

from __future__ import annotations

import errno
import socket
import struct
from collections.abc import Callable, Iterator

import structlog

log = structlog.get_logger("dsec.guard.netlink")

NLMSG = struct.Struct("=IHHII")  # length, type, flags, seq, pid


def messages(data: bytes) -> Iterator[tuple[int, bytes]]:
    """(type, payload) of each netlink message in one datagram; stops at a malformed length."""
    pos = 0
    while pos + NLMSG.size <= len(data):
        length, rtype, _, _, _ = NLMSG.unpack_from(data, pos)
        if length < NLMSG.size:
            return
        yield rtype, data[pos + NLMSG.size:pos + length]
        pos += (length + 3) & ~3


def drain(sock: socket.socket, on_message: Callable[[int, bytes], None], *, batches: int, overrun: str, note: str) -> None:
    """Hand every message the non-blocking ``sock`` holds to ``on_message``, at most ``batches``
    datagrams per call so one busy reader cannot starve the event loop. A receive buffer overrun
    (ENOBUFS: the kernel dropped messages) is logged as ``overrun`` and reading goes on."""
    for _ in range(batches):
        try:
            data = sock.recv(65536)
        except BlockingIOError:
            return
        except OSError as exc:
            if exc.errno == errno.ENOBUFS:
                log.warning(overrun, note=note)
                continue
            raise
        for rtype, payload in messages(data):
            on_message(rtype, payload)
