"""``hostagent._fnzygote.Shapes``: which shape the next pre-started interpreter is started for."""

from __future__ import annotations

from hostagent._fnzygote import Shapes, ZygoteKey

A = ZygoteKey(False, 1024, (("SHAPE", "a"),))
B = ZygoteKey(False, 1024, (("SHAPE", "b"),))
T = ZygoteKey(True, 1024, ())


def test_before_any_call_none_and_with_one_shape_always_it() -> None:
    s = Shapes()
    assert s.next_for([]) is None
    s.saw(A)
    assert s.next_for([]) == A and s.next_for([A, A, A]) == A  # control: one shape, as before


def test_shapes_are_started_in_the_proportions_the_calls_came_in() -> None:
    s = Shapes()
    for k in (A, B, B, A, B, T):
        s.saw(k)
    assert s.next_for([]) == B  # the most asked for
    assert s.next_for([B]) == A  # then what is missing: A is half as frequent as B (ties: the more recent)
    assert s.next_for([B, A]) == T
    started: list[ZygoteKey] = []
    for _ in range(6):
        k = s.next_for(started)
        assert k is not None
        started.append(k)
    assert sorted(started, key=repr) == sorted([A, A, B, B, B, T], key=repr)


def test_only_recent_calls_count() -> None:
    s = Shapes()
    s.saw(A)
    for _ in range(Shapes.RECENT):
        s.saw(B)
    assert s.next_for([B, B, B]) == B  # A has left the window
