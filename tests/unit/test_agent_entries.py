"""The agent's long entries and writes with attributes ('l', 's', 'a'): owner, symlink target and
the user.e2b.* metadata xattrs, as envd reports and sets them (fixtures from test_agent, through
conftest). The agent runs on this host here, as root, in the test's temp dir."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
from pathlib import Path

import pytest

from hostagent import _agent
from hostagent._agent import IN_ATTRIB, IN_CREATE, IN_MODIFY, AgentClient, AgentError, ensure_agent_binary
from tests.unit.test_agent import launch, stop_agent, until

BEFORE_LONG_OPS = "d5f0824"  # the last commit whose agent had no 'a', 'l', 's'


async def test_long_listing_and_stat(agent, tmp_path):
    c = agent.client
    f = tmp_path / "f.txt"
    f.write_text("hello")
    os.setxattr(f, "user.e2b.author", b"ann")
    os.setxattr(f, "user.other", b"not ours")
    os.chown(f, 1234, 5678)
    (tmp_path / "d").mkdir()
    os.symlink("f.txt", tmp_path / "link")
    os.symlink("/nowhere", tmp_path / "dangling")
    got = {e.name: e for e in await c.list_dir(str(tmp_path), long=True)}
    assert (got["f.txt"].uid, got["f.txt"].gid, got["f.txt"].metadata, got["f.txt"].symlink_target) == (1234, 5678, {"author": "ann"}, "")
    assert (got["link"].type, got["link"].symlink_target, got["link"].metadata) == ("symlink", "f.txt", {})
    assert (got["dangling"].type, got["dangling"].symlink_target) == ("symlink", "/nowhere")
    assert (got["d"].type, got["d"].uid) == ("dir", os.getuid())
    short = {e.name: e for e in await c.list_dir(str(tmp_path))}
    assert (short["f.txt"].uid, short["f.txt"].metadata) == (-1, {})  # the short listing asks for none of it
    e = await c.stat(str(tmp_path / "link"), follow_symlinks=False, long=True)
    assert (e.type, e.symlink_target, e.uid) == ("symlink", "f.txt", os.getuid())
    e = await c.stat(str(tmp_path / "link"), follow_symlinks=True, long=True)
    assert (e.type, e.size, e.uid, e.metadata) == ("file", 5, 1234, {"author": "ann"})  # the target's
    with pytest.raises(AgentError) as ei:
        await c.stat(str(tmp_path / "missing"), long=True)
    assert ei.value.errno == errno.ENOENT
    with pytest.raises(AgentError) as ei:
        await c.list_dir(str(tmp_path / "f.txt"), long=True)
    assert ei.value.errno == errno.ENOTDIR


async def test_write_with_owner_and_metadata(agent, tmp_path):
    c = agent.client
    p = tmp_path / "sub" / "w.txt"
    assert await c.write_file(str(p), b"data", owner=(1234, 5678), metadata={"a": "1", "b": "two"}) == 4
    st = p.stat()
    assert (st.st_uid, st.st_gid, p.read_bytes()) == (1234, 5678, b"data")
    assert {k: os.getxattr(p, k) for k in os.listxattr(p)} == {"user.e2b.a": b"1", "user.e2b.b": b"two"}
    os.setxattr(p, "user.keep", b"x")
    # The metadata is replaced as a whole (other xattrs stay); None leaves it; {} clears it.
    await c.write_file(str(p), b"again", metadata={"c": "3"})
    assert sorted(os.listxattr(p)) == ["user.e2b.c", "user.keep"] and p.read_bytes() == b"again"
    await c.write_file(str(p), b"x")
    assert sorted(os.listxattr(p)) == ["user.e2b.c", "user.keep"]
    await c.write_file(str(p), b"", metadata={})
    assert os.listxattr(p) == ["user.keep"] and p.read_bytes() == b""
    # A key too long for an xattr name, or an empty one, is refused before the file is created.
    for bad in ({"k" * 300: "v"}, {"": "v"}):
        with pytest.raises(AgentError) as ei:
            await c.write_file(str(tmp_path / "bad.txt"), b"no", metadata=bad)
        assert ei.value.errno == errno.ERANGE
        assert not (tmp_path / "bad.txt").exists()


async def test_write_events_create_attrib_modify(agent, tmp_path):
    """What envd's watchers see of an upload: create, chmod, write (the owner and metadata are set
    before the data, so their attrib events merge with the mode's)."""
    c = agent.client
    events: list[tuple[int, str]] = []
    started = asyncio.Event()
    task = asyncio.ensure_future(c.watch(str(tmp_path), lambda m, n: events.append((m, n)), on_start=started.set))
    await asyncio.wait_for(started.wait(), 5)
    await c.write_file(str(tmp_path / "up.txt"), b"payload", owner=(1000, 1000), metadata={"k": "v"})
    await until(lambda: any(m & IN_MODIFY for m, _ in events), "the write's modify event")
    assert [(m & (IN_CREATE | IN_ATTRIB | IN_MODIFY), n) for m, n in events] == [(IN_CREATE, "up.txt"), (IN_ATTRIB, "up.txt"), (IN_MODIFY, "up.txt")]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_older_agent_falls_back(tmp_path, monkeypatch):
    """An agent started before the upgrade (it answers 'a', 'l', 's' EPROTO): listings and stats
    come without the new fields, a write without its owner and metadata, and the client says so
    (test_write_with_owner_and_metadata is the positive control: the current agent applies them)."""
    repo = Path(_agent.__file__).resolve().parent.parent
    src = subprocess.run(["git", "show", f"{BEFORE_LONG_OPS}:hostagent/agent/dsec-agent.c"], cwd=repo, capture_output=True)
    if src.returncode != 0:
        pytest.skip(f"the agent source of {BEFORE_LONG_OPS} is not in this checkout's history")
    old = tmp_path / "old-agent.c"
    old.write_bytes(src.stdout)
    monkeypatch.setattr(_agent, "AGENT_SOURCE", old)
    a = await launch(await asyncio.to_thread(ensure_agent_binary, str(tmp_path / "data")), tmp_path / "agent")
    try:
        f = tmp_path / "f.txt"
        f.write_text("x")
        os.setxattr(f, "user.e2b.k", b"v")
        listing = AgentClient(a.sock)
        got = {e.name: e for e in await listing.list_dir(str(tmp_path), long=True)}
        assert (got["f.txt"].uid, got["f.txt"].metadata, listing.long_entries) == (-1, {}, False)
        stat = AgentClient(a.sock)
        assert ((await stat.stat(str(f), long=True)).uid, stat.long_entries) == (-1, False)
        writer = AgentClient(a.sock)
        p = tmp_path / "w.txt"
        assert await writer.write_file(str(p), b"data", owner=(1234, 5678), metadata={"a": "1"}) == 4
        assert (writer.long_entries, p.read_bytes(), p.stat().st_uid, os.listxattr(p)) == (False, b"data", os.getuid(), [])
    finally:
        stop_agent(a.proc)
