"""The TCP mesh: one authenticated, non-blocking socket between every pair of ranks.

Setup: each rank listens on an ephemeral port, publishes ``host:port`` in the rendezvous store,
connects to every lower rank and accepts every higher one. Each connection proves knowledge of the
job secret both ways (:mod:`hora.transport.auth`) and names the connecting rank and the job
generation, so a stale or foreign connection is dropped with a log line while setup goes on. The
listener stays open for the life of the communicator, refusing latecomers the same way; its
handshakes all run at once in one thread (:mod:`hora.transport.acceptor`), so a silent stranger
delays no rank.

Data: requests queue per peer and progress inside ``wait`` (poll on the sockets that have work),
so a ring step sends and receives at once. OS errors are translated here, once, into
:class:`PeerLostError` naming the rank.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import select
import socket
import threading
import time
from typing import Callable

import numpy as np

from hora.base.errors import CommunicatorClosedError, HoraError, HoraTimeoutError, HoraValueError
from hora.transport import auth, net, seal
from hora.transport.acceptor import Acceptor
from hora.transport.base import CommunicatorBase, PendingRequest, byte_view, timed_out
from hora.transport.control import HEARTBEAT_S, ControlPlane
from hora.transport.store import StoreClient

_POLL_IN = select.POLLIN | select.POLLPRI
_HEARTBEAT_MS = int(HEARTBEAT_S * 1000)


class TcpRequest(PendingRequest):
    """One pending send or receive: its bytes and how many have moved."""

    __slots__ = ("view", "off")

    def __init__(self, comm: "TcpCommunicator", peer: int, view: memoryview):
        super().__init__(comm, peer, len(view) == 0)
        self.view, self.off = view, 0


class TcpCommunicator(CommunicatorBase):
    """Point-to-point between ranks over established, authenticated sockets; ``ctrl`` is the control
    plane over the mesh's control connections, whose failure state this communicator shares."""

    name = "TCP"

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket], ctrl: ControlPlane,
                 closer: Callable[[], None] | None = None):
        self.rank, self.size = rank, size
        self._socks = socks
        for s in socks.values():
            s.setblocking(False)
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        self.ctrl = ctrl
        self._sendq: dict[int, collections.deque[TcpRequest]] = {p: collections.deque() for p in socks}
        self._recvq: dict[int, collections.deque[TcpRequest]] = {p: collections.deque() for p in socks}
        self._closer = closer
        self._closed = False
        self._moved = 0  # bytes moved in either direction (the stall watch's token of progress)
        ctrl.subscribe(self._fail_all)

    # -- public point-to-point -------------------------------------------------------------
    def isend(self, peer: int, buf: np.ndarray) -> TcpRequest:
        return self._queue(peer, buf, self._sendq, self._pump_send)

    def irecv_into(self, peer: int, buf: np.ndarray) -> TcpRequest:
        return self._queue(peer, buf, self._recvq, self._pump_recv)

    def _queue(self, peer: int, buf: np.ndarray, queues, pump) -> TcpRequest:
        """A request on ``peer``'s send or receive queue, started at once when the queue was empty."""
        req = self._make(peer, buf)
        if req.done:  # zero bytes: nothing to move (and recv_into would read as EOF)
            return req
        q = queues[peer]
        q.append(req)
        if len(q) == 1:
            pump(peer)
        return req

    def links(self) -> dict[int, socket.socket]:
        """The data connections by peer, for a transport that moves its data another way (MPI) and
        watches them only for their end, which tells it that a peer closed or died: it must never read
        from them (a caller may still run the plain ring over this mesh)."""
        return dict(self._socks)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in self._socks.values():
            with contextlib.suppress(OSError):
                s.close()
        self.ctrl.close()
        if self._closer is not None:
            self._closer()

    # -- machinery -------------------------------------------------------------------------
    def _make(self, peer: int, buf: np.ndarray) -> TcpRequest:
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        if self.ctrl.broken is not None:
            raise self.ctrl.broken
        if peer not in self._socks:
            raise HoraValueError(f"rank {self.rank} has no connection to rank {peer} (size {self.size})")
        return TcpRequest(self, peer, byte_view(buf))

    def _fail_all(self, err: BaseException) -> None:
        for q in (*self._sendq.values(), *self._recvq.values()):
            while q:
                r = q.popleft()
                r.error, r.done = err, True

    def _pump_send(self, peer: int) -> None:
        self._pump(peer, self._sendq[peer], self._socks[peer].send)

    def _pump_recv(self, peer: int) -> None:
        self._pump(peer, self._recvq[peer], self._socks[peer].recv_into)

    def _pump(self, peer: int, q: collections.deque[TcpRequest], move: Callable[[memoryview], int]) -> None:
        """Move bytes of the requests queued in ``q`` until the socket would block (``move``: the
        socket's ``send`` or ``recv_into``; 0 bytes moved means the peer closed the connection)."""
        while q:
            req = q[0]
            try:
                n = move(req.view[req.off:])
            except BlockingIOError:
                return
            except OSError as e:
                self.ctrl.lost(peer, e)
                return
            if n == 0:
                self.ctrl.lost(peer, "connection closed")
                return
            req.off += n
            self._moved += n
            if req.off == len(req.view):
                req.done = True
                q.popleft()

    def _progress(self, timeout_ms: int, waiting: TcpRequest | None = None) -> None:
        poller = select.poll()
        any_fd = False
        for p, s in self._socks.items():
            mask = (select.POLLOUT if self._sendq[p] else 0) | (_POLL_IN if self._recvq[p] else 0)
            if mask:
                poller.register(s.fileno(), mask)
                any_fd = True
        if not any_fd:
            return
        ctrl_fds = self.ctrl.watch(poller)  # control messages interrupt a data wait (abort, stall report)
        events = poller.poll(timeout_ms)
        for fd, ev in events:  # data first: a peer's last bytes count before its goodbye
            if fd in ctrl_fds:
                continue
            p = self._fd_peer[fd]
            if ev & (select.POLLOUT | select.POLLERR | select.POLLHUP) and self._sendq[p]:
                self._pump_send(p)
            if ev & (_POLL_IN | select.POLLERR | select.POLLHUP) and self._recvq[p]:
                self._pump_recv(p)
            if ev & select.POLLNVAL:
                self.ctrl.lost(p, "socket closed")
        w = None
        if waiting is not None and not events:  # a quiet poll: tell the engine's stall watch whom we wait for
            w = (waiting.peer, (id(waiting), waiting.off, self._moved), lambda: self._describe(waiting))
        self.ctrl.service(ready=[fd for fd, _ev in events if fd in ctrl_fds], waiting=w)

    def _describe(self, req: TcpRequest) -> str:
        kind = "receive from" if req in self._recvq.get(req.peer, ()) else "send to"
        return f"{req.off} of {len(req.view)} bytes of a {kind} it moved so far over TCP"

    def _wait_for(self, req: TcpRequest, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not req.done:
            if self._closed:
                raise CommunicatorClosedError("this communicator was closed while a request was pending")
            if deadline is None:
                ms = _HEARTBEAT_MS
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise timed_out(self.rank, req.peer, timeout)
                ms = max(1, min(_HEARTBEAT_MS, int(left * 1000)))
            self._progress(ms, req)


class _MeshPort:
    """What the data port accepts, for the communicator's whole life (:class:`Acceptor` runs the
    handshakes): during setup, the authenticated connections of the expected ranks, collected for
    :meth:`wait_all`; anything else (a stale generation, a duplicate, a latecomer, an identity that is
    no rank of this job) is dropped with a log line.
    """

    def __init__(self, listener: socket.socket, secret: bytes, rank: int, size: int, gen: str):
        self.rank, self.gen = rank, gen
        self.expected = {(p, "d") for p in range(rank + 1, size)}
        if rank == 0:
            self.expected |= {(p, "c") for p in range(1, size)}
        self.socks: dict[tuple[int, str], socket.socket] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.acceptor = Acceptor(listener, secret, self._claim, f"hora rank {rank}: data port")

    def _claim(self, sock: socket.socket, ident_b: bytes, peer) -> None:
        ident = ident_b.decode("ascii", "replace")
        parts = ident.split("|")
        if len(parts) != 4 or not parts[0].isdigit() or not parts[2].isdigit() or parts[3] not in ("d", "c"):
            raise HoraError(f"malformed identity {ident[:80]!r} (expected rank|generation|rank|channel)")
        src, gen, dst, chan = parts
        key = (int(src), chan)
        if gen != self.gen or int(dst) != self.rank:
            raise HoraError(f"connection for generation {gen} rank {dst}, expected {self.gen} rank {self.rank}")
        with self.cond:
            if self.closed or key not in self.expected or key in self.socks:
                raise HoraError(f"unexpected connection claiming rank {src} ({chan})")
            self.socks[key] = sock
            self.cond.notify_all()

    def wait_all(self, timeout: float) -> dict[tuple[int, str], socket.socket]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while set(self.socks) != self.expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({p for p, _ in self.expected - set(self.socks)})
                    raise HoraTimeoutError(f"rank {self.rank}: ranks {missing} did not connect within {timeout:g} s; "
                                           "did they start? (raise --start-timeout if they are slow)")
                self.cond.wait(left)
            return dict(self.socks)

    def close(self) -> None:
        with self.cond:
            self.closed = True
        self.acceptor.close()


def connect_mesh(rank: int, size: int, store: StoreClient, prefix: str, secret: bytes,
                 bind_host: str = "127.0.0.1", advertise_host: str | None = None,
                 timeout: float = 30.0) -> TcpCommunicator:
    """Build the full mesh for ``rank`` of ``size`` and return its communicator.

    ``prefix`` names this job generation in the store (e.g. ``"job1/3"``); every rank must use the same.
    """
    listener = socket.create_server((bind_host, 0), backlog=socket.SOMAXCONN)
    port = listener.getsockname()[1]
    acceptor = _MeshPort(listener, secret, rank, size, prefix)
    try:
        store.set(f"{prefix}/addr/{rank}", f"{advertise_host or bind_host}:{port}".encode())
        socks: dict[int, socket.socket] = {}
        ctrl: dict[int, socket.socket] = {}
        for peer in range(rank):
            addr = store.get(f"{prefix}/addr/{peer}", timeout=timeout).decode()
            socks[peer] = _connect(addr, peer, rank, prefix, secret, timeout, "d")
            if peer == 0:
                ctrl[0] = _connect(addr, peer, rank, prefix, secret, timeout, "c")
        for (peer, chan), sock in acceptor.wait_all(timeout).items():
            (socks if chan == "d" else ctrl)[peer] = sock
    except BaseException:
        acceptor.close()
        raise
    for s in socks.values():
        net.tune(s, buffers=True)
    for s in ctrl.values():
        net.tune(s)

    key = f"{prefix}/abort"

    def explain(peer: int, what: str) -> tuple[int, str]:
        return blame(store.try_get, store.set, key, rank, peer, what)

    return TcpCommunicator(rank, size, socks, ControlPlane(rank, ctrl, explain, data=socks.values()),
                           closer=acceptor.close)


def _connect(addr: str, peer: int, rank: int, prefix: str, secret: bytes, timeout: float,
             chan: str) -> socket.socket:
    host, port = net.parse_addr(addr)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            return auth.connect_handshake(sock, secret, f"{rank}|{prefix}|{peer}|{chan}".encode())
        except (OSError, HoraError) as e:
            retry = isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT)
            if not retry or time.monotonic() >= deadline:
                kind = HoraTimeoutError if retry else HoraError  # still refused at the deadline: not up in time
                raise kind(f"rank {rank}: cannot connect to rank {peer} at {addr}: {e}") from e
            time.sleep(0.05)


