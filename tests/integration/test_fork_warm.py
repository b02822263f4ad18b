"""Fork children served by warm containers of their template (``warmroot``): a started, never used
container of the template is given the restore's root (the snapshot's layers over the template's, a
fresh upper) in its own mount namespace, instead of a cold container start. Profiles without Landlock
only (``e2b``); the others, and a create that finds no warm container, start cold.
Real containerd, real overlay mounts, the host's real lazy loader."""

from __future__ import annotations

import asyncio
import os

import pytest

from sdk import AsyncSandbox
from sdk.errors import DsecError
from tests.conftest import eventually
from tests.imaged.conftest import LazyDaemon, needs_fuse

from .conftest import Stack, needs_stack
from .test_fork import SOURCE_AFTER
from .test_snapshots import WRITE_1, many, tmpl, tree  # noqa: F401 - tmpl is a fixture

pytestmark = [pytest.mark.containerd, needs_stack, needs_fuse]

PROFILE = "e2b"  # no Landlock: its warm containers may take a restore's root
# The root's entries, and every mount: its point, options, type and source (a loop device's number aside)
ROOT_VIEW = ("ls -la / | sed 1d | awk '{print $1, $NF}'; sed 's/^[^ ]* [^ ]* [^ ]* [^ ]* \\([^ ]*\\) \\([^ ]*\\).* - \\([^ ]*\\) \\([^ ]*\\) .*/"
             "\\1 \\2 \\3 \\4/; s/loop[0-9]*/loop/' /proc/self/mountinfo | sort")


def served_warm(stack: Stack, sb: AsyncSandbox) -> bool:
    """The sandbox runs in a container started for the warm pool (its id differs from the sandbox's)."""
    return str(stack.host.handles[sb.sandbox_id].extra["cid"]).startswith("wp-")


def waiting(stack: Stack, template_layers: int) -> int:
    """Warm containers waiting for the template (of ``template_layers`` layers) in the e2b profile."""
    return sum(len(ws) for k, ws in stack.backend.pool.entries().items() if k.profile == PROFILE and len(k.layers) == template_layers)


async def pool_full(stack: Stack, template_layers: int) -> None:
    await eventually(lambda: waiting(stack, template_layers) >= stack.backend.pool.size, timeout=120, interval=0.1, what="the warm pool refilled")


async def test_warm_children_see_the_exact_state_and_diverge_alone(stack: Stack, lazy: LazyDaemon, tmpl: str) -> None:  # noqa: F811
    async with stack.sandbox(template=tmpl, profile=PROFILE) as sb:
        await sb.commands.run(WRITE_1)  # contents, modes (setuid), owner, a symlink, a hard link, deleted and replaced template dirs
        want = (await sb.commands.run(tree())).stdout
        assert "/root/data/link|symbolic link|" in want and "/workspace/gone.txt" not in want and "|4751|" in want
        await pool_full(stack, 2)  # the source's create started the pool of its template and profile
        forks = await sb.fork(stack.backend.pool.size, **stack.kw())
        async with many(stack, forks):
            assert all(served_warm(stack, f) for f in forks)
            await sb.commands.run(SOURCE_AFTER)
            for f in forks:
                assert (await f.commands.run(tree())).stdout == want
            await asyncio.gather(*(f.commands.run(f"echo child{i} > /root/data/t.txt && rm /root/data/bin.hard") for i, f in enumerate(forks)))
            for i, f in enumerate(forks):
                assert await f.files.read("/root/data/t.txt") == f"child{i}\n"
                assert not await f.files.exists("/root/data/bin.hard")
                assert not await f.files.exists("/root/data/late")
            assert await sb.files.read("/root/data/t.txt") == "some text\nmore\n"
            assert await sb.files.exists("/root/data/bin.hard") and not await sb.files.exists("/root/data/link")
            # A child's own snapshot is what it shows (its upper is the fresh one the swap made).
            again = await forks[0].fork(1, **stack.kw())
            async with many(stack, again) as (g,):
                assert await g.files.read("/root/data/t.txt") == "child0\n"
                assert (await g.commands.run(tree())).stdout == (await forks[0].commands.run(tree())).stdout


