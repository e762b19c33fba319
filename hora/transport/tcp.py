"""The TCP mesh: one authenticated, non-blocking socket between every pair of ranks.

Setup: each rank listens on an ephemeral port, publishes ``host:port`` in the rendezvous store,
connects to every lower rank and accepts every higher one. Each connection proves knowledge of the
job secret both ways (:mod:`hora.transport.auth`) and names the connecting rank and the job
generation, so a stale or foreign connection is dropped with a log line while setup goes on. The
listener stays open for the life of the communicator, refusing latecomers the same way.

Data: requests queue per peer and progress inside ``wait`` (poll on the sockets that have work),
so a ring step sends and receives at once. OS errors are translated here, once, into
:class:`PeerLostError` naming the rank.
"""

from __future__ import annotations

import collections
import errno
import logging
import select
import socket
import struct
import threading
import time
from typing import Callable

import numpy as np

from hora.base.errors import CommunicatorClosedError, HoraError, PeerLostError
from hora.transport import auth, net
from hora.transport.base import byte_view
from hora.transport.store import StoreClient

log = logging.getLogger("hora.transport")

_POLL_IN = select.POLLIN | select.POLLPRI
_LEN = struct.Struct("!I")
CTRL_GRACE = 3.0  # s a data wait goes on after a peer's control connection closed


class TcpRequest:
    """One pending send or receive. ``wait`` raises the peer's failure, if any."""

    __slots__ = ("comm", "peer", "view", "off", "done", "error")

    def __init__(self, comm: "TcpCommunicator", peer: int, view: memoryview):
        self.comm, self.peer, self.view, self.off = comm, peer, view, 0
        self.done = len(view) == 0
        self.error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self.comm._wait_for(self, timeout)
        if self.error is not None:
            raise self.error

    def test(self) -> bool:
        if not self.done:
            self.comm._progress(0)
        return self.done


