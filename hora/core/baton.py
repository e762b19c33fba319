"""The baton: which thread runs the engine's cycles, the engine thread or a waiting caller.

A caller blocked in ``synchronize()`` runs engine cycles itself instead of sleeping until the engine
thread has run them and woken it: that hand-off costs two thread switches per collective, the
largest part of a small one (benchmarks/README.md). The baton decides who may, as a small state
machine::

    NOBODY --engine_take()--------------------------> ENGINE --release()--> NOBODY
    NOBODY --wait(), by the only waiting caller-----> CALLER --release()--> NOBODY
    (the engine thread's engine_take() sleeps while a caller holds it; the release wakes it)

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

Every timed wait below uses ``SAFETY_NET_S``, a safety net for a flaw in this reasoning only; the
tests set it to an hour, so that a lost wake-up shows up as a hang rather than as latency.

Interrupts. Python runs signal handlers in the main thread, between any two of its bytecodes, and a
handler may raise (Ctrl-C's KeyboardInterrupt, a ``signal.alarm`` handler, a test runner's timeout).
When the main thread drives the engine, such an exception could tear whatever the engine was doing:
a half-read control message, a ring step half sent, the baton left held. So while the main thread
is inside the engine, :class:`InterruptGate` defers Python's handlers (they are wrapped, see
:class:`_Deferring`) and runs them only at points where unwinding tears nothing: inside the blocking
waits for negotiation and for the baton, and between cycles. There the caller's exception
propagates unchanged; the engine marks it (``GATE.raised``), hands the baton back and wakes its own
thread, which finishes the interrupted collective in the background. A collective's data phase has no
such point: an interrupt waits for it to end (microseconds; a frozen peer: the stall shutdown), and
a second Ctrl-C in that time is not deferred (the engine then fails, and tells its peers).
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any, Callable

NOBODY, ENGINE, CALLER = "nobody", "engine", "caller"
SAFETY_NET_S = 1.0
RESCAN_S = 0.25  # how often a driving main thread looks for signal handlers installed since (25 us a look)
_allocate = threading.Lock


def _catchable() -> list[int]:
    no = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
    return [s for s in signal.valid_signals() if s not in no]


class _Deferring:
    """The wrapper :class:`InterruptGate` puts around a Python signal handler (``orig``): outside the
    engine, or at one of the gate's safe points, it runs the handler; inside, it records the signal
    for the next safe point. A second SIGINT while one waits runs at once: the user insists."""

    __slots__ = ("orig",)

    def __init__(self, orig: Callable) -> None:
        self.orig = orig

    def __call__(self, signum: int, frame: Any) -> Any:
        g = GATE
        if not g.deferring or g.open:
            return self.orig(signum, frame)
        if signum == signal.SIGINT and any(p[1] == signum for p in g.pending):  # the second one stands for both
            g.pending = [p for p in g.pending if p[1] != signum]
            return self.orig(signum, frame)
        g.pending.append((self.orig, signum, frame))
        return None


class InterruptGate:
    """Defers Python signal handlers while the main thread runs engine code (see the module docstring).
    One per process, ``GATE``: signals are the process's. Only the main thread enters it."""

    def __init__(self) -> None:
        self.deferring = False  # the main thread is inside the engine
        self.open = False  # ... and at a safe point, where a handler may raise
        self.pending: list[tuple[Callable, int, Any]] = []
        self.raised: BaseException | None = None  # the last exception a safe point let through
        self._scanned = -1e9
        self._signals: list[int] | None = None

    def enter(self) -> None:
        """The main thread enters the engine: defer from now on (wrapping new handlers first)."""
        now = time.monotonic()
        if now - self._scanned > RESCAN_S:
            self._scanned = now
            self._wrap()
        self.raised = None
        self.deferring = True

    def leave(self) -> None:
        """The main thread leaves the engine; handlers deferred meanwhile run now, in the caller."""
        self.deferring = False
        self.open = False
        if self.pending:
            self._replay()

    def check(self) -> None:
        """A safe point outside a blocking wait: run the handlers deferred so far (they may raise)."""
        if self.pending:
            self.blocking(_nothing)

    def blocking(self, fn: Callable, *args: Any) -> Any:
        """Run the blocking call ``fn(*args)`` as a safe point: handlers run (and may raise) in it,
        and an exception that leaves it is the caller's, not the engine's (``raised``)."""
        try:
            self.open = True
            if self.pending:
                self._replay()
            return fn(*args)
        except BaseException as e:
            self.raised = e
            raise
        finally:
            self.open = False

    def restore(self) -> None:
        """Put the users' own handlers back (hora shut down)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for s in self._signals or ():
            h = signal.getsignal(s)
            if isinstance(h, _Deferring):
                signal.signal(s, h.orig)
        self._scanned = -1e9

    def _wrap(self) -> None:
        if self._signals is None:
            self._signals = _catchable()
        for s in self._signals:
            h = signal.getsignal(s)
            if callable(h) and not isinstance(h, _Deferring):
                try:
                    signal.signal(s, _Deferring(h))
                except (OSError, ValueError, RuntimeError):
                    pass

    def _replay(self) -> None:
        pend, self.pending = self.pending, []
        for i, (orig, signum, frame) in enumerate(pend):
            try:
                orig(signum, frame)
            except BaseException:
                self.pending = pend[i + 1:] + self.pending
                raise


def _nothing() -> None:
    pass


GATE = InterruptGate()


class Baton:
    __slots__ = ("_lock", "_sleepers", "holder", "waiters", "epoch", "_engine_waiting")

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

    def held(self) -> bool:
        """Somebody runs cycles now (read without the lock, by a submitter)."""
        return self.holder is not NOBODY

    # -- the engine thread ---------------------------------------------------------------------
    def engine_take(self) -> None:
        """Block until the baton is free, then hold it (the engine thread, before a cycle)."""
        with self._lock:
            while self.holder is not NOBODY:
                self._engine_waiting = True
                self._sleep_locked(None)
            self._engine_waiting = False
            self.holder = ENGINE

    # -- the holder ----------------------------------------------------------------------------
    def cycle_done(self) -> None:
        """The holder finished a cycle: waiters look at their handles again."""
        with self._lock:
            self.epoch += 1
            if self.waiters > (self.holder is CALLER):  # a driving caller is a waiter itself
                self._notify_locked()

    def release(self) -> None:
        with self._lock:
            self.holder = NOBODY
            self.epoch += 1
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
                        if not drive():
                            return done()
                    finally:
                        self.release()
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
