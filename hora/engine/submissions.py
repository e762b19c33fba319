"""The submission queue: where callers leave requests for the engine, and how they wake it.

Requests wait here by (process set, name), in submission order, until a cycle takes them; they are
then "local" (taken, not yet run) until their response runs. A name is in at most one of the two,
under one lock, so a duplicate in flight is refused at submission.

Asynchronous submissions stay queued for one cycle time from the first, so that the engine thread
wakes once per batch, not once per tensor; a synchronous one (``flush``), or a cycle run by a
driving caller, takes the queue at once. Waking: a submission to an empty queue writes one byte to
the wake pipe, which the engine thread sleeps on, unless its submitter will run the cycle itself
(see :meth:`add`); ``_wakes`` counts the bytes, so a cycle reads the pipe only when written.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from hora.base.errors import HoraValueError, ShutdownError
from hora.engine.execute import Pending
from hora.engine.messages import Refusal


def _in_flight(pend: Pending) -> HoraValueError:
    return HoraValueError(f"{pend.req.kind} '{pend.req.name}': a collective with this name is already in flight "
                          "on this rank; synchronize it first or use another name")


class Submissions:
    def __init__(self, cycle_s: float):
        self._cycle_s = cycle_s
        self._lock = threading.Lock()
        self.pending: dict[tuple[int, str], Pending] = {}  # queued, by (set, name); read it, never write it
        self._since = 0.0  # when the oldest queued request came
        self._flush = False  # a queued request is synchronous
        self.local: dict[tuple[int, str], Pending] = {}  # taken, not yet run
        self.fd, self._wake_w = os.pipe()  # the engine thread sleeps on ``fd``
        os.set_blocking(self.fd, False)
        self._wakes = 0  # bytes written to the pipe and not yet read
        self.broken: BaseException | None = None  # why the engine failed; later submissions raise it
        self.stopping = False  # shutdown() began: no more submissions
        # A submission whose name is still in flight from this rank's refusal (a rank refusing an input and
        # going on to the same name, faster than its peers reach the name): its peers will submit that name
        # again, so it waits here until the refusal's error response, then is queued (:meth:`release`).
        self.deferred: dict[tuple[int, str], list[Pending]] = {}

    def set_cycle(self, seconds: float) -> None:
        """The cycle time, changed by autotune (the age at which a queued batch is due)."""
        self._cycle_s = seconds

    def add(self, pends: tuple[Pending, ...], held: Callable[[], bool]) -> None:
        """Queue ``pends`` (negotiated together). ``held()`` says whether somebody runs cycles now."""
        with self._lock:
            if self.broken is not None:
                raise self.broken
            if self.stopping:
                raise ShutdownError("hora is shutting down; call hora.init() again")
            if len(pends) == 1:  # (the usual submission: no loop, no set)
                pend = pends[0]
                key = (pend.req.ps, pend.req.name)
                flying = self.local.get(key) or self.pending.get(key)
                if flying is not None:
                    if type(flying.req) is not Refusal:
                        raise _in_flight(pend)
                    # this rank's own refusal of the name is still in flight (its peers have not all reached
                    # the name): what comes next under the name, refused or not, waits for that refusal's
                    # error response, or it would be matched with the peers' refusals (issue 24's hang)
                    self.deferred.setdefault(key, []).append(pend)  # released by that refusal's error response
                    return
                new = ((key, pend),)
                some = every = pend.flush
            else:
                new = tuple(((p.req.ps, p.req.name), p) for p in pends)
                seen: set[tuple[int, str]] = set()
                for key, pend in new:
                    if key in self.local or key in self.pending or key in seen:
                        raise _in_flight(pend)
                    seen.add(key)
                some, every = any(p.flush for p in pends), all(p.flush for p in pends)
            was_empty = not self.pending
            if was_empty:
                self._since = time.monotonic()
            if some:
                self._flush = True
            self.pending.update(new)
            # One byte per batch: a cycle takes the whole queue. A synchronous caller runs the engine
            # itself or kicks its thread (baton invariant 4), so it skips the byte while nobody holds
            # the baton; when somebody does (the holder may be asleep waiting for a message that needs
            # this very submission), it must wake them. The queue is filled before ``held()`` is
            # asked: a holder that took the baton since will see the queue when its cycle starts.
            if was_empty and (not every or held()):
                self._wake_locked()

    def release(self, key: tuple[int, str]) -> None:
        """The name ``key`` has left flight: queue the refusal deferred on it, if any (see ``deferred``)."""
        with self._lock:
            waiting = self.deferred.get(key)
            if not waiting or key in self.local or key in self.pending:
                return
            pend = waiting.pop(0)
            if not waiting:
                del self.deferred[key]
            if not self.pending:
                self._since = time.monotonic()
            self.pending[key] = pend
            self._wake_locked()

    def fail(self, error: BaseException, replace: bool = False) -> BaseException:
        """The engine failed with ``error`` (the first failure stays the cause unless ``replace``):
        later submissions raise it. Returns the cause."""
        with self._lock:
            if self.broken is None or replace:
                self.broken = error
            return self.broken

    def stop(self) -> None:
        """Refuse later submissions, and wake the engine thread so that it sees it."""
        with self._lock:
            self.stopping = True
            self._wake_locked()

    def due(self, driving: bool) -> bool:
        """The queue should be taken now: a driving caller waits anyway, or it is flushed, or its cycle
        time has passed."""
        return bool(self.pending) and (driving or self._flush or time.monotonic() >= self._since + self._cycle_s)

    def wait_s(self) -> float | None:
        """Seconds until the queue's cycle time runs out (None: empty)."""
        return self._since + self._cycle_s - time.monotonic() if self.pending else None

    def take(self, driving: bool) -> tuple[list[Pending], float]:
        """The queued requests if due (they become local), and when the oldest came."""
        with self._lock:
            if self._wakes and self.fd >= 0:  # read only when something was written: a read is a system call
                self._wakes = 0
                try:
                    os.read(self.fd, 4096)
                except BlockingIOError:  # a writer was interrupted between counting and writing
                    pass
            if not self.due(driving):
                return [], 0.0
            new = list(self.pending.values())
            self.local.update(self.pending)  # under the lock: a name is always in one of the two
            self.pending.clear()
            self._flush = False
            return new, self._since

    def kick(self) -> None:
        """Wake the engine thread."""
        with self._lock:
            self._wake_locked()

    def _wake_locked(self) -> None:
        if self._wake_w < 0:  # closed: shut down
            return
        self._wakes += 1
        try:
            os.write(self._wake_w, b"x")
        except OSError:  # closed: shut down
            pass

    def close(self) -> None:
        """Close the wake pipe. The numbers become -1 under the lock: an engine thread that outlived
        shutdown's join must not read or write descriptors that a later init() reuses."""
        with self._lock:
            fd, w, self.fd, self._wake_w = self.fd, self._wake_w, -1, -1
            os.close(fd)
            os.close(w)