class TcpCommunicator:
    """Point-to-point between ranks over established, authenticated sockets."""

    def __init__(self, rank: int, size: int, socks: dict[int, socket.socket],
                 explain: Callable[[int, str], tuple[int, str]] | None = None,
                 closer: Callable[[], None] | None = None,
                 ctrl: dict[int, socket.socket] | None = None):
        self.rank, self.size = rank, size
        self._socks = socks
        for s in socks.values():
            s.setblocking(False)
        self._fd_peer = {s.fileno(): p for p, s in socks.items()}
        # control plane: rank 0 <-> every other rank, separate from data so that a request sent
        # at any moment can never interleave with a collective's bytes
        self._ctrl = ctrl or {}
        self._ctrl_fd = {s.fileno(): p for p, s in self._ctrl.items()}
        self._ctrl_lock = threading.Lock()  # the engine and shutdown may both send
        self._ctrl_gone: dict[int, float] = {}  # peer -> deadline, control closed during a data wait
        self.on_ctrl: Callable[[int, bytes], None] | None = None
        self._sendq: dict[int, collections.deque[TcpRequest]] = {p: collections.deque() for p in socks}
        self._recvq: dict[int, collections.deque[TcpRequest]] = {p: collections.deque() for p in socks}
        self._explain = explain
        self._closer = closer
        self._broken: BaseException | None = None
        self._closed = False

    # -- public point-to-point -------------------------------------------------------------
    def isend(self, peer: int, buf: np.ndarray) -> TcpRequest:
        req = self._make(peer, buf)
        if req.done:  # zero bytes: nothing to move (and recv_into would read as EOF)
            return req
        q = self._sendq[peer]
        q.append(req)
        if len(q) == 1:
            self._pump_send(peer)
        return req

    def irecv_into(self, peer: int, buf: np.ndarray) -> TcpRequest:
        req = self._make(peer, buf)
        if req.done:
            return req
        q = self._recvq[peer]
        q.append(req)
        if len(q) == 1:
            self._pump_recv(peer)
        return req

    def waitall(self, reqs: list[TcpRequest], timeout: float | None = None) -> None:
        for r in reqs:
            r.wait(timeout)

    # -- control plane -----------------------------------------------------------------------
    @property
    def ctrl_peers(self) -> list[int]:
        return list(self._ctrl)

    def send_ctrl(self, peer: int, payload: bytes) -> None:
        """Send one framed control message (blocking; they are small)."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        try:
            with self._ctrl_lock:
                self._ctrl[peer].sendall(_LEN.pack(len(payload)) + payload)
        except KeyError:
            raise CommunicatorClosedError(f"rank {peer} has left; no control connection to it") from None
        except OSError as e:
            self._lost(peer, e)
            raise self._broken from e

    def expect_close(self, peer: int) -> None:
        """``peer`` said goodbye: stop watching its control connection (its EOF is not a failure)."""
        sock = self._ctrl.pop(peer, None)
        if sock is not None:
            self._ctrl_fd.pop(sock.fileno(), None)
            self._ctrl_gone.pop(peer, None)
            sock.close()

    def recv_ctrl(self, timeout: float | None, wake_fd: int | None = None) -> list[tuple[int, bytes]]:
        """Wait until a control message arrives (or ``wake_fd`` is readable, or the timeout runs
        out) and return every complete message that is ready, as ``(peer, payload)``."""
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed")
        if self._ctrl_gone:
            peer = next(iter(self._ctrl_gone))
            self._lost(peer, "control connection closed")
            raise self._broken
        poller = select.poll()
        for s in self._ctrl.values():
            poller.register(s.fileno(), _POLL_IN)
        if wake_fd is not None:
            poller.register(wake_fd, _POLL_IN)
        out = []
        ms = -1 if timeout is None else max(0, int(timeout * 1000))
        for fd, _ev in poller.poll(ms):
            if fd in self._ctrl_fd:
                msg = self._read_ctrl(self._ctrl_fd[fd])
                if msg is not None:
                    out.append((self._ctrl_fd[fd], msg))
        return out

    def ctrl_fds(self) -> list[int]:
        """The control connections' descriptors, for an engine that waits on them itself."""
        return [sock.fileno() for sock in self._ctrl.values()]

    def _read_ctrl(self, peer: int, during_data: bool = False) -> bytes | None:
        sock = self._ctrl[peer]
        try:
            head = auth.recv_exact(sock, _LEN.size)
            return auth.recv_exact(sock, _LEN.unpack(head)[0])
        except (OSError, ConnectionError) as e:
            if during_data:
                # A peer that finished its part and shut down closes control before we have read
                # its last data: give the data a grace period before calling the peer lost.
                self._ctrl_gone.setdefault(peer, time.monotonic() + CTRL_GRACE)
                return None
            self._lost(peer, "connection closed" if isinstance(e, ConnectionError) else e)
            raise self._broken from e

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for s in (*self._socks.values(), *self._ctrl.values()):
            try:
                s.close()
            except OSError:
                pass
        if self._closer is not None:
            self._closer()

    def abort(self, error: BaseException) -> None:
        """Fail every pending request with ``error`` and close: peers blocked on us see EOF."""
        self._fail_all(error)
        self.close()

    @property
    def broken(self) -> BaseException | None:
        return self._broken

    # -- machinery -------------------------------------------------------------------------
    def _make(self, peer: int, buf: np.ndarray) -> TcpRequest:
        if self._closed:
            raise CommunicatorClosedError("this communicator was closed (hora.shutdown()); call hora.init()")
        if self._broken is not None:
            raise self._broken
        if peer not in self._socks:
            raise ValueError(f"rank {self.rank} has no connection to rank {peer} (size {self.size})")
        return TcpRequest(self, peer, byte_view(buf))

    def _lost(self, peer: int, cause: BaseException | str) -> None:
        what = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        if self._explain is not None:
            dead, msg = self._explain(peer, what)
        else:
            dead, msg = peer, f"lost the connection to rank {peer} ({what}); that rank died or aborted"
        err = PeerLostError(f"rank {self.rank}: {msg}", rank=dead)
        if not isinstance(cause, str):
            err.__cause__ = cause
        self._fail_all(err)

    def _fail_all(self, err: BaseException) -> None:
        if self._broken is None:
            self._broken = err
        for q in (*self._sendq.values(), *self._recvq.values()):
            while q:
                r = q.popleft()
                r.error, r.done = self._broken, True

    def _pump_send(self, peer: int) -> None:
        q, sock = self._sendq[peer], self._socks[peer]
        while q:
            req = q[0]
            try:
                n = sock.send(req.view[req.off:])
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(peer, e)
                return
            req.off += n
            if req.off == len(req.view):
                req.done = True
                q.popleft()

    def _pump_recv(self, peer: int) -> None:
        q, sock = self._recvq[peer], self._socks[peer]
        while q:
            req = q[0]
            try:
                n = sock.recv_into(req.view[req.off:])
            except BlockingIOError:
                return
            except OSError as e:
                self._lost(peer, e)
                return
            if n == 0:
                self._lost(peer, "connection closed")
                return
            req.off += n
            if req.off == len(req.view):
                req.done = True
                q.popleft()

    def _progress(self, timeout_ms: int) -> None:
        poller = select.poll()
        any_fd = False
        for p, s in self._socks.items():
            mask = (select.POLLOUT if self._sendq[p] else 0) | (_POLL_IN if self._recvq[p] else 0)
            if mask:
                poller.register(s.fileno(), mask)
                any_fd = True
        if not any_fd:
            return
        if self.on_ctrl is not None:  # control messages interrupt a data wait (abort, stall report)
            for p, s in self._ctrl.items():
                if p not in self._ctrl_gone:
                    poller.register(s.fileno(), _POLL_IN)
        events = poller.poll(timeout_ms)
        for fd, ev in events:  # data first: a peer's last bytes count before its goodbye
            if fd in self._ctrl_fd:
                continue
            p = self._fd_peer[fd]
            if ev & (select.POLLOUT | select.POLLERR | select.POLLHUP) and self._sendq[p]:
                self._pump_send(p)
            if ev & (_POLL_IN | select.POLLERR | select.POLLHUP) and self._recvq[p]:
                self._pump_recv(p)
            if ev & select.POLLNVAL:
                self._lost(p, "socket closed")
        for fd, _ev in events:
            if fd in self._ctrl_fd and self._broken is None:
                peer = self._ctrl_fd[fd]
                msg = self._read_ctrl(peer, during_data=True)
                if msg is not None and self.on_ctrl is not None:
                    self.on_ctrl(peer, msg)
        for peer, deadline in self._ctrl_gone.items():
            if time.monotonic() > deadline and self._broken is None:
                self._lost(peer, f"control connection closed {CTRL_GRACE:g} s ago")

    def _wait_for(self, req: TcpRequest, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not req.done:
            if self._closed:
                raise CommunicatorClosedError("this communicator was closed while a request was pending")
            if deadline is None:
                ms = 1000
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"rank {self.rank}: no progress with rank {req.peer} in {timeout:g} s")
                ms = max(1, min(1000, int(left * 1000)))
            self._progress(ms)


