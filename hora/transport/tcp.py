"""The TCP mesh: authenticated, non-blocking sockets between the pairs of ranks that talk.

Setup: each rank listens on an ephemeral port, publishes ``host:port`` in the rendezvous store (one
request) and reads every rank's in one more (a gather), then opens what the connection plan
(:mod:`hora.transport.plan`) asks for at start-up: data connections to its ring neighbours, control
connections to its parent and children in the control tree. Any other pair connects on its first
collective together (the higher rank dials), so a rank holds O(1) connections for a ring workload
whatever the job's size; those opened on first use are closed again, by agreement with the peer, past a
bound (``HORA_LAZY_LINKS``, :mod:`hora.transport.idle`). Each connection proves knowledge of the job secret both ways
(:mod:`hora.transport.auth`) and names the connecting rank and the job generation, so a stale or
foreign connection is dropped with a log line. The listener stays open for the life of the
communicator; its handshakes all run at once in one thread (:mod:`hora.transport.acceptor`), so a
silent stranger delays no rank.

Data: requests queue per peer and progress inside ``wait`` (poll on the sockets that have work),
so a ring step sends and receives at once. OS errors are translated here, once, into
:class:`PeerLostError` naming the rank.
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import time
from typing import Callable

import numpy as np

from hora.base import knobs
from hora.base.errors import CommunicatorClosedError, HoraError, HoraValueError
from hora.transport import idle, net, plan, seal
from hora.transport.base import CommunicatorBase, PendingRequest, byte_view, timed_out
from hora.transport.control import HEARTBEAT_S, ControlPlane
from hora.transport.links import Links, MeshPort, find, publish
from hora.transport.links import connect as _connect  # the dial, looked up at each call (tests relay it)
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
    """Point-to-point between ranks over authenticated sockets; ``ctrl`` is the control plane over the
    mesh's control connections, whose failure state this communicator shares. ``links`` opens the
    connection to a peer not in ``socks`` on first use (None: ``socks`` are all there is); past ``lazy_links``
    of those (0: no bound) the least recently used idle one is closed (:mod:`hora.transport.idle`)."""

    name = "TCP"

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket], ctrl: ControlPlane,
                 closer: Callable[[], None] | None = None, links: Links | None = None,
                 lazy_links: int = idle.DEFAULT_BOUND):
        self.rank, self.size = rank, size
        self._socks = dict(socks)
        for s in socks.values():
            s.setblocking(False)
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        self.ctrl = ctrl
        self._sendq: dict[int, collections.deque[TcpRequest]] = collections.defaultdict(collections.deque)
        self._recvq: dict[int, collections.deque[TcpRequest]] = collections.defaultdict(collections.deque)
        self._links = links
        self._awaiting: set[int] = set()  # peers with requests queued, whose connection has not come yet
        self._closer = closer
        self._closed = False
        self._moved = 0  # bytes moved in either direction (the stall watch's token of progress)
        self._cache = idle.LinkCache(self, lazy_links)
        self._planned = self._cache.planned if links is not None else frozenset(range(size))
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
        if peer not in self._planned:  # a lazy link: its place in the cache, its byte counts
            self._cache.use(peer, len(req.view), queues is self._sendq)
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
        self._cache.close()
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
        if self._cache.inbox:
            self._cache.serve()
        if peer not in self._socks:
            if self._links is None or not 0 <= peer < self.size or peer == self.rank:
                raise HoraValueError(f"rank {self.rank} has no connection to rank {peer} (size {self.size})")
            self._link(peer)
        return TcpRequest(self, peer, byte_view(buf))

    def _link(self, peer: int) -> None:
        """First use of ``peer``: dial it (a lower rank), or take its connection if it has dialed this
        rank already, else let the request wait in its queue until it does (see :meth:`_progress`); a link
        being closed (:mod:`hora.transport.idle`) keeps its requests queued until the peer answered."""
        if peer in self._cache.closing:
            return
        if not plan.dials(self.rank, peer):
            sock = self._links.port.take(peer)
            if sock is None:
                self._awaiting.add(peer)
            else:
                self._adopt(peer, sock)
            return
        try:
            sock = self._links.dial(peer)
        except HoraError as e:  # its port is open as long as its communicator: it is gone
            raise self.ctrl.lost(peer, f"its first connection failed: {e}") from e
        self._adopt(peer, sock)

    def _adopt(self, peer: int, sock: socket.socket) -> None:
        net.tune(sock, buffers=True)
        sock.setblocking(False)
        self._socks[peer] = sock
        self._fd_peer[sock.fileno()] = peer
        self._awaiting.discard(peer)
        self.ctrl.track(sock)
        self._cache.opened(peer)
        if self._sendq[peer]:
            self._pump_send(peer)
        if self._recvq[peer]:
            self._pump_recv(peer)

    def _arrivals(self) -> None:
        """Adopt the connections that peers this rank waits for have opened."""
        self._links.port.drain()
        if self._cache.inbox:
            self._cache.serve()
        for peer in list(self._awaiting):
            sock = self._links.port.take(peer)
            if sock is not None:
                self._adopt(peer, sock)

    def _fail_all(self, err: BaseException) -> None:
        for q in (*self._sendq.values(), *self._recvq.values()):
            while q:
                r = q.popleft()
                r.error, r.done = err, True

    def _pump_send(self, peer: int) -> None:
        if peer in self._socks:  # else it waits for the peer to connect
            self._pump(peer, self._sendq[peer], self._socks[peer].send)

    def _pump_recv(self, peer: int) -> None:
        if peer in self._socks:
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
                # news that came with the close (a stall shutdown, an abort) says why: it goes first
                self.ctrl.service(0.0)
                self.ctrl.lost(peer, "connection closed")
                return
            req.off += n
            self._moved += n
            if req.off == len(req.view):
                req.done = True
                q.popleft()
                if not q and self._cache.over:  # a link may have gone idle: close the least recent past the bound
                    self._cache.trim()

    def _progress(self, timeout_ms: int, waiting: TcpRequest | None = None) -> None:
        poller = select.poll()
        any_fd = False
        link_fd = -1
        cache = self._cache
        if self._awaiting or cache.inbox:
            self._arrivals()
        if self._awaiting or cache.lru:  # the port's wake-up: a connection came, or a close frame (idle.py)
            link_fd = self._links.port.fd
            poller.register(link_fd, _POLL_IN)
            any_fd = bool(self._awaiting)
        if cache.closing:  # requests may wait for a close's answer; a socket being closed may end
            cache.watch(poller)
            any_fd = True
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
            if fd == link_fd:
                self._arrivals()
                continue
            if fd in cache.closing_fd:
                cache.seen(fd)
                continue
            p = self._fd_peer.get(fd)
            if p is None:  # closed by a close frame handled meanwhile (idle.py)
                continue
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
        if cache.closing:
            cache.resend()

    def _describe(self, req: TcpRequest) -> str:
        if req.peer in self._cache.closing:
            return (f"its idle connection to rank {req.peer} is being closed: this rank proposed it and waits for "
                    f"the answer, which rank {req.peer} sends when it next reads its control frames")
        if req.peer not in self._socks:
            return (f"no connection yet: this is its first collective with rank {req.peer}, which connects "
                    "when it reaches it")
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


def connect_mesh(rank: int, size: int, store: StoreClient, prefix: str, secret: bytes,
                 bind_host: str = "127.0.0.1", advertise_host: str | None = None,
                 timeout: float = 30.0, fanout: int = plan.FANOUT) -> TcpCommunicator:
    """Build ``rank``'s part of the mesh of ``size`` (the start-up connections of the plan, the others
    on first use) and return its communicator: two store requests, whatever ``size``.

    ``prefix`` names this job generation in the store (e.g. ``"job1/3"``); every rank must use the same.
    """
    listener = socket.create_server((bind_host, 0), backlog=socket.SOMAXCONN)
    port = MeshPort(listener, secret, rank, size, prefix, fanout)
    try:
        publish(store, prefix, rank, f"{advertise_host or bind_host}:{listener.getsockname()[1]}")
        addrs = find(store, prefix, rank, size, timeout)
        links = Links(rank, prefix, secret, addrs, port, lambda *a, **k: _connect(*a, **k))
        socks = {p: links.dial(p, timeout=timeout) for p in plan.ring_neighbours(rank, size) if plan.dials(rank, p)}
        up = plan.parent(rank, fanout)
        ctrl = {} if up is None else {up: links.dial(up, "c", timeout)}
        for (peer, chan), sock in port.wait_all(timeout).items():
            net.tune(sock, buffers=chan == "d")
            (socks if chan == "d" else ctrl)[peer] = sock
    except BaseException:
        port.close()
        raise

    key = f"{prefix}/abort"

    def explain(peer: int, what: str) -> tuple[int, str]:
        return blame(store.try_get, store.set, key, rank, peer, what)

    plane = ControlPlane(rank, ctrl, explain, data=socks.values(), size=size, dial=links.dial_ctrl, fanout=fanout)
    port.attach(plane.add_link)
    return TcpCommunicator(rank, size, socks, plane, closer=port.close, links=links,
                           lazy_links=knobs.value("lazy_links"))


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
