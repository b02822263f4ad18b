"""What this machine charges for the parts dsec cannot make cheaper (a script, not a test).

    python tests/bench/bench_floor.py [--spawns 2000] [--sandboxes 100000] [--batch 500]

Two floors, each measured on the real thing:

* **Starting a process.** An exec runs a command: the kernel starts a process and the C library
  initialises itself. glibc probes the CPU with ``cpuid`` at every start (its CPU features and cache
  sizes, in ld.so and again in a static binary); in a virtual machine ``cpuid`` traps to the
  hypervisor. This prints the cost of one ``cpuid`` (run from a page of machine code, no compiler
  needed) and CPU and wall time per spawn-and-wait of ``/bin/sh -c 'echo hi'`` (the exec benchmark's
  command), of a static glibc binary (busybox ``true``) and of a 120-byte binary without any C
  library that only calls exit: the difference between the last two is glibc's start-up.
* **The host side of a create, with nothing else.** One Python process on one connection to a real
  nats-server (JetStream, file storage, the server options dsec runs with) does, per sandbox, only
  what every create must put on the bus: its ops subscription, its record as a KV create
  (compare-and-set on "no record yet", acked) and its ``ready`` event (stored, de-duplicated by
  msg-id), ``--batch`` sandboxes at a time with their acks pipelined. No placement, no client, no
  hand-off, no admission, no backend: what it costs per sandbox (this process + nats-server) is a
  lower bound of any Python host agent's create on this machine.

Prints figures only; everything started is stopped by pid and its data dir removed.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import mmap
import os
import resource
import shutil
import struct
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nats.js.api import StorageType  # noqa: E402

from bus import codec  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.messages import SandboxRecord, SandboxSpec  # noqa: E402
from bus.natsd import NatsServer  # noqa: E402
from bus.runtime import KV, connect, publisher_for  # noqa: E402
from bus.runtime.events import event_msg_id, sandbox_event  # noqa: E402
from bus.runtime.publisher import subscribe_sync  # noqa: E402
from bus.streams import StreamOptions, ensure_all  # noqa: E402

# push rbx; mov eax, edi; xor ecx, ecx; cpuid; pop rbx; ret  (rbx is callee-saved, cpuid writes it)
_CPUID = bytes([0x53, 0x89, 0xF8, 0x31, 0xC9, 0x0F, 0xA2, 0x5B, 0xC3])


def cpuid_us(n: int = 20000) -> float:
    page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    page.write(_CPUID)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(page))
    fn = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32)(addr)
    nop = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32)(addr + len(_CPUID) - 1)  # just the ret
    t0 = time.perf_counter()
    for _ in range(n):
        fn(4)  # leaf 4: deterministic cache parameters, one of those glibc asks at start
    t1 = time.perf_counter()
    for _ in range(n):
        nop(4)
    t2 = time.perf_counter()
    del fn, nop
    return ((t1 - t0) - (t2 - t1)) / n * 1e6


def no_libc_binary(path: Path) -> None:
    """A static ELF whose whole program is exit(0): no C library, no cpuid."""
    code = bytes([0xB8, 0x3C, 0, 0, 0, 0x31, 0xFF, 0x0F, 0x05])  # mov eax, 60; xor edi, edi; syscall
    base, hdr = 0x400000, 64 + 56
    ehdr = struct.pack(
        "<4sBBBBB7xHHIQQQIHHHHHH", b"\x7fELF", 2, 1, 1, 0, 0, 2, 0x3E, 1, base + hdr, 64, 0, 0, 64, 56, 1, 0, 0, 0
    )
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, base, base, hdr + len(code), hdr + len(code), 0x1000)
    path.write_bytes(ehdr + phdr + code)
    path.chmod(0o755)


def spawn_cost(argv: list[str], n: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per posix_spawn + wait of ``argv`` (output to /dev/null)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        acts = [(os.POSIX_SPAWN_DUP2, devnull, 1), (os.POSIX_SPAWN_DUP2, devnull, 2)]
        before_c = resource.getrusage(resource.RUSAGE_CHILDREN)
        before_s = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(n):
            pid = os.posix_spawn(argv[0], argv, {}, file_actions=acts)
            os.waitpid(pid, 0)
        wall = time.perf_counter() - t0
        after_c = resource.getrusage(resource.RUSAGE_CHILDREN)
        after_s = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        os.close(devnull)
    cpu = sum(getattr(a, f) - getattr(b, f) for a, b in ((after_c, before_c), (after_s, before_s)) for f in ("ru_utime", "ru_stime"))
    return cpu / n * 1e6, wall / n * 1e6


def process_floor(n: int) -> None:
    c = cpuid_us()
    print(f"cpuid (leaf 4): {c:.2f} us each")
    with tempfile.TemporaryDirectory(prefix="dsec-floor-") as d:
        bare = Path(d) / "exit0"
        no_libc_binary(bare)
        kinds = [("/bin/sh -c 'echo hi'", ["/bin/sh", "-c", "echo hi"])]
        busybox = shutil.which("busybox")
        if busybox:
            kinds.append(("busybox true (static glibc)", [busybox, "true"]))
        kinds.append(("exit(0), no C library", [str(bare)]))
        costs = {}
        for label, argv in kinds:
            spawn_cost(argv, max(10, n // 20))  # warm the page cache and the binary's pages
            cpu, wall = spawn_cost(argv, n)
            costs[label] = cpu
            print(f"spawn + wait, {label:30s} CPU {cpu:7.1f} us   wall {wall:7.1f} us")
        if busybox:
            glibc = costs["busybox true (static glibc)"] - costs["exit(0), no C library"]
            print(f"glibc's start-up: {glibc:.1f} us of CPU per process, about {glibc / c:.0f} cpuid's worth at {c:.2f} us")


async def host_floor(n: int, batch: int) -> None:
    with tempfile.TemporaryDirectory(prefix="dsec-floor-nats-") as d:
        srv = NatsServer(d, port=0, extra_config="disable_sublist_cache: true")
        srv.start()
        try:
            nc = await connect(srv.url, pending_size=64 * 1024 * 1024)
            js = nc.jetstream()
            await ensure_all(js, StreamOptions(storage=StorageType.FILE))
            kv = await KV.open(js, S.KV_SANDBOXES, codec.SANDBOX_RECORD)
            pub = await publisher_for(nc)

            def ignore(_msg: object) -> None:
                return None

            run = uuid.uuid4().hex[:8]
            assert srv.pid is not None
            t0, c0, s0 = time.perf_counter(), time.process_time(), _cpu_of(srv.pid)
            for b in range(n // batch):
                futs = []
                specs = []
                for i in range(batch):
                    now = time.time()
                    spec = SandboxSpec(sandbox_id=f"sbx-{run}-{b}-{i}", requested_at=now, reply_to="_INBOX.floor.x", owner="floor")
                    specs.append(spec)
                    await subscribe_sync(nc, S.sbx_all(spec.sandbox_id), ignore)
                    rec = SandboxRecord(spec=spec, state="running", host_id="floor-0", created_at=now, ready_at=now, expires_at=now + 300)
                    futs.append(await pub.publish(kv.subject(spec.sandbox_id), codec.encode(rec), {"Nats-Expected-Last-Subject-Sequence": "0"}))
                for f in futs:
                    await f
                for spec in specs:
                    ev = sandbox_event(spec.sandbox_id, "ready", host_id="floor-0", detail={"create_ms": "1.0"})
                    subject = S.evt_sandbox(spec.sandbox_id, "ready", S.tenant(spec.client))
                    await nc.publish(subject, codec.encode(ev), headers={S.HDR_MSG_ID: event_msg_id(spec.sandbox_id, "ready")})
            await nc.flush()
            wall, py, ns = time.perf_counter() - t0, time.process_time() - c0, _cpu_of(srv.pid) - s0
            stored = (await js.stream_info(f"KV_{S.KV_SANDBOXES}")).state.messages
            await nc.close()
        finally:
            srv.stop()
    done = n // batch * batch
    print(
        f"host side only, {done} sandboxes in batches of {batch}: {done / wall:,.0f}/s; CPU per sandbox: "
        f"python {py / done * 1e6:.1f} us, nats-server {ns / done * 1e6:.1f} us, together {(py + ns) / done * 1e6:.1f} us "
        f"(records stored: {stored})"
    )


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spawns", type=int, default=2000)
    ap.add_argument("--sandboxes", type=int, default=100_000)
    ap.add_argument("--batch", type=int, default=500)
    args = ap.parse_args()
    print(f"cores: {os.cpu_count()}")
    process_floor(args.spawns)
    asyncio.run(host_floor(args.sandboxes, args.batch))


if __name__ == "__main__":
    main()
