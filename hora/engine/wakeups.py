"""What wakes the engine thread: one epoll on the submission queue's wake pipe and on the control connections.

The engine thread sleeps in :meth:`Wakeups.sleep` between cycles. The control connections sit in a nested
epoll of their own, so that they can be switched off as one: a caller driving the engine
(:mod:`hora.engine.baton`) switches them off (:meth:`hush`) before its session first waits for a message or
negotiates, or every message it waits for would also wake the engine thread, which then contends for the GIL
(measured: a 4 KiB allreduce at np=2 took ~1.6x longer). A session that the small-allreduce fast path
(:mod:`hora.engine.fastpath`) completes at once waits for no message, so it leaves them on and saves the two
``epoll_ctl`` of switching them off and on (~0.75 us a synchronous call). An engine thread that finds a
caller driving parks with both off (:meth:`park`): a submission made for the driver then wakes only the
driver, and a message that came during a fast-path session wakes the engine thread once, not until the
session ends. The caller's release switches back on what is off (:meth:`rearm`); both being
level-triggered, a message or byte that came meanwhile wakes the engine thread then.
"""

from __future__ import annotations

import select


class Wakeups:
    """The engine thread's epoll over the wake pipe ``pipe_fd`` and the control connections ``ctrl_fds``."""

    def __init__(self, pipe_fd: int, ctrl_fds) -> None:
        self._pipe = pipe_fd
        self._ctrl = select.epoll()
        for fd in ctrl_fds:
            self._ctrl.register(fd, select.EPOLLIN)  # a closed socket leaves the set by itself
        self._ep = select.epoll()
        self._ep.register(pipe_fd, select.EPOLLIN)
        self._ep.register(self._ctrl.fileno(), select.EPOLLIN)
        self.hushed = False  # the control connections are off (:meth:`hush`) until the next :meth:`rearm`

    def sleep(self, timeout: float | None = -1) -> bool:
        """The engine thread: sleep until a byte or a control message waits (or ``timeout`` s; -1, None:
        no limit); True when something woke it."""
        return bool(self._ep.poll(-1 if timeout is None else timeout))

    def ctrl_waiting(self) -> bool:
        """A control message waits to be read (a system call; the message is not read)."""
        return bool(self._ctrl.poll(0))

    def hush(self) -> None:
        """A driving caller: control messages no longer wake the engine thread (until :meth:`rearm`). Also run
        by a parking engine thread (under the baton's lock) while the caller may run it: both only switch off."""
        if self.hushed:
            return
        try:
            self._ep.modify(self._ctrl.fileno(), 0)
        except (OSError, ValueError):  # closed by a shutdown meanwhile: the caller's cycle sees it stopping
            return
        self.hushed = True

    def park(self) -> None:
        """The engine thread, finding a caller driving (under the baton's lock): neither the wake pipe nor
        the control connections wake it until the caller's release (:meth:`rearm`)."""
        try:
            self._ep.modify(self._pipe, 0)
        except (OSError, ValueError):  # shut down meanwhile (closed): the loop ends on its next look
            return
        self.hush()

    def rearm(self, parked: bool) -> bool:
        """The driving caller's release: control messages (and, for a parked thread, the wake pipe) wake
        the engine thread again, at once if one waits. False: closed by a shutdown, nothing to wake.
        Under the baton's lock, so never at once with :meth:`park` or with a driver's :meth:`hush`."""
        if self._ep.closed:  # shutdown closed it while this caller still drove
            return False
        try:
            if self.hushed:
                self.hushed = False
                self._ep.modify(self._ctrl.fileno(), select.EPOLLIN)
            if parked:
                self._ep.modify(self._pipe, select.EPOLLIN)
        except (OSError, ValueError):  # closed by a shutdown from another thread meanwhile
            return False
        return True

    def fds(self) -> dict[int, str]:
        """What each descriptor the engine thread sleeps on is, for a benchmark counting its wake-ups."""
        return {self._pipe: "pipe", self._ctrl.fileno(): "ctrl"}

    def close(self) -> None:
        self._ep.close()
        self._ctrl.close()
