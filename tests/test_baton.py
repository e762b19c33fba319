"""The baton (hora/engine/baton.py) as a state machine, without processes or sleeps: threads play the
engine thread and waiting callers, events order them, and each test asserts the transitions.

The safety-net timeout is set to an hour, so a lost wake-up hangs the test (and its timeout fails
it) instead of passing after a second.
"""

import threading
import time

import pytest

from hora.engine import baton as baton_mod
from hora.engine.baton import CALLER, ENGINE, NOBODY, Baton

pytestmark = pytest.mark.timeout(20)
JOIN_S = 10  # generous bound on joins; a healthy test never waits on it


@pytest.fixture(autouse=True)
def no_safety_net(monkeypatch):
    monkeypatch.setattr(baton_mod, "SAFETY_NET_S", 3600.0)


class Caller:
    """A thread waiting on the baton for its own 'handle' (a flag); records what it saw."""

    def __init__(self, b: Baton, drive=None, kicked: threading.Event | None = None):
        self.b = b
        self.kicked = kicked if kicked is not None else threading.Event()
        self.done = False
        self.looked = threading.Event()  # set the first time it checks its handle (waiters counted it)
        self.kicks = 0
        self.drove = []  # the holder each time its drive() ran
        self.result = None
        self._drive = drive
        self.thread = threading.Thread(target=self._run)

    def _is_done(self) -> bool:
        self.looked.set()
        return self.done

    def _run(self) -> None:
        self.result = self.b.wait(self._is_done, self._drive_once, self._kick)

    def _drive_once(self) -> bool:
        self.drove.append(self.b.holder)
        if self._drive is not None:
            return self._drive(self)
        self.done = True
        self.b.cycle_done()
        return True

    def _kick(self) -> None:
        self.kicks += 1
        self.kicked.set()

    def start(self) -> "Caller":
        self.thread.start()
        assert self.looked.wait(JOIN_S)
        return self

    def join(self) -> None:
        self.thread.join(JOIN_S)
        assert not self.thread.is_alive(), "the caller is stuck: a wake-up was lost"


def test_the_only_waiter_drives_and_leaves_the_baton_free():
    b = Baton()
    c = Caller(b).start()
    c.join()
    assert c.drove == [CALLER] and c.kicks == 0 and c.result is True
    assert (b.holder, b.waiters) == (NOBODY, 0)


def test_a_waiter_drives_once_the_engine_thread_releases():
    b = Baton()
    b.engine_take()
    assert b.holder is ENGINE
    c = Caller(b).start()  # finds the engine holding the baton: sleeps, does not kick
    assert c.drove == [] and b.waiters == 1
    b.release()
    c.join()
    assert c.drove == [CALLER] and c.kicks == 0
    assert (b.holder, b.waiters) == (NOBODY, 0)


def test_a_waiter_whose_handle_a_cycle_finished_returns():
    b = Baton()
    b.engine_take()
    c = Caller(b).start()
    c.done = True  # the engine's cycle finished it
    b.cycle_done()
    c.join()
    assert c.drove == [] and b.holder is ENGINE  # returned while the engine still holds the baton
    b.release()


def test_two_waiters_do_not_drive_and_kick_the_engine_thread():
    b = Baton()
    b.engine_take()
    kicked = threading.Event()
    c1, c2 = Caller(b, kicked=kicked).start(), Caller(b, kicked=kicked).start()
    assert b.waiters == 2
    b.release()  # free, but two wait: neither may take it (invariant 2), so they kick (invariant 4)
    assert kicked.wait(JOIN_S)
    b.engine_take()  # the engine thread, kicked, runs a cycle that finishes c1's handle
    assert c1.drove == [] and c2.drove == []
    c1.done = True
    b.cycle_done()
    c1.join()
    b.release()  # c2, alone now, takes the baton and drives
    c2.join()
    assert c1.drove == [] and c2.drove == [CALLER]
    assert c1.kicks <= 1 and c2.kicks <= 1  # once per wait
    assert (b.holder, b.waiters) == (NOBODY, 0)


