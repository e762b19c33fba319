"""The baton: which thread runs the engine's cycles, the engine thread or a waiting caller.

A caller blocked in ``synchronize()`` runs engine cycles itself instead of sleeping until the engine
thread has run them and woken it: that hand-off costs two thread switches per collective, the
largest part of a small one (benchmarks/README.md). The baton decides who may, as a small state
machine::

    NOBODY --engine_take()--------------------------> ENGINE --release()--> NOBODY
    NOBODY --wait(), by the only waiting caller-----> CALLER --release()--> NOBODY
    (the engine thread's engine_take(park) finds a caller holding it: it parks and goes back to
    sleep; the caller's release runs ``on_caller_release``, which wakes it if there is work)

Invariants. All of the baton's state is read and written under one lock, except ``holder`` read by
the holder itself (who knows it) or by a submitter (see ``Submissions.add`` for why that is enough).

1. At most one holder, and only the holder runs cycles.
2. A caller drives only when nobody holds the baton and it is the only caller waiting. With several
   waiters the engine thread serves them all (batching their messages, as it does asynchronous
   work), and a waiter never blocks on the baton: a driver may be waiting for a collective that
   needs another waiter's next submission, which that waiter makes only once it has returned (the
   four-thread deadlock fixed in ce7fec8).
3. Every event a waiter can be waiting for advances ``epoch`` and notifies, under the lock: the end
   of a cycle (handles may have finished), a release (the baton is free), a waiter leaving (the
   one left may now drive) and ``poke`` (handles finished outside any cycle, at shutdown). A waiter
   reads ``epoch`` in the same critical section in which it found it may not drive, and sleeps
   only while ``epoch`` is unchanged and its handle not done. So no wake-up is lost.
4. When the baton is free and callers wait, the engine thread must be awake to serve them: the
   waiter that finds the baton free but may not take it kicks the engine thread (once per wait;
   from then on the work it waits for wakes the engine thread: control messages and submissions).
5. A parked engine thread sleeps until the driving caller's release: the caller serves everything
   meanwhile, and ``on_caller_release(parked=True)``, under the lock, re-arms the engine thread's
   wake-ups and wakes it if work or a timer is left. Parking happens under the lock too, and only
   while a caller holds the baton, so no release can slip between the look and the park.

Every timed wait below uses ``SAFETY_NET_S``, a safety net for a flaw in this reasoning only; the
tests set it to an hour, so that a lost wake-up shows up as a hang rather than as latency.

Interrupts: a caller's sleeps here are safe points of :mod:`hora.engine.interrupts` (why the baton has a
condition variable of its own).
"""

from __future__ import annotations

import threading
from typing import Callable

NOBODY, ENGINE, CALLER = "nobody", "engine", "caller"
SAFETY_NET_S = 1.0
_allocate = threading.Lock




