"""A bounded cache of the data connections a rank opened on first use, and how two ranks agree to close one.

The TCP mesh (:mod:`hora.transport.tcp`) opens its *planned* data connections at start-up (the ring
neighbours, :mod:`hora.transport.plan`) and any other peer's on the first collective that needs it (an
alltoall, a process set's ring). Planned links are never counted and never closed. Lazy ones are kept in
least-recently-used order, and when a rank holds more than ``HORA_LAZY_LINKS`` of them, it proposes to close
the least recently used that is idle; a later use of that peer connects again through the same first-use
path. So after any number of alltoalls a rank holds O(bound) data connections, not N - 1.

Why an agreement: a data connection carries raw bytes whose sizes both ends know from the collective, with
no framing; a close that one side decides alone would race with a collective the other has just started
(bytes lost, or a request that reads the close as the peer's death). So a close takes two messages on the
control plane (:meth:`hora.transport.control.ControlPlane.send_link`, frames for the transport, not the
engine), never a byte on the data connection itself:

1. ``PROPOSE(token, epoch, sent, received)``: the proposer has nothing queued on the link. It takes the
   socket out of use (requests queued for that peer from now on wait, as for a connection not yet open)
   and sends the link's epoch (how many times this pair's link was closed before: both ends count the
   same, since each end closes each connection once) and the bytes it has ever queued to and from that peer.
2. The other side agrees only if it has nothing queued on the link either, its epoch is the same (the
   proposal is about this connection, not one closed since: proposals cross, and a frame through the
   control tree may arrive after the connection it named was replaced) and its own counts mirror the
   proposer's (it received every byte the proposer sent, and the proposer every byte it sent): then no
   byte is in flight either way, and nobody is in a collective with the other on this link. It closes its
   socket and answers ``AGREE(token)``; otherwise it answers ``REFUSE(token)`` and keeps it.
3. On ``AGREE`` the proposer closes its socket too, and connects again at once if requests were queued
   meanwhile; on ``REFUSE`` it puts the socket back and moves them. An answer whose token is not the
   pending proposal's is stale and ignored.

Who dials after a close: the higher rank, as always (:func:`hora.transport.plan.dials`); the lower rank's
port forgets the old connection (:meth:`hora.transport.links.MeshPort.forget`) before the agreement leaves
it, so the new dial is welcome. Either side may propose (else the lowest ranks, which never dial, would
keep every connection); when both propose at once, each answers the other's proposal by the rules above
and the tokens sort out which answers still count, so the link ends closed on both sides or on neither.

Lost frames: a frame routed through a rank that shut down meanwhile (rank 0, the star's hub, leaves as soon
as its own part is done) is dropped. A proposer whose requests wait on an answer sends its proposal again
every ``RESEND_S`` (by then the route is direct); a rank answers a proposal it has answered before (same
token) with the same answer, so a resent proposal never changes the outcome.

Liveness: a side closes its socket only after it has agreed, and a socket being closed is out of the
communicator's polls, so an orderly close is never read as a death. While its proposal waits, a proposer
that is waiting for data anyway watches the socket: its end means the peer is done with the link (it
agreed, or shut down, or died; never a refusal, which keeps the link open), so the proposer closes its end
at once, connects again if requests wait for the peer, and ignores the ``AGREE`` that may follow. A dead
peer is then named by the failed connection or, as ever, by the control plane (the dead rank's tree and
ring neighbours, the store's first-failure note); a peer that shut down is never called lost for it.

Shared memory keeps no pairwise links (its segments are per job and per process set, :mod:`hora.transport.shm`,
mapped once and closed with the communicator): its point-to-point goes through this mesh, so the bound covers
it too.

Threads: the frames are handled by whoever reads the control plane. With an engine (``on_message`` set),
that reader is the thread driving the communicator (the baton's holder), so they are handled at once;
otherwise (a test's thread driving the communicator while the engine thread reads) they wait in an inbox,
with a wake-up on the port's descriptor, for the driving thread (:meth:`LinkCache.serve`). A communicator
used without an engine, whose plane nobody reads, never proposes (no answer would come): there the bound
does not apply.
"""

from __future__ import annotations

import collections
import select
import socket
import struct
import time

from hora.transport import plan

PROPOSE, AGREE, REFUSE = b"P", b"A", b"R"
_PROP = struct.Struct("!IIQQ")  # token, the link's epoch, bytes the proposer queued to the peer and from it
_ANS = struct.Struct("!I")  # the token answered
DEFAULT_BOUND = -1  # a quarter of the open-file limit (:func:`resolve`)
RESEND_S = 1.0  # s a proposal that requests wait on goes unanswered before it is sent again