def blame(read, write, key: str, rank: int, peer: int, what: str) -> tuple[int, str]:
    """Who is to blame when ``rank`` lost ``peer`` (``what``: the error seen), as ``(rank, message)``,
    from this rank's own view: the rank named by the job's first failure note (``read(key)``: the first
    rank that lost a peer leaves one, ``write``) when that is another rank; never this rank itself. A
    note naming this rank, which is alive to read it, is the other side of a partition: the two lost
    each other, and the one to blame from here is ``peer``."""
    own = f"lost the connection to rank {peer} ({what})"
    gone = seal.CAUGHT if seal.TAMPERED in what else f"rank {peer} died or aborted, or the network between them failed"
    try:
        note = read(key)
        if not note:
            write(key, f"{peer}|rank {rank} lost the connection to rank {peer} ({what})".encode())
    except HoraError:
        return peer, f"{own}; {gone}"
    if not note:
        return peer, f"{own}; {gone}"
    head, _, first = note.decode(errors="replace").partition("|")
    dead = int(head) if head.lstrip("-").isdigit() else peer
    if dead == rank:  # the other side's view of this very failure: it lost this rank, which lives
        by = first.split(" ", 2)[1] if first.startswith("rank ") else str(peer)
        other = int(by) if by.isdigit() and int(by) != rank else peer
        text = (f"rank {other} and rank {rank} lost each other" if other == peer else
                f"rank {other} lost this rank and this rank {own}")
        why = seal.CAUGHT if seal.TAMPERED in first else ("the network between them failed (a partition, a link down, "
                                                          "a firewall)")
        return peer, f"{text} (this side: {what}; the other: {first}): both were alive, so {why}"
    if dead == peer:
        return peer, f"{own}; rank {peer} died or aborted, or the network between them failed ({first})"
    return dead, f"{own} after the job's first failure: {first}; rank {dead} died or aborted, or was cut off"
