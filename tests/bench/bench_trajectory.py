"""Benchmark of the trajectory log and the rollout workers (a script, not a test).

    python tests/bench/bench_trajectory.py [--execs 300] [--ff-steps 200] [--rollouts 64] [--steps 20] [--policy-down 30] [--nats-down 0]

On a fresh stack in this process (see bench_sandboxes.Stack):

* the exec round trip of ``true`` with and without a logged step (the same request, numbered or not,
  interleaved): p50 and p90, and the p50 added by the log; and the host's side alone, in-process
  (the host agent's own trajectory code, the same step logged or not), free of round-trip noise;
* fast-forward: ``--ff-steps`` logged execs, then a client replaying them (time to catch up);
* ``--rollouts`` concurrent rollouts of ``--steps`` tool calls each on two rollout worker processes;
  halfway one worker is killed (SIGKILL) and the policy server is stopped for ``--policy-down``
  seconds. Every step appends to a file and reports its line count, so a step run twice shows:
  the count of those is printed (it must be 0), with how many jobs completed and the wall time, and
  the steps missing from each job's trajectory log or logged twice (both must be 0). ``--nats-down``
  also kills nats-server (SIGKILL) for that long at the same moment, then starts it again.
Everything it starts is stopped by pid and its data dir removed at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import stop_stack  # noqa: E402
from bench_sandboxes import Stack  # noqa: E402

from bus import codec  # noqa: E402
from bus import subjects as S  # noqa: E402
from bus.messages import ExecRequest, ExecResult  # noqa: E402
from bus.runtime import connect  # noqa: E402
from sdk import AsyncSandbox  # noqa: E402
from sdk.rollouts import AsyncRollouts  # noqa: E402
from tests.scripted_policy import Policy, answer, call  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
STEP = "echo s >> /tmp/ran; wc -l < /tmp/ran"  # its output is how often it ran: step n says n+1 once


async def overhead(stack: Stack, sb: AsyncSandbox, n: int) -> None:
    nc = await connect(stack.url)
    try:
        off: list[float] = []
        on: list[float] = []
        for i in range(n):
            for times, step in ((off, -1), (on, i)):
                data = codec.encode(ExecRequest(cmd="true", step=step, client_id="bench"))
                t0 = time.perf_counter()
                reply = await nc.request(S.sbx(sb.sandbox_id, "exec"), data, timeout=30)
                times.append((time.perf_counter() - t0) * 1000)
                codec.decode_reply(reply.data, ExecResult)
    finally:
        await nc.close()
    paired = [b - a for a, b in zip(off, on, strict=True)]
    print(f"exec round trip of 'true', {n} each, interleaved (load average {os.getloadavg()[0]:.1f}):")
    print(f"  not logged  p50 {statistics.median(off):6.3f} ms  p90 {_q(off, 90):6.3f} ms")
    print(f"  logged      p50 {statistics.median(on):6.3f} ms  p90 {_q(on, 90):6.3f} ms")
    print(f"  added at p50: {statistics.median(on) - statistics.median(off):.3f} ms; median of the paired differences: {statistics.median(paired):.3f} ms")
    await host_cost(stack, n)


def _q(xs: list[float], p: int) -> float:
    return statistics.quantiles(xs, n=100)[p - 1]


async def host_cost(stack: Stack, n: int) -> None:
    """What logging adds to the host's side of an exec, measured in-process with the host agent's own
    code (hostagent._trajectory) on a real connection: the same reply, with and without the step
    logged. Free of the round trips' noise, which on a loaded machine is larger than the cost."""
    from hostagent._trajectory import Trajectory

    nc = await connect(stack.url)
    traj = Trajectory(nc, "bench")
    result = ExecResult(exit_code=0, duration_ms=1.0)

    async def fn() -> ExecResult:
        return result

    plain: list[float] = []
    logged: list[float] = []
    try:
        for i in range(n):
            req = ExecRequest(cmd="true", step=i, client_id="bench-host")
            t0 = time.perf_counter()
            await traj.run("bench-host-cost", "exec", ExecRequest(cmd="true"), fn)  # not numbered: not logged
            t1 = time.perf_counter()
            await traj.run("bench-host-cost", "exec", req, fn)
            t2 = time.perf_counter()
            plain.append((t1 - t0) * 1000)
            logged.append((t2 - t1) * 1000)
        await nc.flush()
    finally:
        await nc.close()
    added = [b - a for a, b in zip(plain, logged, strict=True)]
    print(f"  the host's side, in-process: logging adds p50 {statistics.median(added):.3f} ms, p90 {_q(added, 90):.3f} ms a step"
          f" (target < 0.5 ms); steps not acked yet: {len(traj.unlogged)}")


