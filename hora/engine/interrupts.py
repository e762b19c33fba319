"""The interrupt gate: signal handlers deferred while the main thread drives the engine.

Python runs signal handlers in the main thread, between any two of its bytecodes, and a
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

RESCAN_S = 0.25  # how often a driving main thread looks for signal handlers installed since (25 us a look)


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
