"""``DispatchCheck`` (``zoopick.service.liveness``) on Celery's own request sets, with a
hand-driven clock: when a worker counts as stalled, and when it does not. The stall itself,
with real processes, is in ``tests/service/test_serve_watch.py``."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from celery.worker import state

from zoopick.service.liveness import DispatchCheck


@dataclass(eq=False)
class FakeRequest:  # what the check reads of a request: its id (and a weak reference)
    id: str


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def check():
    state.reserved_requests.clear()
    state.active_requests.clear()
    clock = Clock()
    chk = DispatchCheck(lambda: [11, 12], timeout=10, clock=clock)
    chk.problem()  # the pool's processes are first seen...
    clock.now += 10  # ...and have been there for the start grace
    yield chk, clock
    state.reserved_requests.clear()
    state.active_requests.clear()


def tick_and_check(check: DispatchCheck, clock: Clock, seconds: float) -> str | None:
    """``seconds`` later, with the event loop having run in between."""
    clock.now += seconds
    check.loop_tick()
    return check.problem()


def test_a_reserved_task_left_waiting_with_a_free_pool_is_a_stall(check):
    chk, clock = check
    waiting = FakeRequest("a")
    state.reserved_requests.add(waiting)
    assert tick_and_check(chk, clock, 0) is None
    for _ in range(2):
        assert tick_and_check(chk, clock, 5) is None  # 5 s, then 10 s: not longer than 10
    problem = tick_and_check(chk, clock, 1)
    assert problem == "1 reserved task(s) not started for 11 s while 2 pool process(es) are free"


def test_a_task_handed_to_the_pool_is_not_waiting(check):
    chk, clock = check
    started = FakeRequest("a")
    state.reserved_requests.add(started)  # Celery keeps a started task in both sets
    state.active_requests.add(started)
    for _ in range(4):
        assert tick_and_check(chk, clock, 5) is None


def test_waiting_behind_a_busy_pool_is_normal_and_counted_from_when_a_process_frees(check):
    chk, clock = check
    busy = [FakeRequest("a"), FakeRequest("b")]
    for r in busy:
        state.reserved_requests.add(r)
        state.active_requests.add(r)
    due = FakeRequest("c")  # e.g. a retry whose countdown ran out while both processes work
    state.reserved_requests.add(due)
    for _ in range(6):
        assert tick_and_check(chk, clock, 5) is None  # 30 s behind a full pool
    state.active_requests.discard(busy[0])
    state.reserved_requests.discard(busy[0])
    assert tick_and_check(chk, clock, 5) is None  # free for 0 s: not a stall yet
    assert tick_and_check(chk, clock, 6) is None
    assert tick_and_check(chk, clock, 6) == (
        "1 reserved task(s) not started for 12 s while 1 pool process(es) are free"
    )


def test_an_event_loop_that_stops_running_its_ticks_is_stuck(check):
    chk, clock = check
    assert tick_and_check(chk, clock, 1) is None
    clock.now += 5  # from here the heartbeat thread runs, the loop does not
    assert chk.problem() is None  # the first check without a tick starts the count
    for _ in range(2):
        clock.now += 5
        assert chk.problem() is None  # 5 s, 10 s: not longer than 10
    clock.now += 5
    assert chk.problem() == "its event loop has not run for 15 s"


def test_a_gap_in_the_checks_themselves_starts_afresh(check):
    """The whole process was stopped (SIGSTOP, a suspended machine): nothing ran, neither the
    loop nor the pool nor this thread, so nothing seen before the gap counts."""
    chk, clock = check
    waiting = FakeRequest("a")
    state.reserved_requests.add(waiting)
    assert tick_and_check(chk, clock, 5) is None
    clock.now += 60  # stopped: no check, no tick
    assert chk.problem() is None  # not "waited 65 s", not "loop quiet for 60 s"
    state.reserved_requests.clear()
    assert tick_and_check(chk, clock, 1) is None


def test_a_new_pool_process_is_not_free_until_it_had_time_to_start():
    """A killed pool process is replaced by one that may import torch for a while before it
    takes the task waiting for it: waiting counts only once it has been there ``start_grace``
    seconds."""
    state.reserved_requests.clear()
    state.active_requests.clear()
    clock = Clock()
    pool = [21]
    chk = DispatchCheck(lambda: pool, timeout=10, start_grace=30, clock=clock)
    waiting = FakeRequest("a")  # the set holds weak references: keep one
    try:
        state.reserved_requests.add(waiting)
        for _ in range(9):  # seen at 5 s; 30 s of start grace, then 10 s of waiting
            assert tick_and_check(chk, clock, 5) is None
        assert tick_and_check(chk, clock, 5) == (
            "1 reserved task(s) not started for 15 s while 1 pool process(es) are free"
        )
        pool[:] = [22]  # replaced: a new grace
        for _ in range(8):
            assert tick_and_check(chk, clock, 5) is None
    finally:
        state.reserved_requests.clear()