class _Acceptor:
    """Accepts connections on the data port for the communicator's whole life.

    During setup it hands authenticated sockets from the expected higher ranks to ``setup``;
    anything else (wrong secret, garbage, silence, a stale generation, a duplicate) is dropped
    with a log line.
    """

    def __init__(self, listener: socket.socket, secret: bytes, rank: int, size: int, gen: str):
        self.listener, self.secret, self.rank, self.size, self.gen = listener, secret, rank, size, gen
        self.expected = {(p, "d") for p in range(rank + 1, size)}
        if rank == 0:
            self.expected |= {(p, "c") for p in range(1, size)}
        self.socks: dict[tuple[int, str], socket.socket] = {}
        self.cond = threading.Condition()
        self.closed = False
        self.workers: list[threading.Thread] = []
        self.thread = threading.Thread(target=self._loop, name="hora-accept", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            try:
                sock, peer = self.listener.accept()
            except OSError:
                return
            with self.cond:
                if self.closed:
                    sock.close()
                    return
                self.workers = [t for t in self.workers if t.is_alive()]
                t = threading.Thread(target=self._handshake, args=(sock, peer), daemon=True,
                                     name="hora-handshake")
                self.workers.append(t)
            t.start()

    def _handshake(self, sock: socket.socket, peer) -> None:
        try:
            ident = auth.accept_handshake(sock, self.secret).decode("ascii", "replace")
            parts = ident.split("|")
            if len(parts) != 4 or not parts[0].isdigit() or not parts[2].isdigit() or parts[3] not in "dc":
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
        except Exception as e:  # noqa: BLE001 - any failure means: drop this connection
            log.warning("hora rank %d: dropped connection on data port from %s:%s: %s",
                        self.rank, peer[0], peer[1], e)
            sock.close()

    def wait_all(self, timeout: float) -> dict[tuple[int, str], socket.socket]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while set(self.socks) != self.expected:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({p for p, _ in self.expected - set(self.socks)})
                    raise HoraError(f"rank {self.rank}: ranks {missing} did not connect within {timeout:g} s; "
                                    "did they start? (raise --start-timeout if they are slow)")
                self.cond.wait(left)
            return dict(self.socks)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            leftover = [s for p, s in self.socks.items()]
        try:
            self.listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.listener.close()
        self.thread.join(5)
        for t in self.workers:
            t.join(auth.HANDSHAKE_TIMEOUT + 1)
        del leftover


def connect_mesh(rank: int, size: int, store: StoreClient, prefix: str, secret: bytes,
                 bind_host: str = "127.0.0.1", advertise_host: str | None = None,
                 timeout: float = 30.0) -> TcpCommunicator:
    """Build the full mesh for ``rank`` of ``size`` and return its communicator.

    ``prefix`` names this job generation in the store (e.g. ``"job1/3"``); every rank must use the same.
    """
    listener = socket.create_server((bind_host, 0), backlog=max(16, size))
    port = listener.getsockname()[1]
    acceptor = _Acceptor(listener, secret, rank, size, prefix)
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
        """Who is to blame for losing ``peer``: the rank named by the first rank that saw a failure
        (its note in the store), else ``peer`` itself, and then this rank leaves that note."""
        try:
            note = store.try_get(key)
            if note:
                dead, _, msg = note.decode().partition("|")
                return int(dead), msg
            msg = f"lost the connection to rank {peer} ({what}); that rank died or aborted"
            store.set(key, f"{peer}|{msg} (first noticed by rank {rank})".encode())
            return peer, msg
        except HoraError:
            return peer, f"lost the connection to rank {peer} ({what}); that rank died or aborted"

    return TcpCommunicator(rank, size, socks, explain=explain, closer=acceptor.close, ctrl=ctrl)


def _connect(addr: str, peer: int, rank: int, prefix: str, secret: bytes, timeout: float,
             chan: str) -> socket.socket:
    host, port = net.parse_addr(addr)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            auth.connect_handshake(sock, secret, f"{rank}|{prefix}|{peer}|{chan}".encode())
            return sock
        except (OSError, HoraError) as e:
            retry = isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT)
            if not retry or time.monotonic() >= deadline:
                raise HoraError(f"rank {rank}: cannot connect to rank {peer} at {addr}: {e}") from e
            time.sleep(0.05)