class Baton:
    __slots__ = ("_lock", "_sleepers", "holder", "waiters", "epoch", "_engine_waiting", "_parked",
                 "on_caller_release")

    def __init__(self) -> None:
        # A condition variable of our own (``_sleep_locked``, ``_notify_locked``) rather than
        # threading.Condition: a caller's sleep must be a safe point for interrupts around the one
        # blocking acquire only, never around the Condition's Python-level lock juggling.
        self._lock = threading.Lock()
        self._sleepers: list = []  # one held lock per sleeping thread; released to wake it
        self.holder = NOBODY
        self.waiters = 0  # callers inside wait()
        self.epoch = 0  # advanced by every event a waiter may wait for (invariant 3)
        self._engine_waiting = False
        self._parked = False  # the engine thread found a caller holding the baton and went back to sleep
        # ``on_caller_release(parked)``: run under the lock when a caller releases the baton; the
        # engine re-arms its wake-ups there (and wakes its thread if the caller left work)
        self.on_caller_release: Callable[[bool], None] | None = None

    def held(self) -> bool:
        """Somebody runs cycles now (read without the lock, by a submitter)."""
        return self.holder is not NOBODY

    # -- the engine thread ---------------------------------------------------------------------
    def engine_take(self, park: Callable[[], None] | None = None) -> bool:
        """Hold the baton (the engine thread, before a cycle) and return True. While a caller holds it:
        with ``park``, call it (under the lock) and return False at once: the engine thread then sleeps
        where it sleeps anyway (epoll) until the caller's release (``on_caller_release``) says there is
        work, instead of being woken by every release only to find the next caller holding it again (a
        thread wake and a GIL hand-off per synchronous collective). Without ``park``, sleep until free."""
        with self._lock:
            while self.holder is not NOBODY:
                if park is not None and self.holder is CALLER:
                    self._parked = True
                    park()
                    return False
                self._engine_waiting = True
                self._sleep_locked(None)
            self._engine_waiting = False
            self.holder = ENGINE
            return True

    # -- the holder ----------------------------------------------------------------------------
    def cycle_done(self) -> None:
        """The holder finished a cycle: waiters look at their handles again."""
        with self._lock:
            self.epoch += 1
            if self.waiters > (self.holder is CALLER):  # a driving caller is a waiter itself
                self._notify_locked()

    def release(self, leaving: bool = False) -> None:
        """Free the baton. ``leaving``: the releasing caller also leaves ``wait()`` (its handle is done), in
        the same lock section (one fewer per synchronous call)."""
        with self._lock:
            if leaving:
                self.waiters -= 1  # (first: nothing below may leave it counted)
            was, self.holder = self.holder, NOBODY
            self.epoch += 1
            try:
                if was is CALLER and self.on_caller_release is not None:
                    self.on_caller_release(self._parked)  # under the lock: no engine_take in between
            finally:  # whatever the hook did, the waiters (the one left may now drive) hear of the release
                self._parked = False
                if self.waiters or self._engine_waiting:
                    self._notify_locked()

    def poke(self) -> None:
        """Handles finished outside any cycle (failed at shutdown): waiters look again."""
        with self._lock:
            self.epoch += 1
            self._notify_locked()

    def _notify_locked(self) -> None:
        for gate in self._sleepers:
            gate.release()
        self._sleepers.clear()

    def _sleep_locked(self, window: Callable | None) -> None:
        """Release the lock, sleep until notified (or ``SAFETY_NET_S``), take the lock again.
        ``window``: the interrupt gate's safe point, around the blocking acquire only."""
        gate = _allocate()
        gate.acquire()
        self._sleepers.append(gate)
        self._lock.release()
        try:
            if window is None:
                gate.acquire(True, SAFETY_NET_S)
            else:
                window(gate.acquire, True, SAFETY_NET_S)
        finally:
            self._lock.acquire()
            if gate in self._sleepers:  # timed out, or interrupted: nobody will release it
                self._sleepers.remove(gate)

    # -- a caller ------------------------------------------------------------------------------
    def wait(self, done: Callable[[], bool], drive: Callable[[], bool], kick: Callable[[], None],
             window: Callable | None = None) -> bool:
        """Return once ``done()``: meanwhile run ``drive()`` holding the baton whenever invariant 2
        allows (it runs cycles until ``done()``, calling ``cycle_done`` after each, and returns False
        once the engine can run no more cycles), else sleep until an event (invariant 3). ``kick()``
        wakes the engine thread. Returns False when ``drive()`` did, with ``done()`` still false: the
        caller then waits for the handle itself (shutdown fails it). ``window``: the interrupt gate's
        safe point for the sleeps (the main thread)."""
        lock = self._lock
        counted = False
        try:
            kicked = False
            while True:
                with lock:
                    if not counted:
                        self.waiters += 1
                        counted = True
                    if done():
                        return True
                    mine = self.holder is NOBODY and self.waiters == 1
                    if mine:
                        self.holder = CALLER
                    else:
                        idle, seen = self.holder is NOBODY, self.epoch
                if mine:
                    try:
                        driven = drive()
                    except BaseException:
                        self.release()
                        raise
                    if driven and done():  # the usual end: release and leave in one lock section
                        counted = False
                        self.release(leaving=True)
                        return True
                    self.release()
                    if not driven:
                        return done()
                    continue
                if idle and not kicked:  # invariant 4
                    kick()
                    kicked = True
                with lock:
                    while self.epoch == seen and not done():
                        self._sleep_locked(window)
        finally:
            if counted:
                with lock:
                    self.waiters -= 1
                    if self.waiters:  # the one left may now drive
                        self.epoch += 1
                        self._notify_locked()
