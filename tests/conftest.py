"""Shared fixtures: a real nats-server with JetStream for the whole session, polled until ready.

Tests that need something a machine may lack (root, cgroups v1, containerd, a tool) are marked
``needs(reason)`` (``reason`` None when it is there) or call ``cannot_run(reason)``. Such a test
FAILS with the reason: a suite that did not run must not pass. ``DSEC_ALLOW_SKIP=1`` (a dev machine
without root, say) makes them skips instead. Nothing is opt-in: the tests that build a Debian
rootfs the first time (debootstrap from the mirror: a minute or two each) build it, and keep it.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

from typing import NoReturn

import pytest

from bus.natsd import NatsServer

ALLOW_SKIP = os.environ.get("DSEC_ALLOW_SKIP") == "1"


def cannot_run(reason: str) -> NoReturn:
    """This machine lacks what the test needs: fail with the reason (skip with DSEC_ALLOW_SKIP=1)."""
    if ALLOW_SKIP:
        pytest.skip(reason)
    pytest.fail(f"cannot run on this machine: {reason} (DSEC_ALLOW_SKIP=1 skips instead)", pytrace=False)


def needs(reason: str | None) -> pytest.MarkDecorator:
    """Mark a test (or module, as ``pytestmark``) that needs what ``reason`` says is missing (None:
    nothing is): see ``cannot_run``."""
    return pytest.mark.needs(reason=reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(reason): fails with the reason unless it is None (DSEC_ALLOW_SKIP=1: skips)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        if mark.kwargs.get("reason"):
            cannot_run(mark.kwargs["reason"])


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


needs_root = needs(None if is_root() else "needs root (mounts, cgroups, namespaces)")


def proc_mounts_under(path: str | Path) -> list[str]:
    p = str(path)
    with open("/proc/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(p)]
