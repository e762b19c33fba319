"""The one accept loop of every hora port (the store's, each rank's data port).

One thread accepts connections and runs every handshake (:class:`hora.transport.auth.AcceptHandshake`)
at once on non-blocking sockets in a selector, each with its own deadline, and hands each connection
that proved itself to ``on_ready(sock, ident, addr)``. So a client that says nothing, or trickles
bytes, holds one slot until its deadline and never the others' turn: before this, a flood of silent
connections filled the small accept backlog and made real ranks wait for SYN retries (``init`` ~4.7 s
later), and closing a port waited for each silent handshake thread to time out (the job's end ~4 s
later). Now the accept queue drains at once and :meth:`Acceptor.close` never waits on a stranger.

The slots are bounded (``max_pending``, far above any job's own connections at start-up) so a flood
cannot exhaust the process's descriptors: when they are full the oldest handshake is dropped, which
is a stranger's unless real ranks took longer than a flood of strangers arriving after them.

Drops are logged at most once per source address a minute, with a count of the rest (:class:`_DropLog`):
a flood of 4,000 forged handshakes writes two lines, not 4,000.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from typing import Callable

from hora.base.errors import AuthenticationError
from hora.transport import auth, seal

log = logging.getLogger("hora.transport")

MAX_PENDING = 256  # handshakes in progress at once, per port
LOG_EVERY = 60.0  # s: one line per source at most, then the count of what it dropped meanwhile
_SOURCES = 4096  # sources remembered at once (the oldest window is summed up early past that)
_READ_BYTES = 4096

OnReady = Callable[[socket.socket, bytes, tuple], None]


class _Pending:
    __slots__ = ("sock", "addr", "shake", "deadline")

    def __init__(self, sock: socket.socket, addr: tuple, shake: auth.AcceptHandshake, deadline: float):
        self.sock, self.addr, self.shake, self.deadline = sock, addr, shake, deadline


class _DropLog:
    """Dropped connections, logged at most once per source address per ``LOG_EVERY`` s: the first drop
    of a window is logged as it happens, the others are counted and summed up in one line when the
    window ends (:meth:`flush`), so a flood of strangers writes two lines a minute, not one per try."""

    def __init__(self, label: str):
        self._label = label
        self._windows: collections.OrderedDict[str, list] = collections.OrderedDict()  # host -> [start, n, why]

    def drop(self, addr: tuple, why, now: float) -> None:
        host = addr[0]
        w = self._windows.get(host)
        if w is not None:
            w[1] += 1
            w[2] = why
            return
        log.warning("%s: dropped connection from %s:%s: %s", self._label, host, addr[1], why)
        self._windows[host] = [now, 0, why]
        if len(self._windows) > _SOURCES:
            self._sum_up(*self._windows.popitem(last=False))

    def due_in(self, now: float) -> float | None:
        """Seconds until the oldest window ends (None: none open)."""
        for start, _n, _why in self._windows.values():
            return max(0.0, start + LOG_EVERY - now)
        return None

    def flush(self, now: float, every: bool = False) -> None:
        """Sum up the windows that ended (``every``: all of them, at close)."""
        while self._windows:
            host, w = next(iter(self._windows.items()))
            if not every and now - w[0] < LOG_EVERY:
                return
            del self._windows[host]
            self._sum_up(host, w)

    def _sum_up(self, host: str, w: list) -> None:
        start, n, why = w
        if n:
            log.warning("%s: dropped %d more connection%s from %s in %.0f s (the last: %s)", self._label, n,
                        "s" if n > 1 else "", host, min(LOG_EVERY, time.monotonic() - start), why)


class Acceptor:
    """Accept on ``listener`` until :meth:`close`, authenticating with ``secret``.

    ``on_ready(sock, ident, addr)`` runs on the acceptor's thread for each connection that proved it
    knows the secret (``sock`` blocking again, ``ident`` the identity it sent); it must not block, and
    an exception from it drops the connection with a log line, as does a failed or late handshake.
    ``label`` names the port in those lines ("hora store", "hora rank 3: data port"). ``protection``: the
    wire protection this port asks of every connection (else the knob); ``sealed=False`` leaves the
    connections unsealed all the same (the pulse's, which C code writes to).
    """

    def __init__(self, listener: socket.socket, secret: bytes, on_ready: OnReady, label: str,
                 max_pending: int = MAX_PENDING, sealed: bool = True, protection: str | None = None):
        self.listener, self._secret, self._on_ready, self._label = listener, secret, on_ready, label
        self.mode, self._sealed = seal.mode(protection), sealed
        self._max = max_pending
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()  # oldest first
        self._sel = selectors.DefaultSelector()
        self._drops = _DropLog(label)
        self._wake = Wake()
        listener.setblocking(False)
        self._sel.register(listener, selectors.EVENT_READ)
        self._sel.register(self._wake.fileno(), selectors.EVENT_READ)
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="hora-accept", daemon=True)
        self._thread.start()

    @property
    def address(self) -> tuple:
        return self.listener.getsockname()

    def close(self) -> None:
        """Stop accepting, close the listener and drop every unfinished handshake, without waiting
        for any of them."""
        if self._closed:
            return
        self._closed = True
        stop_loop(self._wake, self._thread)

    # -- the loop ----------------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            while not self._closed:
                now = time.monotonic()
                timeout = self._drops.due_in(now)
                if self._pending:
                    left = max(0.0, next(iter(self._pending.values())).deadline - now)
                    timeout = left if timeout is None else min(timeout, left)
                for key, mask in self._sel.select(timeout):
                    if key.fileobj is self.listener:
                        self._accept()
                    elif key.fileobj != self._wake.fileno():
                        self._step(key.data, mask)
                self._expire()
                self._drops.flush(time.monotonic())
        finally:
            for p in list(self._pending.values()):
                self._drop(p, None)
            self._drops.flush(time.monotonic(), every=True)
            self._sel.close()
            self.listener.close()
            self._wake.close()

    def _accept(self) -> None:
        """Take every connection waiting in the backlog (it never fills while strangers talk slowly)."""
        while True:
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # out of descriptors: make room by dropping the oldest stranger, or back off
                    if self._pending:
                        self._drop(next(iter(self._pending.values())), "dropped to make room (out of descriptors)")
                    else:
                        time.sleep(0.05)
                    return
                if e.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EINTR):
                    continue
                return  # the listener was closed
            if len(self._pending) >= self._max:
                self._drop(next(iter(self._pending.values())), f"more than {self._max} handshakes at once")
            sock.setblocking(False)
            shake = auth.AcceptHandshake(self._secret, self.mode)
            p = _Pending(sock, addr, shake, time.monotonic() + auth.HANDSHAKE_TIMEOUT)
            self._pending[sock.fileno()] = p
            self._sel.register(sock, selectors.EVENT_WRITE, p)
            self._step(p, selectors.EVENT_WRITE)  # the hello fits in an empty socket buffer

    def _step(self, p: _Pending, mask: int) -> None:
        """Move the handshake ``p`` on as far as its socket allows."""
        try:
            if mask & selectors.EVENT_WRITE and p.shake.out:
                n = p.sock.send(p.shake.out)
                del p.shake.out[:n]
            if mask & selectors.EVENT_READ:
                data = p.sock.recv(min(_READ_BYTES, max(1, p.shake.missing())))
                if not data:
                    raise AuthenticationError("connection closed during handshake")
                p.shake.received(data)
        except BlockingIOError:
            pass
        except (OSError, AuthenticationError) as e:
            self._drop(p, e if isinstance(e, AuthenticationError) else f"handshake failed: {e}")
            return
        if p.shake.done:
            self._finish(p)
            return
        events = (selectors.EVENT_WRITE if p.shake.out else 0) | (selectors.EVENT_READ if p.shake.missing() else 0)
        self._sel.modify(p.sock, events, p)

    def _finish(self, p: _Pending) -> None:
        self._forget(p)
        try:
            p.sock.setblocking(True)
            sock = p.shake.wrap(p.sock, "{}:{}".format(*p.addr[:2])) if self._sealed else p.sock
            self._on_ready(sock, p.shake.ident, p.addr)
        except Exception as e:  # noqa: BLE001 - any failure means: drop this connection
            self._log(p, e)
            p.sock.close()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._pending:
            p = next(iter(self._pending.values()))  # deadlines come in the order of arrival
            if p.deadline > now:
                return
            self._drop(p, f"no handshake within {auth.HANDSHAKE_TIMEOUT:g} s")

    def _forget(self, p: _Pending) -> None:
        self._pending.pop(p.sock.fileno(), None)
        try:
            self._sel.unregister(p.sock)
        except (KeyError, ValueError):
            pass

    def _drop(self, p: _Pending, why) -> None:
        self._forget(p)
        if why is not None:
            self._log(p, why)
        p.sock.close()

    def _log(self, p: _Pending, why) -> None:
        self._drops.drop(p.addr, why, time.monotonic())


class Wake:
    """A selector loop's wake-up: one eventfd (one descriptor where a socket pair took two: a rank holds a few
    of these, and its descriptors are counted, issue 27); a socket pair where there is no eventfd. Kicking
    one that is closed does nothing (its number may belong to another file by then)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._pair: tuple[socket.socket, socket.socket] | None = None
        if hasattr(os, "eventfd"):
            self._fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:
            self._pair = socket.socketpair()
            self._pair[0].setblocking(False)
            self._fd = self._pair[0].fileno()

    def fileno(self) -> int:
        return self._fd

    def kick(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self._fd < 0:
                return
            if self._pair is None:
                os.eventfd_write(self._fd, 1)
            else:
                self._pair[1].send(b"x")

    def drain(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self._fd < 0:
                return
            if self._pair is None:
                os.eventfd_read(self._fd)
            else:
                self._pair[0].recv(4096)

    def close(self) -> None:
        with self._lock:
            if self._fd < 0:
                return
            if self._pair is None:
                os.close(self._fd)
            else:
                for s in self._pair:
                    s.close()
            self._fd = -1


def stop_loop(wake: Wake, thread: threading.Thread) -> None:
    """Stop a selector loop's thread (the acceptor's, the engine's pulse): a kick of its wake-up, then wait
    for it (5 s at most), unless the caller is that thread (a close from inside the loop)."""
    wake.kick()
    if thread is not threading.current_thread():
        thread.join(5)
