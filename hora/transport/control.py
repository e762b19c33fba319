"""The control plane: small framed messages between rank 0 and every other rank, and the job's
verdict on lost peers.

It rides on the TCP mesh (one control connection per rank pair with rank 0, apart from the data
connections, so a message sent at any moment never interleaves with a collective's bytes) and every
transport uses this one object, ``comm.ctrl``: the engine sends and receives negotiation messages
through it, and a transport blocked in a data wait calls :meth:`ControlPlane.service` so that an
abort or a stall report from rank 0 still reaches the engine (``on_message``) and ends the wait.

Data waits also give the engine a heartbeat (``on_wait``, through :meth:`ControlPlane.service`): whom
they wait for and whether anything moved, so that a peer frozen in the middle of a collective is
noticed whichever thread waits.

It also holds the one failure state of the job's connections: the first :meth:`lost` peer (or
:meth:`fail`) makes ``broken`` an error that every transport built on the mesh raises, and each
transport subscribes to fail its own pending requests at that moment.
"""

from __future__ import annotations

import select
import socket
import struct
import threading
import time
from typing import Callable, Iterable

from hora.base.errors import CommunicatorClosedError, PeerLostError
from hora.transport import auth, seal

_POLL_IN = select.POLLIN | select.POLLPRI
_LEN = struct.Struct("!I")
CTRL_GRACE = 3.0  # s a data wait goes on after a peer's control connection closed
HEARTBEAT_S = 0.25  # a data wait services the plane at least this often (the stall watch's resolution)

Explain = Callable[[int, str], tuple[int, str]]


