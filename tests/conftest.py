"""Shared fixtures: a real nats-server with JetStream for the whole session, polled until ready."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest

from bus.natsd import NatsServer


@pytest.fixture(scope="session")
def nats_server() -> NatsServer:
    d = tempfile.mkdtemp(prefix="dsec-nats-")
    srv = NatsServer(d, port=0)
    srv.start()
    os.environ["DSEC_NATS_URL"] = srv.url
    yield srv
    srv.stop()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def uid() -> str:
    return uuid.uuid4().hex[:10]


async def eventually(check: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0, interval: float = 0.02, what: str = "condition") -> None:
    """Poll ``check`` until it is true or the deadline passes (temporal's assert_eventually)."""
    deadline = time.monotonic() + timeout
    while True:
        r = check()
        if asyncio.iscoroutine(r):
            r = await r
        if r:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)  # poll interval, not synchronisation


def is_root() -> bool:
    return os.geteuid() == 0


needs_root = pytest.mark.skipif(not is_root(), reason="needs root (mounts, cgroups, namespaces)")


def proc_mounts_under(path: str | Path) -> list[str]:
    p = str(path)
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(p)]