def resolve(bound: int) -> int:
    """The bound kept: ``bound``, or for -1 a quarter of this process's soft open-file limit, at least 64
    (none where that limit is infinite). Below an alltoall's N - 1 peers every alltoall reconnects what the
    last one closed (3x slower at np=16 with a bound of 3: benchmarks/README.md), so the default bound is
    what the descriptor limit can afford, not a small number: with the usual 1,024 that is 256."""
    if bound >= 0:
        return bound
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 256
    return 0 if soft == resource.RLIM_INFINITY else max(64, soft // 4)


class _Closing:
    __slots__ = ("sock", "token", "busy", "frame", "at")

    def __init__(self, sock: socket.socket, token: int, frame: bytes):
        self.sock, self.token, self.frame, self.at = sock, token, frame, time.monotonic()
        self.busy = False  # the peer's next collective's bytes came: it will refuse (not watched any more)


class LinkCache:
    """The lazily opened data links of ``comm`` (a :class:`hora.transport.tcp.TcpCommunicator`), at most
    ``bound`` of them idle-open (0: no bound). See the module's docstring for the protocol."""

    def __init__(self, comm, bound: int):
        self.comm, self.bound = comm, resolve(bound)
        self.planned = frozenset(comm._socks)
        self.lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # least recently used first
        self.sent: collections.Counter[int] = collections.Counter()
        self.received: collections.Counter[int] = collections.Counter()
        self.epoch: collections.Counter[int] = collections.Counter()  # closes of each peer's link (as the peer counts)
        self.closing: dict[int, _Closing] = {}
        self.closing_fd: dict[int, int] = {}  # fd -> peer, for the sockets being closed
        self.answers: dict[int, tuple[int, bytes]] = {}  # peer -> (token, answer) last given, for a resent proposal
        self.inbox: collections.deque[tuple[int, bytes]] = collections.deque()
        self.over = False  # more lazy links open than the bound
        self._token = 0
        self.proposed = self.agreed = self.refused = self.closed = 0  # counted for tests
        comm.ctrl.on_link = self._arrive

    # -- what the communicator tells it ------------------------------------------------------------
    def use(self, peer: int, nbytes: int, send: bool) -> None:
        """A request of ``nbytes`` for lazy ``peer`` was queued."""
        (self.sent if send else self.received)[peer] += nbytes
        if peer in self.lru:
            self.lru.move_to_end(peer)

    def opened(self, peer: int) -> None:
        """A lazy link to ``peer`` is in use now."""
        self.lru[peer] = None
        self.lru.move_to_end(peer)
        self.over = 0 < self.bound < len(self.lru)
        if self.over:
            self.trim(keep=peer)

    def trim(self, keep: int | None = None) -> None:
        """Propose closes of the least recently used idle links, as many as the bound is exceeded by (minus
        the closes already proposed); ``keep``: a link just opened for a request about to be queued."""
        comm = self.comm
        need = len(self.lru) - self.bound - len(self.closing)
        if need <= 0 or (comm.ctrl.on_message is None and not comm.ctrl.polled):
            return  # within the bound; or nobody reads the control plane (no engine): no answer would come
        for p in list(self.lru):
            if need <= 0:
                return
            if p != keep and p in comm._socks and not comm._sendq[p] and not comm._recvq[p]:
                self._propose(p)
                need -= 1

    # -- proposing -------------------------------------------------------------------------------------
    def _propose(self, peer: int) -> None:
        comm = self.comm
        sock = comm._socks.pop(peer)
        comm._fd_peer.pop(sock.fileno(), None)
        self._token += 1
        frame = PROPOSE + _PROP.pack(self._token, self.epoch[peer], self.sent[peer], self.received[peer])
        self.closing[peer] = _Closing(sock, self._token, frame)
        self.closing_fd[sock.fileno()] = peer
        if not plan.dials(comm.rank, peer):
            comm._links.port.forget(peer)  # it dials again only after it agreed (and closed)
        self.proposed += 1
        if not comm.ctrl.send_link(peer, frame):
            self._drop(peer)  # it left (shut down): its end is gone anyway

    def _drop(self, peer: int) -> None:
        """Close this rank's end of the link to ``peer`` (agreed, or the peer left)."""
        comm = self.comm
        socks = []
        sock = comm._socks.pop(peer, None)
        if sock is not None:
            comm._fd_peer.pop(sock.fileno(), None)
            socks.append(sock)
        c = self.closing.pop(peer, None)
        if c is not None:
            self.closing_fd.pop(c.sock.fileno(), None)
            socks.append(c.sock)
        self.lru.pop(peer, None)
        self.over = 0 < self.bound < len(self.lru)
        self.epoch[peer] += 1
        if not plan.dials(comm.rank, peer):
            comm._links.port.forget(peer)
        for s in socks:
            comm.ctrl.untrack(s)
            try:
                s.close()
            except OSError:
                pass
        self.closed += 1

    # -- frames from the peers ------------------------------------------------------------------------
    def _arrive(self, src: int, payload: bytes) -> None:
        """The control plane's ``on_link``: handled now by the driving thread, else queued for it."""
        self.inbox.append((src, payload))
        if self.comm.ctrl.on_message is not None:
            self.serve()
        else:
            self.comm._links.port.kick()

    def serve(self) -> None:
        """Handle the frames that came (on the communicator's driving thread)."""
        comm = self.comm
        while self.inbox:
            src, payload = self.inbox.popleft()
            if comm._closed or comm.ctrl.broken is not None:
                continue
            kind = payload[:1]
            if kind == PROPOSE:
                self._answer(src, *_PROP.unpack_from(payload, 1))
            elif kind in (AGREE, REFUSE):
                self._answered(src, _ANS.unpack_from(payload, 1)[0], kind == AGREE)

    def _answer(self, peer: int, token: int, epoch: int, sent: int, received: int) -> None:
        comm = self.comm
        last = self.answers.get(peer)
        if last is not None and last[0] == token:  # sent again (an answer lost on the way): the same answer
            comm.ctrl.send_link(peer, last[1])
            return
        have = peer in comm._socks or peer in self.closing
        if not have and not plan.dials(comm.rank, peer):  # the proposer's connection, not taken yet?
            sock = comm._links.port.take(peer)
            if sock is not None:
                comm._adopt(peer, sock)
                have = True
        idle = not comm._sendq[peer] and not comm._recvq[peer]
        if have and idle and epoch == self.epoch[peer] and self.received[peer] == sent and self.sent[peer] == received:
            self._drop(peer)
            self.agreed += 1
            answer = AGREE + _ANS.pack(token)
        else:  # busy with it, bytes in flight, or its connection still on the way here: it stays
            answer = REFUSE + _ANS.pack(token)
        self.answers[peer] = (token, answer)
        comm.ctrl.send_link(peer, answer)

    def _answered(self, peer: int, token: int, agreed: bool) -> None:
        c = self.closing.get(peer)
        if c is None or c.token != token:
            return  # stale: the link closed meanwhile (both proposed, and this rank agreed to the other's)
        comm = self.comm
        if agreed:
            self._drop(peer)
            if comm._sendq[peer] or comm._recvq[peer]:
                comm._link(peer)  # requests came meanwhile: connect again
            return
        self.refused += 1
        del self.closing[peer]
        self.closing_fd.pop(c.sock.fileno(), None)
        comm._socks[peer] = c.sock
        comm._fd_peer[c.sock.fileno()] = peer
        if comm._sendq[peer]:
            comm._pump_send(peer)
        if comm._recvq[peer]:
            comm._pump_recv(peer)
        if self.over:  # it was busy with this rank; another idle one may close instead
            self.trim(keep=peer)

    # -- a proposer's socket that ends, or an answer that does not come ----------------------------------
    def resend(self) -> None:
        """Send again the proposals that requests wait on and that went unanswered for ``RESEND_S``: a frame
        routed through a rank that shut down meanwhile is lost (the route is direct by now). The peer
        answers a proposal it answered before with the same answer, so a resent one changes nothing."""
        comm, now = self.comm, time.monotonic()
        for peer, c in self.closing.items():
            if now - c.at > RESEND_S and (comm._sendq[peer] or comm._recvq[peer]):
                c.at = now
                comm.ctrl.send_link(peer, c.frame)

    def watch(self, poller: select.poll) -> None:
        """Register the sockets being closed (during a data wait), but those whose peer is busy with them."""
        for fd, peer in self.closing_fd.items():
            if not self.closing[peer].busy:
                poller.register(fd, select.POLLIN)

    def seen(self, fd: int) -> None:
        """A socket being closed is readable: the peer's next collective's bytes (it will refuse: not watched
        again), or its end: the peer is done with the link (agreed, shut down or died), so close this end
        now and connect again if requests wait (a dead peer is named by that connection's failure)."""
        peer = self.closing_fd[fd]
        try:
            data = self.closing[peer].sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if data:
            self.closing[peer].busy = True
            return
        self._drop(peer)
        if self.comm._sendq[peer] or self.comm._recvq[peer]:
            self.comm._link(peer)

    def close(self) -> None:
        for c in self.closing.values():
            try:
                c.sock.close()
            except OSError:
                pass
        self.closing.clear()
        self.closing_fd.clear()
