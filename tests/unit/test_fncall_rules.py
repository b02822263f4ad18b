"""FnCall's rules without a host: the call limits both sides check, the pool flag, languages, and the
pool's queue (a member factory that sleeps stands in for container starts: the queueing, growth and
``no_capacity`` logic is what is under test; tests/integration/test_fncall.py runs it on containers)."""

from __future__ import annotations

import asyncio

import pytest

from bus.errors import InvalidArgument, NoCapacity
from bus.fncall import FN_MAX_BYTES, check_call, check_path
from bus.messages import FnCallRequest, FnFile
from hostagent._backend import Handle
from hostagent._fncall import FnPool, Member, parse_pools
from sdk._fncall import language


@pytest.mark.parametrize("path,norm", [("a.txt", "a.txt"), ("d/../b", "b"), ("/workspace/x/y", "x/y"), ("./c", "c")])
def test_paths_inside_the_workdir(path: str, norm: str) -> None:
    assert check_path(path) == norm


@pytest.mark.parametrize("path", ["", "..", "../x", "a/../../x", "/etc/passwd", "/workspace", ".", "a\0b"])
def test_paths_outside_are_refused(path: str) -> None:
    with pytest.raises(InvalidArgument):
        check_path(path)


@pytest.mark.parametrize("req", [
    FnCallRequest(cmd=""),
    FnCallRequest(cmd="true", timeout_s=-1),
    FnCallRequest(cmd="true", timeout_s=float("nan")),
    FnCallRequest(cmd="true", timeout_s=10**9),
    FnCallRequest(cmd="true", compile_cmd="cc", compile_timeout_s=0),
    FnCallRequest(cmd="true", queue_s=-1),
    FnCallRequest(cmd="true", memory_mb=1),
    FnCallRequest(cmd="true", files=[FnFile(path="x", data=b"0" * (FN_MAX_BYTES + 1))]),
    FnCallRequest(cmd="true", fetch_files=["../x"]),
])
def test_calls_outside_the_limits_are_refused(req: FnCallRequest) -> None:
    with pytest.raises(InvalidArgument):
        check_call(req)


def test_a_call_within_the_limits_passes() -> None:
    check_call(FnCallRequest(cmd="true", files=[FnFile(path="a/b.py", data=b"x")], memory_mb=256, fetch_files=["out.txt"]))


def test_pool_flag() -> None:
    assert parse_pools("base=8, python=2") == {"base": 8, "python": 2}
    assert parse_pools("") == {}
    for bad in ("base", "base=0", "a.b=1", "base=x"):
        with pytest.raises(ValueError):
            parse_pools(bad)


def test_languages() -> None:
    assert language("python3").template == "python" and language("c++").compile
    assert language("cpp", {"cpp": "gcc"}).template == "gcc"
    with pytest.raises(InvalidArgument):
        language("cobol")


async def test_pool_queues_grows_and_answers_no_capacity() -> None:
    made: list[str] = []
    destroyed: list[str] = []

    async def make(template: str) -> Member:
        await asyncio.sleep(0.05)  # a start takes a while
        made.append(f"m{len(made)}")
        return Member(made[-1], Handle(made[-1]))

    async def destroy(m: Member) -> None:
        destroyed.append(m.sid)

    async def no_reset(m: Member) -> bool:
        raise AssertionError("released without reuse: never reset")

    pool = FnPool("t", size=1, max_members=2, queue_max=3, make=make, destroy=destroy, reset=no_reset, starts=asyncio.Semaphore(4))
    pool.fill()
    first = await pool.acquire(5.0)  # waits for the first start
    second = await pool.acquire(5.0)  # the pool grows past its size on demand
    assert pool.want == 2 and {first.sid, second.sid} == {"m0", "m1"}
    # both busy, the maximum reached: waiters queue, a full queue and a deadline are no_capacity
    waiting = [asyncio.ensure_future(pool.acquire(5.0)) for _ in range(3)]
    await asyncio.sleep(0)
    with pytest.raises(NoCapacity):
        await pool.acquire(5.0)  # queue full
    with pytest.raises(NoCapacity):
        await _deadline(pool)
    pool.release(first)  # its replacement goes to the first waiter
    got = await waiting[0]
    assert got.sid not in ("m0", "m1") and first.sid in destroyed
    for w in waiting[1:]:
        w.cancel()
    await asyncio.gather(*waiting[1:], return_exceptions=True)
    pool.release(second)
    pool.release(got)
    await pool.stop()
    assert pool.busy == 0 and not pool.idle and pool.members() == 0
    assert sorted(destroyed) == sorted(made)  # every member started was destroyed


async def test_pool_reuses_a_reset_member_and_replaces_one_that_fails_its_reset() -> None:
    made: list[str] = []
    destroyed: list[str] = []
    resets: list[str] = []
    fail = {"m1"}

    async def make(template: str) -> Member:
        made.append(f"m{len(made)}")
        return Member(made[-1], Handle(made[-1]))

    async def destroy(m: Member) -> None:
        destroyed.append(m.sid)

    async def reset(m: Member) -> bool:
        resets.append(m.sid)
        return m.sid not in fail

    pool = FnPool("t", size=1, max_members=1, queue_max=3, make=make, destroy=destroy, reset=reset, starts=asyncio.Semaphore(4))
    pool.fill()
    m = await pool.acquire(5.0)
    waiter = asyncio.ensure_future(pool.acquire(5.0))
    await asyncio.sleep(0)
    pool.release(m, reuse=True)  # reset, then handed to the waiting call: no new member
    again = await waiter
    assert again is m and made == ["m0"] and resets == ["m0"] and not destroyed
    pool.release(again)  # not reusable (say, it timed out): destroyed, a fresh one started
    fresh = await pool.acquire(5.0)
    assert fresh.sid == "m1" and destroyed == ["m0"]
    pool.release(fresh, reuse=True)  # its reset fails: destroyed and replaced
    last = await pool.acquire(5.0)
    assert last.sid == "m2" and destroyed == ["m0", "m1"]
    pool.release(last, reuse=True)
    await pool.stop()
    assert pool.members() == 0 and sorted(destroyed) == made


async def _deadline(pool: FnPool) -> None:
    """A waiter past its deadline (the queue has room once one waiter is taken out)."""
    pool.queue_max += 1
    try:
        await pool.acquire(0.05)
    finally:
        pool.queue_max -= 1


def test_a_call_subject_names_the_callers_tenant_and_a_client_may_publish_its_own_only() -> None:
    from bus import subjects as S
    from bus.auth import client_permissions

    assert S.fn_call("python", "cli-a") == "dsec.fn.cli-a.python.call"
    assert S.fn_call("python") == f"dsec.fn.{S.OPERATOR_TENANT}.python.call"
    assert S.parse_fn(S.fn_call("python", "cli-a")) == ("cli-a", "python")
    assert S.parse_fn("dsec.fn.python.call") is None and S.parse_fn("dsec.sbx.cli-a.x.exec") is None
    allowed = client_permissions("cli-a")["publish"]["allow"]
    assert S.fn_tenant("cli-a") in allowed and S.fn_call_all("python") not in allowed and S.FN_CALL_WILDCARD not in allowed
    assert S.fn_tenant("cli-b") not in allowed
