"""The control plane: small framed messages between rank 0 and every other rank, and the job's
verdict on lost peers.

It rides on the TCP mesh (control connections apart from the data connections, so a message sent at
any moment never interleaves with a collective's bytes) and every transport uses this one object,
``comm.ctrl``: the engine sends and receives negotiation messages through it, and a transport blocked
in a data wait calls :meth:`ControlPlane.service` so that an abort or a stall report from rank 0 still
reaches the engine (``on_message``) and ends the wait.

Routing: the connections form a tree (:mod:`hora.transport.plan`: rank 0 at the root, a few children per
rank), so no rank holds more than ``FANOUT + 1`` of them; a frame carries its source and destination, and
a rank that reads one for another rank passes it on toward it (in the engine's loop and in data waits
alike). The engine still addresses ranks, not links: rank 0's ``peers`` are every rank, a worker's is
rank 0. A router that leaves (shutdown) says so on its links first; a rank whose route is gone then
connects straight to the destination (``dial``). A rank that breaks with a lost peer tells its subtree
(a ``DOWN`` frame, passed down), so a death is known below a failed router, or below a dead rank 0,
without any route through them.

Two ways keep the busiest rank's messages per cycle O(FANOUT) instead of O(N): :meth:`ControlPlane.send_tree`
sends one frame that each rank below passes on to its children before reading it itself (rank 0's answers to
everyone), and ``on_up``, set by a router's engine, may take in a frame a child sends toward rank 0 instead of
passing it on (the engine merges its subtree's requests into one, :mod:`hora.engine.subtree`).

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

from hora.base.errors import CommunicatorClosedError, HoraError, PeerLostError
from hora.transport import auth, plan, seal

_POLL_IN = select.POLLIN | select.POLLPRI
_HEAD = struct.Struct("!III")  # payload bytes, source rank, destination rank
_I32 = struct.Struct("!i")
LINK = 0xFFFFFFFF  # the destination of a frame for the neighbour that reads it (LEAVE, DOWN)
TREE = 0xFFFFFFFE  # the destination of a frame for every rank below its sender (send_tree)
XPORT = 0x40000000  # or'ed into a destination rank: a frame for that rank's transport (on_link), not its engine
_LEAVE, _DOWN = b"L", b"D"
CTRL_GRACE = 3.0  # s a data wait goes on after a peer's control connection closed
HEARTBEAT_S = 0.25  # a data wait services the plane at least this often (the stall watch's resolution)

Explain = Callable[[int, str], tuple[int, str]]
Dial = Callable[[int], socket.socket]

class ControlPlane:
    """Control connections of one rank (``conns``: neighbour -> socket) and the failure state of the mesh
    they belong to.

    ``size`` turns routing on (the job's size; the connections are then this rank's links in the control
    tree, :mod:`hora.transport.plan`); without it the connections are the peers (a pair built by hand).
    ``dial(peer)`` opens a direct control connection when the route through the tree is gone.
    ``explain(peer, what) -> (blamed rank, message)`` names the rank at fault when ``peer`` is lost (the
    mesh asks the store who failed first); ``data`` are the mesh's data sockets, which
    :meth:`close_in_child` closes too (:meth:`track` adds one opened later).
    """

    def __init__(self, rank: int, conns: dict[int, socket.socket] | None = None,
                 explain: Explain | None = None, data: Iterable[socket.socket] = (),
                 size: int | None = None, dial: Dial | None = None, fanout: int = plan.FANOUT):
        self.rank = rank
        self._size, self._dial, self._fanout = size, dial, fanout
        # replaced, never changed in place (the accept thread adds links while the engine iterates)
        self._conns = dict(conns or {})
        self._fd = {s.fileno(): p for p, s in self._conns.items()}
        self._ep = select.epoll()  # every link: one descriptor for the engine's own epoll (fds())
        for fd in self._fd:
            self._ep.register(fd, select.EPOLLIN)
        self._lock = threading.RLock()  # the engine, routers' forwarding and shutdown may all send
        self._gone: dict[int, float] = {}  # peer -> deadline: its connection closed during a data wait
        self._left: set[int] = set()  # ranks that said goodbye (expect_close)
        self._explain = explain
        self._data = list(data)
        self._subscribers: list[Callable[[BaseException], None]] = []
        self._broken: BaseException | None = None
        self._news: BaseException | None = None  # a failure to raise at the next receive (see receive)
        self._closed = False
        self.forwarded = 0  # frames passed on for other ranks (counted for tests and the scale simulation)
        self.dropped = 0  # frames for ranks that had left (or whose way had), dropped (see _pass)
        # a router's engine: ``on_up(source, payload)`` is offered each frame a child sends toward rank 0, and
        # True takes it in (not passed on); it may send frames itself (hora.engine.subtree)
        self.on_up: Callable[[int, bytes], bool] | None = None
        # the engine's handler for a message read during a data wait; None: leave messages unread (code
        # that drives a communicator from a thread of its own sets None, so only the engine reads them)
        self.on_message: Callable[[int, bytes], None] | None = None
        # the engine's heartbeat in data waits, ``on_wait(peer, progress, describe)``: see :meth:`service`
        self.on_wait: Callable[[int, object, Callable[[], str]], None] | None = None
        # the mesh's handler of its own frames (``send_link``: closes of idle data links, hora.transport.idle),
        # called wherever a frame is read, like ``on_message``
        self.on_link: Callable[[int, bytes], None] | None = None
        self.polled = False  # receive() was called: someone (the engine) reads this plane

    # -- messages --------------------------------------------------------------------------------
    @property
    def peers(self) -> list[int]:
        """The ranks this rank exchanges messages with (and has not seen leave): on rank 0 every rank,
        elsewhere rank 0; without routing, the ranks it has a connection to."""
        if self._size is None:
            return list(self._conns)
        if self.rank != 0:
            return [] if 0 in self._left else [0]
        return [p for p in range(1, self._size) if p not in self._left]

    @property
    def tree(self) -> tuple[int, int] | None:
        """``(size, fanout)`` of the control tree this plane routes on; None without routing."""
        return None if self._size is None else (self._size, self._fanout)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def links(self) -> list[int]:
        """The neighbours this rank holds a control connection to."""
        return list(self._conns)

    def fds(self) -> list[int]:
        """One descriptor, readable when a link is, for an engine that waits on it itself (epoll);
        links added later are in it too."""
        return [self._ep.fileno()]

    def add_link(self, peer: int, sock: socket.socket) -> None:
        """A control connection to ``peer`` opened after start-up (a rank whose route was gone)."""
        with self._lock:
            if self._closed:
                sock.close()
                return
            old = self._conns.get(peer)
            self._conns = {**self._conns, peer: sock}
            fds = {fd: p for fd, p in self._fd.items() if p != peer}
            fds[sock.fileno()] = peer
            self._fd = fds
            self._ep.register(sock.fileno(), select.EPOLLIN)
        if old is not None:
            _close(old)

    def track(self, sock: socket.socket) -> None:
        """A data connection the mesh opened after start-up (closed by :meth:`close_in_child` too)."""
        self._data.append(sock)

    def untrack(self, sock: socket.socket) -> None:
        """A data connection the mesh closed (an idle one, by agreement with its peer)."""
        self._data = [s for s in self._data if s is not sock]

    def send(self, peer: int, payload: bytes) -> None:
        """Send one framed message (blocking; they are small) to ``peer``, through the tree if need be."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        self._write(self._route(peer), _HEAD.pack(len(payload), self.rank, peer) + payload)

    def send_all(self, peers: Iterable[int], payload: bytes) -> list[int]:
        """Best effort: ``payload`` to each of ``peers``, deepest ranks first (a router forwards its
        subtree's copies before its own arrives, which may end its engine); returns those that failed.
        News sent this way (a goodbye, an abort) goes out as its sender leaves or fails: a write that fails
        breaks nothing here (a peer that shut down cleanly meanwhile is no loss; one that died is named by
        its connection's end, read after the frames it sent before). A closed plane sends nothing: every
        peer failed (a failure path that tells the others must go on to fail its own work)."""
        if self._closed:
            return list(peers)
        failed = []
        deep = self._size is not None and self._size > self._fanout + 1  # a star needs no order
        for p in sorted(peers, reverse=True) if deep else peers:
            if not self._pass(p, _HEAD.pack(len(payload), self.rank, p) + payload):
                failed.append(p)
        return failed

    def send_best(self, peer: int, payload: bytes) -> bool:
        """Best effort, as :meth:`send_all`, for one peer: False if ``payload`` was dropped."""
        return self._pass(peer, _HEAD.pack(len(payload), self.rank, peer) + payload)

    def send_link(self, peer: int, payload: bytes) -> bool:
        """Best effort, as :meth:`send_best`: ``payload`` for ``peer``'s transport (its ``on_link``), not its
        engine; routed like any frame."""
        return self._pass(peer, _HEAD.pack(len(payload), self.rank, peer | XPORT) + payload)

    def send_tree(self, payload: bytes) -> None:
        """``payload`` to every other rank of the tree, as one frame to each child that every router passes
        on to its own children (a ``TREE`` frame) before it reads it: O(FANOUT) writes on any rank. Only from
        rank 0 (the root). Best effort, as :meth:`send_all`: a rank that left is skipped, one that died is
        named by its connection's end."""
        if self._closed:
            return
        frame = _HEAD.pack(len(payload), self.rank, TREE) + payload
        for c in plan.children(self.rank, self._size, self._fanout):
            self._pass(c, frame)

    def _pass(self, dst: int, frame: bytes) -> bool:
        """Best effort: ``frame`` toward ``dst``; False (the frame dropped) when ``dst`` or the way to it has
        left, or the write fails. Never breaks the plane: a hop that died is named when its connection's end
        is read, after whatever it sent before (a router's own answer still unread, say)."""
        if dst in self._left:
            self.dropped += 1  # said goodbye: nobody reads it any more
            return False
        try:
            hop = self._route(dst)
            with self._lock:
                self._conns[hop].sendall(frame)
            return True
        except (HoraError, OSError, KeyError):
            self.dropped += 1
            return False

    def _route(self, peer: int) -> int:
        if peer in self._conns or self._size is None:
            return peer
        if not 0 <= peer < self._size or peer == self.rank:
            raise CommunicatorClosedError(f"rank {self.rank} has no control peer {peer} (size {self._size})")
        hop = plan.next_hop(self.rank, peer, self._fanout)
        if hop in self._conns:
            return hop
        if self._dial is None:
            raise CommunicatorClosedError(f"rank {self.rank}: no control route to rank {peer}: rank {hop} on "
                                          "the way has left")
        self.add_link(peer, self._dial(peer))  # the router left (shutdown): connect straight to the rank
        return peer

    def _write(self, hop: int, frame: bytes) -> None:
        try:
            with self._lock:
                self._conns[hop].sendall(frame)
        except KeyError:
            raise CommunicatorClosedError(f"rank {hop} has left; no control connection to it") from None
        except OSError as e:
            raise self.lost(hop, e) from e

    def receive(self, timeout: float | None, wake_fd: int | None = None,
                window: Callable | None = None) -> list[tuple[int, bytes]]:
        """Wait until a message arrives (or ``wake_fd`` is readable, or the timeout runs out) and
        return every complete message that is ready, as ``(peer, payload)``. ``window(fn, *args)``,
        if given, runs the blocking poll (the engine's safe point for interrupts: around the wait
        only, never around the reads). Frames for other ranks are passed on, not returned."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed")
        self.polled = True
        if self._news is not None:  # a DOWN frame read last time, after messages that were returned first
            news, self._news = self._news, None
            raise news
        if self._gone:
            raise self.lost(next(iter(self._gone)), "control connection closed")
        poller = select.poll()
        for s in self._conns.values():
            poller.register(s.fileno(), _POLL_IN)
        if wake_fd is not None:
            poller.register(wake_fd, _POLL_IN)
        out = []
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        healthy = self._broken is None
        for fd, _ev in poller.poll(ms) if window is None else window(poller.poll, ms):
            link = self._fd.get(fd)
            if link is not None:
                msg = self._read(link)
                if msg is not None:
                    out.append(msg)
        if healthy and self._broken is not None:  # a DOWN frame: a lost rank, news from above
            if not out:
                raise self._broken
            self._news = self._broken  # what came before the news is handled first (a router's last answer)
        return out

    def expect_close(self, peer: int) -> None:
        """``peer`` said goodbye: stop watching its connection (its EOF is not a failure); routes through
        it connect straight to their rank from now on."""
        self._left.add(peer)
        self._unlink(peer)

    def _unlink(self, peer: int) -> None:
        with self._lock:
            sock = self._conns.get(peer)
            if sock is None:
                return
            self._conns = {p: s for p, s in self._conns.items() if p != peer}
            self._fd = {fd: p for fd, p in self._fd.items() if p != peer}
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
        the wait with that error), pass on frames for other ranks, and call a peer lost once its
        connection has been closed for ``CTRL_GRACE`` s. ``ready`` are the descriptors the caller's own
        poll found readable (see :meth:`watch`); without it this polls for up to ``timeout`` s (sleeping
        that long when there is nothing to watch).

        ``waiting = (peer, progress, describe)`` says whom the wait is for (a global rank), a token
        that changes whenever bytes or steps move, and how to describe the peer's state; it goes to
        ``on_wait``, the engine's stall watch over the data phase, which may raise a StallError. A
        transport calls this at least every ``HEARTBEAT_S`` while it waits."""
        if ready is None:
            poller = select.poll()
            self.watch(poller)
            ready = [fd for fd, _ev in poller.poll(max(0, int(timeout * 1000)))]
        for fd in ready:
            link = self._fd.get(fd)  # None once on_message saw the peer say goodbye
            if self._broken is not None or link is None or link in self._gone:
                continue
            msg = self._read(link, during_data=True)
            if msg is not None and self.on_message is not None:
                self.on_message(*msg)
        if self._gone and self._broken is None:
            now = time.monotonic()
            for peer, deadline in list(self._gone.items()):
                if now > deadline and self._broken is None:
                    self.lost(peer, f"control connection closed {CTRL_GRACE:g} s ago")
        if waiting is not None and self.on_wait is not None and self._broken is None:
            self.on_wait(*waiting)

    def _read(self, link: int, during_data: bool = False) -> tuple[int, bytes] | None:
        """One frame from ``link``: ``(source, payload)`` if it is for this rank; a frame for another
        rank is passed on and a link frame acted on (None)."""
        sock = self._conns[link]
        try:
            n, src, dst = _HEAD.unpack(auth.recv_exact(sock, _HEAD.size))
            payload = auth.recv_exact(sock, n)
        except OSError as e:  # ConnectionError (EOF) included
            if during_data and not isinstance(e, seal.TamperedError):
                # A peer that finished its part and shut down closes control before we have read
                # its last data: give the data a grace period before calling the peer lost.
                self._gone.setdefault(link, time.monotonic() + CTRL_GRACE)
                return None
            raise self.lost(link, "connection closed" if isinstance(e, ConnectionError) else e) from e
        if dst & XPORT and dst < TREE:  # for a transport: here, or passed on toward its rank
            if dst ^ XPORT != self.rank:
                self.forwarded += 1
                self._pass(dst ^ XPORT, _HEAD.pack(n, src, dst) + payload)
            elif self.on_link is not None:
                self.on_link(src, payload)
            return None
        if dst == self.rank or self._size is None:
            return src, payload
        if dst == TREE:  # for every rank below: the children's copies first (see send_tree)
            frame = _HEAD.pack(n, src, dst) + payload
            for c in plan.children(self.rank, self._size, self._fanout):
                self.forwarded += 1
                self._pass(c, frame)
            return src, payload
        if dst == LINK:
            if payload[:1] == _LEAVE and 0 not in (link, self.rank):
                # between two ranks other than 0 a link only routes: its end is no failure, and frames for
                # that rank are dropped from now on. A link with rank 0 keeps its meaning: its close without
                # a goodbye (BYE) is a lost rank
                self._left.add(link)
                self._unlink(link)
            elif payload[:1] == _DOWN and self._broken is None:
                (dead,) = _I32.unpack_from(payload, 1)
                text = payload[1 + _I32.size:].decode(errors="replace").split(": ", 1)[-1]
                self.fail(PeerLostError(f"rank {self.rank}: {text}", rank=dead if dead >= 0 else None))
            return None
        if dst == 0 and self.on_up is not None and link != plan.parent(self.rank, self._fanout) \
                and self.on_up(src, payload):
            return None  # taken in by the router's engine (merged with its subtree's)
        self.forwarded += 1
        self._pass(dst, _HEAD.pack(n, src, dst) + payload)
        return None

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
        first = self._broken is None
        if first:
            self._broken = err
        for fail in self._subscribers:
            fail(self._broken)
        if first and isinstance(err, PeerLostError) and self._size is not None and self.rank != 0:
            # the subtree below may have no other way to hear it (its route to rank 0 runs through here)
            down = _DOWN + _I32.pack(err.rank if err.rank is not None else -1) + str(err).encode()
            self._tell_links(plan.children(self.rank, self._size, self._fanout), down)
        return self._broken

    def _tell_links(self, links: Iterable[int], body: bytes) -> None:
        """Best effort: a link frame to each of ``links`` still connected."""
        frame = _HEAD.pack(len(body), self.rank, LINK) + body
        for p in links:
            sock = self._conns.get(p)
            if sock is None:
                continue
            try:
                with self._lock:
                    sock.sendall(frame)
            except OSError:
                pass

    # -- lifetime ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the control connections (the mesh closes its data connections itself)."""
        if self._closed:
            return
        if self._size is not None and self._broken is None:
            self._tell_links(self._conns, _LEAVE)  # routes through this rank end; no neighbour calls it lost
        self._closed = True
        for s in self._conns.values():
            _close(s)
        self._ep.close()

    def close_in_child(self) -> None:
        """In a forked child: close this process's copies of the mesh's descriptors, control and data
        (the parent's stay open), so the child can never talk on the parent's connections."""
        for s in (*self._data, *self._conns.values()):
            _close(s)
        self._ep.close()


def _close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:
        pass