class ControlPlane:
    """Control connections of one rank (``conns``: peer -> socket; rank 0 has one per rank, the others
    one to rank 0) and the failure state of the mesh they belong to.

    ``explain(peer, what) -> (blamed rank, message)`` names the rank at fault when ``peer`` is lost (the
    mesh asks the store who failed first); ``data`` are the mesh's data sockets, which
    :meth:`close_in_child` closes too.
    """

    def __init__(self, rank: int, conns: dict[int, socket.socket] | None = None,
                 explain: Explain | None = None, data: Iterable[socket.socket] = ()):
        self.rank = rank
        self._conns = dict(conns or {})
        self._fd = {s.fileno(): p for p, s in self._conns.items()}
        self._lock = threading.Lock()  # the engine and shutdown may both send
        self._gone: dict[int, float] = {}  # peer -> deadline: its connection closed during a data wait
        self._explain = explain
        self._data = list(data)
        self._subscribers: list[Callable[[BaseException], None]] = []
        self._broken: BaseException | None = None
        self._closed = False
        # the engine's handler for a message read during a data wait; None: leave messages unread (code
        # that drives a communicator from a thread of its own sets None, so only the engine reads them)
        self.on_message: Callable[[int, bytes], None] | None = None
        # the engine's heartbeat in data waits, ``on_wait(peer, progress, describe)``: see :meth:`service`
        self.on_wait: Callable[[int, object, Callable[[], str]], None] | None = None

    # -- messages --------------------------------------------------------------------------------
    @property
    def peers(self) -> list[int]:
        """The ranks this rank has a control connection to (and has not seen leave)."""
        return list(self._conns)

    def fds(self) -> list[int]:
        """The connections' descriptors, for an engine that waits on them itself (epoll)."""
        return [s.fileno() for s in self._conns.values()]

    def send(self, peer: int, payload: bytes) -> None:
        """Send one framed message (blocking; they are small)."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        try:
            with self._lock:
                self._conns[peer].sendall(_LEN.pack(len(payload)) + payload)
        except KeyError:
            raise CommunicatorClosedError(f"rank {peer} has left; no control connection to it") from None
        except OSError as e:
            raise self.lost(peer, e) from e

    def receive(self, timeout: float | None, wake_fd: int | None = None,
                window: Callable | None = None) -> list[tuple[int, bytes]]:
        """Wait until a message arrives (or ``wake_fd`` is readable, or the timeout runs out) and
        return every complete message that is ready, as ``(peer, payload)``. ``window(fn, *args)``,
        if given, runs the blocking poll (the engine's safe point for interrupts: around the wait
        only, never around the reads)."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed")
        if self._gone:
            raise self.lost(next(iter(self._gone)), "control connection closed")
        poller = select.poll()
        for s in self._conns.values():
            poller.register(s.fileno(), _POLL_IN)
        if wake_fd is not None:
            poller.register(wake_fd, _POLL_IN)
        out = []
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        for fd, _ev in poller.poll(ms) if window is None else window(poller.poll, ms):
            peer = self._fd.get(fd)
            if peer is not None:
                msg = self._read(peer)
                if msg is not None:
                    out.append((peer, msg))
        return out

    def expect_close(self, peer: int) -> None:
        """``peer`` said goodbye: stop watching its connection (its EOF is not a failure)."""
        sock = self._conns.pop(peer, None)
        if sock is not None:
            self._fd.pop(sock.fileno(), None)
            self._gone.pop(peer, None)
            sock.close()

    # -- during a data wait ----------------------------------------------------------------------
    def watch(self, poller: select.poll) -> set[int]:
        """Register the connections a data wait should wake for on ``poller`` and return their
        descriptors (none while nobody handles messages: then they stay for the engine to read)."""
        if self.on_message is None:
            return set()
        fds = {s.fileno() for p, s in self._conns.items() if p not in self._gone}
        for fd in fds:
            poller.register(fd, _POLL_IN)
        return fds

    def service(self, timeout: float = 0.0, ready: Iterable[int] | None = None,
                waiting: tuple[int, object, Callable[[], str]] | None = None) -> None:
        """What every transport does for the control plane while it waits for data: read the messages
        that arrived and hand each to ``on_message`` (which may raise: an abort or a stall report ends
        the wait with that error), and call a peer lost once its connection has been closed for
        ``CTRL_GRACE`` s. ``ready`` are the descriptors the caller's own poll found readable (see
        :meth:`watch`); without it this polls for up to ``timeout`` s (sleeping that long when there
        is nothing to watch).

        ``waiting = (peer, progress, describe)`` says whom the wait is for (a global rank), a token
        that changes whenever bytes or steps move, and how to describe the peer's state; it goes to
        ``on_wait``, the engine's stall watch over the data phase, which may raise a StallError. A
        transport calls this at least every ``HEARTBEAT_S`` while it waits."""
        if ready is None:
            poller = select.poll()
            self.watch(poller)
            ready = [fd for fd, _ev in poller.poll(max(0, int(timeout * 1000)))]
        for fd in ready:
            peer = self._fd.get(fd)  # None once on_message saw the peer say goodbye
            if self._broken is not None or peer is None or peer in self._gone:
                continue
            msg = self._read(peer, during_data=True)
            if msg is not None and self.on_message is not None:
                self.on_message(peer, msg)
        if self._gone and self._broken is None:
            now = time.monotonic()
            for peer, deadline in list(self._gone.items()):
                if now > deadline and self._broken is None:
                    self.lost(peer, f"control connection closed {CTRL_GRACE:g} s ago")
        if waiting is not None and self.on_wait is not None and self._broken is None:
            self.on_wait(*waiting)

    def _read(self, peer: int, during_data: bool = False) -> bytes | None:
        sock = self._conns[peer]
        try:
            head = auth.recv_exact(sock, _LEN.size)
            return auth.recv_exact(sock, _LEN.unpack(head)[0])
        except OSError as e:  # ConnectionError (EOF) included
            if during_data and not isinstance(e, seal.TamperedError):
                # A peer that finished its part and shut down closes control before we have read
                # its last data: give the data a grace period before calling the peer lost.
                self._gone.setdefault(peer, time.monotonic() + CTRL_GRACE)
                return None
            raise self.lost(peer, "connection closed" if isinstance(e, ConnectionError) else e) from e

    # -- failure -----------------------------------------------------------------------------------
    @property
    def broken(self) -> BaseException | None:
        """The first failure of this mesh (a lost peer), raised by every transport on it; None while healthy."""
        return self._broken

    def subscribe(self, fail: Callable[[BaseException], None]) -> None:
        """``fail(error)`` runs whenever the plane breaks (at once if it is broken): a transport fails its
        pending requests there."""
        self._subscribers.append(fail)
        if self._broken is not None:
            fail(self._broken)

    def lost(self, peer: int, cause: BaseException | str) -> BaseException:
        """Mark ``peer`` lost (``cause``: the OS error, or what was seen) and return the error every
        transport now raises: a :class:`PeerLostError` naming the rank at fault, first failure wins."""
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        if self._explain is not None:
            dead, msg = self._explain(peer, what)
        else:
            dead, msg = peer, f"lost the connection to rank {peer} ({what}); that rank died or aborted"
        err = PeerLostError(f"rank {self.rank}: {msg}", rank=dead)
        if not isinstance(cause, str):
            err.__cause__ = cause
        return self.fail(err)

    def fail(self, err: BaseException) -> BaseException:
        """Break the plane with ``err`` (unless it broke before) and tell the subscribers; returns ``broken``."""
        if self._broken is None:
            self._broken = err
        for fail in self._subscribers:
            fail(self._broken)
        return self._broken

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the control connections (the mesh closes its data connections itself)."""
        if self._closed:
            return
        self._closed = True
        for s in self._conns.values():
            _close(s)

    def close_in_child(self) -> None:
        """In a forked child: close this process's copies of the mesh's descriptors, control and data
        (the parent's stay open), so the child can never talk on the parent's connections."""
        for s in (*self._data, *self._conns.values()):
            _close(s)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