def test_a_waiter_returns_while_another_caller_drives_for_work_that_needs_it():
    """The four-thread deadlock of ce7fec8: the driver waits for the other caller's next submission,
    made only once that caller has returned, so the caller must not need the baton to return."""
    b = Baton()
    seen = {}

    def drive(me):
        w = Caller(b).start()  # comes to wait while `me` holds the baton
        w.done = True  # this cycle finished the waiter's collective
        b.cycle_done()
        w.thread.join(JOIN_S)  # the driver now waits for the waiter, still holding the baton
        seen["returned"], seen["w"] = not w.thread.is_alive(), w
        me.done = True
        b.cycle_done()
        return True

    d = Caller(b, drive)
    d.start()
    d.join()
    w = seen["w"]
    assert seen["returned"], "the waiter did not return while the driver held the baton"
    assert d.drove == [CALLER] and w.drove == [] and w.kicks == 0
    assert (b.holder, b.waiters) == (NOBODY, 0)


def test_poke_wakes_a_waiter_whose_handle_failed_outside_a_cycle():
    b = Baton()
    b.engine_take()
    c = Caller(b).start()
    c.done = True  # shutdown failed every handle, from another thread
    b.poke()
    c.join()
    b.release()


def test_a_driver_that_finds_the_engine_ended_returns_false():
    b = Baton()
    c = Caller(b, lambda me: False)
    c.start()
    c.join()
    assert c.result is False and c.drove == [CALLER] and b.holder is NOBODY


def test_the_engine_thread_waits_for_a_driving_caller_to_release():
    b = Baton()
    took = threading.Event()

    def drive(me):
        engine = threading.Thread(target=lambda: (b.engine_take(), took.set()))
        engine.start()
        deadline = time.monotonic() + JOIN_S  # wait until the engine thread is asleep in engine_take
        while not b._engine_waiting:
            assert time.monotonic() < deadline, "engine_take never went to sleep"
            time.sleep(0.001)
        assert not took.is_set()  # cannot hold the baton while the caller does
        me.done = True
        me.engine = engine
        return True

    c = Caller(b, drive)
    c.start()
    c.join()
    assert took.wait(JOIN_S) and b.holder is ENGINE
    c.engine.join(JOIN_S)
    b.release()


def test_the_engine_thread_parks_while_a_caller_drives_and_the_release_unparks_it():
    """engine_take(park) never sleeps on the baton while a caller drives: it parks (under the lock) and
    returns False; that caller's release reports the park to ``on_caller_release`` exactly once."""
    b = Baton()
    released, parks = [], []
    b.on_caller_release = released.append

    def drive(me):
        assert b.engine_take(lambda: parks.append(b.holder)) is False  # the engine thread's look
        assert parks == [CALLER] and b.holder is CALLER
        me.done = True
        return True

    c = Caller(b, drive)
    c.start()
    c.join()
    assert released == [True] and b.holder is NOBODY
    c2 = Caller(b).start()  # a later session that nobody parked during: told so
    c2.join()
    assert released == [True, False]
    assert b.engine_take(lambda: parks.append("again")) is True and b.holder is ENGINE  # free: taken
    b.release()
    assert released == [True, False] and parks == [CALLER]  # the engine's own release is no caller's


def test_a_release_whose_hook_fails_still_wakes_the_waiters():
    """``on_caller_release`` runs under the lock; if it raises (the engine shut down meanwhile), the
    waiters still hear of the release (invariant 3), so none sleeps through it."""
    b = Baton()
    calls = []

    def hook(parked):
        calls.append(parked)
        if len(calls) == 1:
            raise ValueError("closed")

    b.on_caller_release = hook
    b.engine_take()
    c = Caller(b).start()  # sleeps: the engine holds the baton
    b.holder = CALLER  # as if a caller had held it (the hook runs for callers' releases only)
    with pytest.raises(ValueError):
        b.release()
    c.join()  # woken, found the baton free, drove
    assert c.drove == [CALLER] and c.result is True and b.holder is NOBODY and len(calls) == 2
