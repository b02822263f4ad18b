"""A tenant's file uploads are bounded per tenant (hostagent._uploads), not only by its sandboxes' disks.

A real stack with NATS authentication, two tenants, and the host agent's per-tenant upload limit
set small (``upload_max_bytes_per_tenant``: 500 KiB). Every upload path ends as ``FileWrite`` ops
on the host agent; the SDK's ``files.write`` and raw ``FileWrite`` requests are used here. A's uploads across
two sandboxes fill its bound; the next is ``quota_exceeded`` naming the limit, and nothing of it is
written. Positive controls: just under the limit, rewriting a file (counted once), B's own
uploads (another tenant), and A again once a file is removed or a sandbox killed. The figures are
in the heartbeat (``dsec status``) and ``/metrics``.
"""

from __future__ import annotations

from typing import Any

import pytest

from bus import codec
from bus import subjects as S
from bus.errors import QuotaExceeded
from bus.messages import FileWrite, FileWritten
from bus.runtime import KV
from hostagent._uploads import LIMIT
from sdk._admin import cluster_status
from tests.conftest import eventually
from tests.security.conftest import SKIP_REASON, RedTeam, SecStack, tenants
from tests.security.test_tenants import create_as

pytestmark = pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or "")

KiB = 1024
LIMIT_BYTES = 500 * KiB


@pytest.fixture
async def stack(make_stack: Any) -> SecStack:
    st = await make_stack(auth=True)
    assert st.host.ops.uploads is not None
    st.host.ops.uploads.limit = LIMIT_BYTES  # as --upload-max-bytes-per-tenant sets it
    return st


async def raw_write(nc: Any, tenant: str, sandbox_id: str, path: str, data: bytes) -> FileWritten:
    """A ``FileWrite`` crafted by hand on the tenant's own subject (what the gateway's paths send)."""
    msg = await nc.request(S.sbx(sandbox_id, "files", tenant), codec.encode(FileWrite(path=path, data=data)), timeout=30)
    return codec.decode_reply(msg.data, FileWritten)


async def _heartbeat_uploads(stack: SecStack) -> dict[str, int]:
    kv = await KV.open(stack.nc.jetstream(), S.KV_HOSTS, codec.HOST_STATUS)
    st = await kv.get(stack.host_id)
    return dict(st.upload_bytes) if st is not None else {}


async def test_uploads_are_bounded_per_tenant(stack: SecStack, redteam: RedTeam) -> None:
    a, b = await tenants(stack, "a", "b")
    try:
        sa1, sa2 = await create_as(stack, a), await create_as(stack, a)
        sb = await create_as(stack, b)

        # Just under the bound, over two sandboxes; rewriting a file counts once.
        await sa1.files.write("/tmp/one", b"1" * (200 * KiB))
        await sa2.files.write("/tmp/two", b"2" * (200 * KiB))
        await sa1.files.write("/tmp/one", b"3" * (200 * KiB))
        await raw_write(a.nc, a.user, sa2.sandbox_id, "/tmp/three", b"4" * (99 * KiB))
        assert stack.host.ops.uploads.by_tenant()[a.user] == 499 * KiB
        redteam.allowed("tenant a: 499 KiB of uploads over two sandboxes under a 500 KiB bound (a rewrite counted once)")

        # Over it: refused typed, naming the limit; nothing written.
        with pytest.raises(QuotaExceeded) as exc:
            await sa2.files.write("/tmp/four", b"5" * (2 * KiB))
        err = exc.value
        assert err.code == "quota_exceeded" and err.context["limit"] == LIMIT == "upload_bytes_per_tenant", err
        assert err.context["max"] == str(LIMIT_BYTES) and err.context["used"] == str(499 * KiB), err.context
        assert not await sa2.files.exists("/tmp/four")
        with pytest.raises(QuotaExceeded):
            await raw_write(a.nc, a.user, sa1.sandbox_id, "/tmp/five", b"6" * (2 * KiB))
        assert not await sa1.files.exists("/tmp/five")
        assert (await sa1.commands.run("wc -c < /tmp/one")).stdout.strip() == str(200 * KiB)
        redteam.blocked("tenant a: an upload past its per-tenant bound (SDK files.write, a raw FileWrite) [quota_exceeded upload_bytes_per_tenant]")

        # Another tenant's bound is its own.
        await sb.files.write("/tmp/b", b"b" * (400 * KiB))
        redteam.allowed("tenant b: its own 400 KiB while A is at its bound")
        # An upload of several chunks that would pass it is refused whole: its size is reserved at the first chunk.
        chunk = sb.files._chunk()
        with pytest.raises(QuotaExceeded) as exc:
            await sb.files.write("/tmp/many", b"m" * (3 * chunk))
        assert exc.value.context["wanted"] == str(3 * chunk), exc.value.context
        assert not await sb.files.exists("/tmp/many")
        redteam.blocked("tenant b: a multi-chunk upload past its bound [quota_exceeded at the first chunk, nothing written]")

        # The figures: heartbeat (dsec status) and /metrics.
        async def in_heartbeat() -> bool:
            return await _heartbeat_uploads(stack) == {a.user: 499 * KiB, b.user: 400 * KiB}

        await eventually(in_heartbeat, timeout=20, what="the upload figures in the heartbeat")
        status = await cluster_status(stack.url_as("admin"))
        assert status["storage"]["uploads"][stack.host_id] == {a.user: 499 * KiB, b.user: 400 * KiB}
        assert status["storage"]["limits"][LIMIT] == LIMIT_BYTES
        await stack.host.metrics.collect()  # what a /metrics scrape of this host renders
        lines = [ln for ln in stack.host.metrics.render().splitlines() if ln.startswith("dsec_upload_bytes{")]
        assert any(f'tenant="{a.user}"' in ln and ln.endswith(f" {499 * KiB}") for ln in lines), lines
        assert any(f'tenant="{b.user}"' in ln and ln.endswith(f" {400 * KiB}") for ln in lines), lines

        # Room again: a file removed through the files API, a sandbox killed.
        await sa1.files.remove("/tmp/one")
        await sa2.files.write("/tmp/four", b"5" * (150 * KiB))
        await sa2.kill()
        await eventually(lambda: sa2.sandbox_id not in stack.host.live, timeout=20, what="the kill")
        await sa1.files.write("/tmp/six", b"7" * (450 * KiB))
        assert stack.host.ops.uploads.by_tenant()[a.user] == 450 * KiB
        redteam.allowed("tenant a: uploads again after removing a file and killing a sandbox")
    finally:
        for t in (a, b):
            await t.close()
