"""Handles: what an asynchronous collective returns, and the table that owns them.

A handle is a plain int, as in Horovod. ``poll`` never blocks; ``synchronize`` waits, returns what
the synchronous form returns, and forgets the handle (a second ``synchronize`` says so).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable

from hora.base.errors import BusyError, HoraValueError


_COMPLETING = threading.Lock()  # uncontended but for that race: cheaper than a lock per handle


class Handle:
    """One collective's outcome. ``done`` is a plain flag and ``_gate`` a lock held until then, made only
    when a thread has to sleep on it: a handle is made for every collective, and most are waited for by
    a caller that runs the engine itself until ``done`` (:mod:`hora.engine.baton`), so never sleeps here."""

    __slots__ = ("id", "name", "done", "_gate", "result", "error", "finish", "waiter")

    def __init__(self, hid: int, name: str, finish: Callable[[Any], Any] | None = None):
        self.id, self.name, self.finish = hid, name, finish
        self.done = False
        self._gate: threading.Lock | None = None
        self.result: Any = None
        self.error: BaseException | None = None
        self.waiter: int | None = None

    def complete(self, result: Any = None, error: BaseException | None = None) -> None:
        """Set the outcome once: an error racing the result (shutdown failing every handle while the
        engine completes this one) must not replace it, so the check and the set are one step."""
        with _COMPLETING:
            if self.done:
                return
            self.result, self.error = result, error
            self.done = True
            gate = self._gate
        if gate is not None:
            gate.release()

    def wait(self, timeout: float = -1) -> bool:
        """True once done; waits up to ``timeout`` s (-1: for ever)."""
        if self.done:
            return True
        with _COMPLETING:  # the gate made and taken in the section in which ``done`` is seen false
            if self.done:
                return True
            gate = self._gate
            if gate is None:
                gate = self._gate = threading.Lock()
                gate.acquire()
        if gate.acquire(timeout=timeout):
            gate.release()
        return self.done


class HandleTable:
    def __init__(self) -> None:
        self._handles: dict[int, Handle] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.drive: Callable[[Handle], None] | None = None  # the engine runs in the waiting thread

    def new(self, name: str, finish: Callable[[Any], Any] | None = None) -> Handle:
        with self._lock:
            h = Handle(next(self._ids), name, finish)
            self._handles[h.id] = h
            return h

    def discard(self, *hids: int) -> None:
        """Forget handles that were never given to the caller (their submission was refused): nobody
        could synchronize them, so kept they would stay in the table until the next ``init``."""
        with self._lock:
            for hid in hids:
                self._handles.pop(hid, None)

    def __len__(self) -> int:
        """How many handles are live (made and not yet synchronized); tests count them for leaks."""
        return len(self._handles)

    def get(self, hid: int) -> Handle:
        h = self._handles.get(hid)
        if h is None:
            raise HoraValueError(f"handle {hid} is unknown: it was already synchronized, or never returned "
                                 "by an *_async call of this initialisation")
        return h

    def poll(self, hid: int) -> bool:
        return self.get(hid).done

    def synchronize(self, hid: int) -> Any:
        """Wait for handle ``hid`` (running the engine meanwhile, see ``drive``) and return its result.
        Raises the collective's error, HoraValueError for an unknown or spent handle, and BusyError
        when another thread already waits on it (waiting twice cannot be made to mean anything)."""
        h = self._handles.get(hid) or self.get(hid)  # (the look-up inline: a hot path; get() says what is wrong)
        me = threading.get_ident()
        with self._lock:
            if h.waiter is not None and h.waiter != me:
                raise BusyError(f"handle {hid} ('{h.name}') is already being waited on by another thread; "
                                "synchronize each handle from one thread")
            h.waiter = me
        try:
            if self.drive is not None:
                self.drive(h)
            h.wait()
        except BaseException:  # interrupted (Ctrl-C): the handle stays valid, for any thread to wait on
            with self._lock:
                h.waiter = None
            raise
        with self._lock:
            self._handles.pop(hid, None)
        if h.error is not None:
            raise h.error
        return h.finish(h.result) if h.finish is not None else h.result

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            handles = list(self._handles.values())
        for h in handles:
            h.complete(error=error)