async def test_warm_and_cold_children_alike_and_none_shows_the_member_before(stack: Stack, lazy: LazyDaemon) -> None:
    """More children than warm containers: the rest start cold (the pool is empty for them). Every
    child, warm or cold, shows the same root, mounts and processes; a mark planted in each waiting
    member's old root (its upper, before the claim) reaches no child, and a member left running a
    process besides its agent is not used (removed; its child starts cold)."""
    async with stack.sandbox(profile=PROFILE) as sb:
        await sb.commands.run("mkdir -p /root/w && echo state > /root/w/f && chmod 604 /root/w/f && rm /bin/sed && touch /etc/marker")
        await pool_full(stack, 1)
        members = [w for k, ws in stack.backend.pool.entries().items() if k.profile == PROFILE and len(k.layers) == 1 for w in ws]
        for w in members:
            with open(os.path.join(w.sdir, "upper", "planted"), "w") as f:  # in the member's old root
                f.write("member's\n")
            # The control: inside the member, before the claim, the mark is there to be seen.
            assert (await stack.backend.t.clients[w.cid].exec("cat /planted")).stdout == b"member's\n"
        busy = members[-1]  # the first one claimed (the pool hands out its newest first)
        client = stack.backend.t.clients[busy.cid]
        sleeper = asyncio.ensure_future(client.exec("sleep 1000"))  # runs while the call is open

        async def sleeping() -> bool:
            return (await client.exec("cat /proc/[0-9]*/comm | grep -c '^sleep$' || true")).stdout == b"1\n"

        await eventually(sleeping, timeout=30, what="the process in the member")  # the control: it runs
        n = len(members) + 2  # more than wait (the pool refills one container at a time, each a cold start)
        try:
            forks = await sb.fork(n, **stack.kw())
        finally:
            sleeper.cancel()
            await asyncio.gather(sleeper, return_exceptions=True)  # its container was removed: the call ends either way
        async with many(stack, forks):
            warm = [f for f in forks if served_warm(stack, f)]
            cold = [f for f in forks if not served_warm(stack, f)]
            assert warm and cold, (len(warm), len(cold))
            assert busy.cid not in {stack.cid(f.sandbox_id) for f in forks} and not stack.backend.pool.holds(busy.cid)
            assert busy.cid not in {c.id for c in await stack.backend.rt.list()}  # removed, not left waiting
            ref = (await cold[0].commands.run(ROOT_VIEW)).stdout
            assert ".newroot" not in ref and "planted" not in ref and "/proc " in ref
            for f in forks:
                what = "warm" if f in warm else "cold"
                assert (await f.commands.run(ROOT_VIEW)).stdout == ref, f"a {what} child's root differs"
                assert (await f.commands.run("cat /root/w/f; stat -c %a /root/w/f; ls /etc/marker; ls /bin/sed || echo no-sed")).stdout == \
                    "state\n604\n/etc/marker\nno-sed\n", what
                assert not await f.files.exists("/planted")
                assert (await f.commands.run("cat /proc/[0-9]*/comm 2>/dev/null | grep -c '^sleep$' || true")).stdout == "0\n", what


async def test_landlock_profile_children_start_cold(stack: Stack, lazy: LazyDaemon) -> None:
    """The default profile's agent holds Landlock rules on its root's inodes: its children never take a warm root."""
    async with stack.sandbox() as sb:
        await sb.commands.run("mkdir -p /root/l && echo ll > /root/l/f")
        await eventually(lambda: stack.backend.pool.ready() >= 1, timeout=120, interval=0.1, what="a warm container of the default profile")
        forks = await sb.fork(1, **stack.kw())
        async with many(stack, forks) as (f,):
            assert not served_warm(stack, f)
            assert await f.files.read("/root/l/f") == "ll\n"


async def test_memory_snapshot_of_a_warm_child_is_refused_typed(stack: Stack, lazy: LazyDaemon) -> None:
    """CRIU cannot dump a container whose root was swapped (runc gives it the configured one): a memory
    snapshot of a warm child is refused before anything is frozen, and the child runs on. The control: a
    cold child of the same source, with warm restores off, is dumped and restored."""
    async with stack.sandbox(profile=PROFILE) as sb:
        await sb.commands.run("echo m > /root/m")
        await pool_full(stack, 1)
        (c,) = await sb.fork(1, **stack.kw())
        stack.backend.warm_restores = False
        try:
            (cold,) = await sb.fork(1, **stack.kw())
        finally:
            stack.backend.warm_restores = True
        async with many(stack, [c, cold]):
            assert served_warm(stack, c) and not served_warm(stack, cold)
            with pytest.raises(DsecError) as ei:
                await c.fork(1, memory=True, **stack.kw())
            assert ei.value.code == "snapshot_unsupported" and "warm container" in str(ei.value)
            await c.commands.run("echo c >> /root/m")  # it runs on, not left frozen
            assert await c.files.read("/root/m") == "m\nc\n"
            forks = await cold.fork(1, memory=True, **stack.kw())
            async with many(stack, forks) as (g,):
                assert await g.files.read("/root/m") == "m\n"
