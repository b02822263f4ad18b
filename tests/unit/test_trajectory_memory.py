"""The host's memory of recent trajectory steps (hostagent/_trajectory): bounded, oldest answered
steps go first, a step still running stays (a repeat of it must wait for it, not run it again)."""

from __future__ import annotations

import asyncio

import pytest

from bus.messages import ExecResult
from hostagent import _trajectory as T

RES = ExecResult(exit_code=0, stdout=b"x" * 10, stderr=b"")


def _start(t: T.Trajectory, n: int) -> asyncio.Future[T.Outcome]:
    fut: asyncio.Future[T.Outcome] = asyncio.get_running_loop().create_future()
    t.recent[("sb", "c", n)] = ("digest", fut)
    return fut


def _answer(t: T.Trajectory, n: int, fut: asyncio.Future[T.Outcome] | None = None) -> None:
    (fut or _start(t, n)).set_result((RES, None))
    t._remember(("sb", "c", n), RES)  # as run() does once the step is answered


def _steps(t: T.Trajectory) -> list[int]:
    return [k[2] for k in t.recent]


async def test_the_oldest_answered_steps_go_first_and_a_running_one_stays(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "RECENT", 4)
    t = T.Trajectory(None, "h")  # type: ignore[arg-type]  # memory only: no connection needed
    running = _start(t, 0)
    for n in range(1, 7):
        _answer(t, n)
    assert _steps(t) == [4, 0, 5, 6]  # 1, 2, 3 went; 0 still runs: kept
    assert t.held == 30
    _answer(t, 0, running)
    _answer(t, 7)
    assert _steps(t) == [0, 5, 6, 7]
    _answer(t, 8)  # positive control: answered, it goes in its turn
    assert _steps(t) == [5, 6, 7, 8] and t.held == 40 and set(t.sizes) == {("sb", "c", n) for n in (5, 6, 7, 8)}


async def test_output_bytes_bound_the_memory_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "RECENT_BYTES", 35)
    t = T.Trajectory(None, "h")  # type: ignore[arg-type]
    for n in range(10):
        _answer(t, n)
    assert _steps(t) == [7, 8, 9] and t.held == 30