async def fast_forward(stack: Stack, sb: AsyncSandbox, n: int) -> None:
    t0 = time.perf_counter()
    for i in range(n):
        await sb.commands.run(f"echo {i}")
    live = time.perf_counter() - t0
    t0 = time.perf_counter()
    again = await AsyncSandbox.connect(sb.sandbox_id, nats_url=stack.url, replay=True)
    read = time.perf_counter() - t0
    for i in range(n):
        assert (await again.commands.run(f"echo {i}")).stdout == f"{i}\n"
    ff = time.perf_counter() - t0
    print(f"fast-forward of {n} steps: {ff:.3f} s (reading the log {read:.3f} s); running them live took {live:.2f} s")


async def nats_outage(stack: Stack, seconds: float) -> None:
    """SIGKILL the nats-server, then start it again on the same port and store after ``seconds``."""
    proc = stack.nats.proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stack.nats.proc = None
    await asyncio.sleep(seconds)  # the outage itself
    await asyncio.to_thread(stack.nats.start, 60.0)


def worker(stack: Stack, queue: str, log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DSEC_NATS_URL": stack.url}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "sdk.rollouts", "--queue", queue, "--ack-wait", "5", "--capacity", "64"],
                                env=env, cwd=str(REPO), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


async def rollouts(stack: Stack, args: argparse.Namespace) -> None:
    policy = await Policy().start()
    queue = f"bench-{os.getpid()}"
    procs = [worker(stack, queue, stack.dir / f"worker-{i}.log") for i in range(2)]
    ro = AsyncRollouts(nats_url=stack.url, queue=queue)
    try:
        script = [answer(None, call("exec", n, cmd=STEP)) for n in range(args.steps)] + [answer("done")]
        t0 = time.perf_counter()
        jobs = [await ro.submit(task=f"job {j}", policy_url=policy.url(f"p{j}", script), max_steps=args.steps + 1, policy_wait=600,
                                 memory_mb=64, cpu=0.25)
                for j in range(args.rollouts)]
        half = args.rollouts * args.steps // 2
        while sum([(await ro.get(j)).turns for j in jobs]) < half:
            await asyncio.sleep(0.2)  # progress poll
        # Kill the worker running the most jobs, mid-rollout: they go to the other after ack_wait.
        holders = [(await ro.get(j)).worker for j in jobs]

        def held(p: subprocess.Popen[bytes]) -> int:
            return sum(h.split("-")[-2:-1] == [str(p.pid)] for h in holders)

        victim = max(procs, key=held)
        victim_jobs = held(victim)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        await policy.stop()
        down_at = time.perf_counter()
        if args.nats_down:
            await nats_outage(stack, args.nats_down)  # the control plane is away this long too
        await asyncio.sleep(max(0.0, args.policy_down - (time.perf_counter() - down_at)))  # the GPU pool is away this long
        restarted = Policy()
        restarted.scripts, restarted.requests = policy.scripts, policy.requests
        await restarted.start(policy.port)
        policy = restarted
        print(f"  worker killed (it ran {victim_jobs} of the jobs) and policy stopped at {down_at - t0:.1f} s, policy back after {args.policy_down:g} s"
              + (f", nats-server killed for {args.nats_down:g} s" if args.nats_down else ""))
        results = await ro.results(jobs, wait=True, timeout=3600)
        wall = time.perf_counter() - t0
        done = sum(r.state == "done" for r in results)
        twice = 0
        for r in results:
            outs = [json.loads(m["content"])["stdout"] for m in r.messages if m["role"] == "tool"]
            twice += sum(o != f"{n + 1}\n" for n, o in enumerate(outs))
        taken_over = sum(r.deliveries > 1 for r in results)
        missing = duplicated = 0
        for r in results:  # the log: each job's sandbox steps 0..steps-1, each once
            logged = [s.step for s in r.steps if s.client_id == r.job_id and s.op == "exec"]
            missing += len(set(range(args.steps)) - set(logged))
            duplicated += len(logged) - len(set(logged))
        print(f"{args.rollouts} rollouts of {args.steps} steps: {done} done in {wall:.1f} s; {taken_over} taken over after the kill;"
              f" steps run twice: {twice}; steps missing from the log: {missing}, logged twice: {duplicated}")
        failed = [(r.job_id, r.error_code, r.error) for r in results if r.state != "done"]
        if failed:
            print(f"  FAILED: {failed[:5]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                p.wait(60)
        await policy.stop()


async def run(args: argparse.Namespace) -> None:
    stack = Stack(argparse.Namespace(shim_group=16, warm_pool=0, concurrency=16, memory_mb=64, disk_mb=256, cpu=0.25,
                                     cpu_overcommit=50.0, reconcile_s=10.0))
    await stack.start()
    try:
        sb = await stack.create()
        if args.execs:
            await overhead(stack, sb, args.execs)
        if args.ff_steps:
            await fast_forward(stack, sb, args.ff_steps)
        await sb.kill()
        if args.rollouts:
            await rollouts(stack, args)
    finally:
        await stop_stack(stack)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--execs", type=int, default=300)
    ap.add_argument("--ff-steps", type=int, default=200)
    ap.add_argument("--rollouts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--policy-down", type=float, default=30.0)
    ap.add_argument("--nats-down", type=float, default=0.0, help="also SIGKILL nats-server this long at the same moment (0: not)")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
