"""Typed KV against a real nats-server: the claim race, the missing/corrupt record rule."""

from __future__ import annotations

import asyncio

import msgspec

from bus.runtime import KV, Claim
from tests.conftest import eventually


class Rec(msgspec.Struct, tag=True):
    owner: str
    n: int = 0


async def _bucket(nc, uid: str) -> KV:
    return await KV.open(nc.jetstream(), f"t_{uid}", Rec)


async def test_get_put_update_create(nc, uid) -> None:
    kv = await _bucket(nc, uid)
    try:
        assert await kv.get("a") is None
        rev = await kv.put("a", Rec(owner="x"))
        e = await kv.entry("a")
        assert e is not None and e.value == Rec(owner="x") and e.revision == rev
        assert not await kv.update("a", Rec(owner="y"), last=rev + 10)
        assert await kv.update("a", Rec(owner="y"), last=rev)
        assert not await kv.create("a", Rec(owner="z"))
        await kv.delete("a")
        assert await kv.get("a") is None
        assert await kv.create("a", Rec(owner="z"))  # over a delete marker
        assert (await kv.get("a")) == Rec(owner="z")
        assert await kv.keys() == ["a"]
    finally:
        await nc.jetstream().delete_key_value(kv.bucket)


async def test_two_claimers_one_wins(nc, nc2, uid) -> None:
    a = await _bucket(nc, uid)
    b = await KV.bind(nc2.jetstream(), a.bucket, Rec)
    try:
        for round_ in range(10):
            key = f"k{round_}"
            ra, rb = await asyncio.gather(a.claim(key, Rec(owner="a")), b.claim(key, Rec(owner="b")))
            assert sorted([ra, rb]) == [Claim.LOST, Claim.WON], (ra, rb)
            winner = "a" if ra == Claim.WON else "b"
            assert (await a.get(key)) == Rec(owner=winner)
            # the winner claiming again (a redelivery) finds its own record
            again = await (a if winner == "a" else b).claim(key, Rec(owner=winner, n=1), mine=lambda r, w=winner: r.owner == w)
            assert again == Claim.MINE and (await a.get(key)) == Rec(owner=winner)  # left unchanged
    finally:
        await nc.jetstream().delete_key_value(a.bucket)


async def test_corrupt_record_read_as_absent_and_claimable_by_one(nc, nc2, uid) -> None:
    a = await _bucket(nc, uid)
    b = await KV.bind(nc2.jetstream(), a.bucket, Rec)
    try:
        await a.raw.put("bad", b"\xc1 not msgpack")
        assert await a.get("bad") is None and a.corrupt == 1  # read: None, counted
        assert await a.exists("bad")
        ra, rb = await asyncio.gather(a.claim("bad", Rec(owner="a")), b.claim("bad", Rec(owner="b")))
        assert sorted([ra, rb]) == [Claim.LOST, Claim.WON]
        winner = "a" if ra == Claim.WON else "b"
        assert (await a.get("bad")) == Rec(owner=winner)
        # a claim of a deleted key wins
        await a.delete("bad")
        assert await b.claim("bad", Rec(owner="b")) == Claim.WON
    finally:
        await nc.jetstream().delete_key_value(a.bucket)


async def test_claim_many_against_one_by_one_claimers(nc, nc2, uid) -> None:
    """The pipelined claim of many keys: free keys won by their create alone; a key held by another
    (LOST), one held by us (MINE, left as it is), a tombstone and a corrupt value (claimable) go
    through the one-by-one claim; racing a one-by-one claimer, each key has exactly one winner."""
    a = await _bucket(nc, uid)
    b = await KV.bind(nc2.jetstream(), a.bucket, Rec)
    try:
        await b.put("theirs", Rec(owner="b"))
        await a.put("ours", Rec(owner="a", n=7))
        await a.put("gone", Rec(owner="b"))
        await a.delete("gone")
        await a.raw.put("bad", b"\xc1 not msgpack")
        keys = ["free1", "theirs", "ours", "gone", "bad", "free2"]
        got = await a.claim_many([(k, Rec(owner="a")) for k in keys], mine=lambda cur, ours: cur.owner == ours.owner)
        assert got == [Claim.WON, Claim.LOST, Claim.MINE, Claim.WON, Claim.WON, Claim.WON]
        assert (await a.get("ours")) == Rec(owner="a", n=7)  # MINE leaves what is there
        assert (await a.get("theirs")) == Rec(owner="b")
        for k in ("free1", "gone", "bad", "free2"):
            assert (await a.get(k)) == Rec(owner="a"), k
        race = [f"r{i}" for i in range(50)]
        many, ones = await asyncio.gather(
            a.claim_many([(k, Rec(owner="a")) for k in race]), asyncio.gather(*(b.claim(k, Rec(owner="b")) for k in race)),
        )
        for k, x, y in zip(race, many, ones, strict=True):
            assert sorted([x, y]) == [Claim.LOST, Claim.WON], (k, x, y)
            assert (await a.get(k)) == Rec(owner="a" if x == Claim.WON else "b")
    finally:
        await nc.jetstream().delete_key_value(a.bucket)


async def test_watch_delivers_puts_and_deletes_and_skips_corrupt(nc, uid) -> None:
    kv = await _bucket(nc, uid)
    try:
        await kv.put("before", Rec(owner="x"))
        seen: dict[str, Rec] = {}
        gone: list[str] = []
        w = await kv.watch(lambda k, v, rev: seen.__setitem__(k, v), gone.append)
        try:
            await asyncio.wait_for(w.synced.wait(), 10)
            assert seen == {"before": Rec(owner="x")}
            await kv.raw.put("bad", b"\xc1")
            await kv.put("after", Rec(owner="y", n=2))
            await kv.delete("before")
            await eventually(lambda: "after" in seen and gone == ["before"], what="put and delete seen")
            assert "bad" not in seen and kv.corrupt == 1
        finally:
            await w.stop()
    finally:
        await nc.jetstream().delete_key_value(kv.bucket)


async def test_values_under_a_prefix_and_direct_reads(nc, uid) -> None:
    """``values_under`` lists one prefix's latest values (deleted keys and other prefixes left out);
    ``KV.direct`` reads a key without asking for the stream's info."""
    from nats.js.api import KeyValueConfig

    bucket = f"t_{uid}"
    await nc.jetstream().create_key_value(config=KeyValueConfig(bucket=bucket, history=1, direct=True))
    kv = KV.direct(nc.jetstream(), bucket, Rec)
    try:
        await kv.put("a.one", Rec(owner="a"))
        await kv.put("a.one", Rec(owner="a", n=2))
        await kv.put("a.two", Rec(owner="a"))
        await kv.put("a.gone", Rec(owner="a"))
        await kv.delete("a.gone")
        await kv.put("ab.x", Rec(owner="ab"))
        await kv.put("b.one", Rec(owner="b"))
        assert await kv.values_under("a") == {"a.one": Rec(owner="a", n=2), "a.two": Rec(owner="a")}
        assert await kv.values_under("c") == {}
        assert await kv.get("b.one") == Rec(owner="b") and await kv.get("b.none") is None
    finally:
        await nc.jetstream().delete_key_value(bucket)
