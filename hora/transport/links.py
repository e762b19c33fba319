"""A rank's port and its connections on demand: what the TCP mesh (:mod:`hora.transport.tcp`) opens at
start-up and what later, following the connection plan (:mod:`hora.transport.plan`).

:class:`MeshPort` is what the rank's port accepts, for the communicator's whole life (the
:class:`~hora.transport.acceptor.Acceptor` runs the handshakes): at start-up the planned connections (data
from the higher ring neighbour, control from the tree children), collected by :meth:`MeshPort.wait_all`;
later, data connections from any higher rank on its first collective with this one (kept until the
communicator takes them, :meth:`MeshPort.take`, with a wake-up byte on :attr:`MeshPort.fd`) and control
connections from any rank whose route through the tree is gone (handed to the control plane). A stale
generation, a duplicate, or an identity that is no rank of this job is dropped with a log line.

:class:`Links` opens this rank's side: the dial to a lower rank (the higher rank of a pair dials), with
every rank's address from the one start-up gather.
"""

from __future__ import annotations

import errno
import socket
import threading
import time
from typing import Callable

from hora.base.errors import HoraError, HoraTimeoutError
from hora.transport import auth, net, plan
from hora.transport.acceptor import Acceptor, Wake
from hora.transport.store import StoreTimeout

LATE_DIAL_S = 5.0  # a lazy dial's limit: the peer's port is open for its communicator's life, so a refusal is final


def publish(store, prefix: str, rank: int, address: str) -> None:
    """Start-up, first request: this rank's ``host:port`` for every peer to read."""
    store.set(f"{prefix}/addr/{rank}", address.encode())


def find(store, prefix: str, rank: int, size: int, timeout: float) -> list[str]:
    """Start-up, second request: every rank's address, in one gather, once all have published."""
    try:
        return [a.decode() for a in store.gather(f"{prefix}/addr/", size, timeout=timeout)]
    except StoreTimeout as e:
        raise HoraTimeoutError(f"rank {rank}: ranks [{e.missing}] did not connect within {timeout:g} s (their "
                               "addresses never reached the store); did they start? (raise --start-timeout "
                               "if they are slow)") from e


class MeshPort:
    """This rank's data port: the connections peers open to it (see the module's docstring)."""

    def __init__(self, listener: socket.socket, secret: bytes, rank: int, size: int, gen: str,
                 fanout: int = plan.FANOUT):
        self.rank, self.gen, self.size = rank, gen, size
        self.expected = {(p, "d") for p in plan.ring_neighbours(rank, size) if plan.dials(p, rank)}
        self.expected |= {(c, "c") for c in plan.children(rank, size, fanout)}
        self.socks: dict[tuple[int, str], socket.socket] = {}  # arrived, not yet taken
        self._seen: set[tuple[int, str]] = set()
        self.cond = threading.Condition()
        self.closed = False
        self._on_ctrl: Callable[[int, socket.socket], None] | None = None
        self._wake = Wake()
        self.acceptor = Acceptor(listener, secret, self._claim, f"hora rank {rank}: data port")

    @property
    def fd(self) -> int:
        """Readable when a data connection arrived after start-up (see :meth:`drain`)."""
        return self._wake.fileno()

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
            fresh = key not in self._seen and 0 <= key[0] < self.size and key[0] != self.rank
            if self.closed or not fresh or (chan == "d" and not plan.dials(key[0], self.rank)):
                raise HoraError(f"unexpected connection claiming rank {src} ({chan})")
            self._seen.add(key)
            if chan == "c" and self._on_ctrl is not None:
                on_ctrl = self._on_ctrl
            else:
                self.socks[key] = sock
                self.cond.notify_all()
                if chan == "d":
                    self._wake.kick()
                return
        net.tune(sock)
        on_ctrl(key[0], sock)

    def wait_all(self, timeout: float) -> dict[tuple[int, str], socket.socket]:
        """The start-up connections (``expected``), once all are here."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not self.expected.issubset(self.socks):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted({p for p, _ in self.expected - set(self.socks)})
                    raise HoraTimeoutError(f"rank {self.rank}: ranks {missing} did not connect within {timeout:g} s; "
                                           "did they start? (raise --start-timeout if they are slow)")
                self.cond.wait(left)
            return {k: self.socks.pop(k) for k in self.expected}

    def attach(self, on_ctrl: Callable[[int, socket.socket], None]) -> None:
        """From now on hand control connections to ``on_ctrl`` (the control plane's ``add_link``)."""
        with self.cond:
            self._on_ctrl = on_ctrl
            early = [(k, self.socks.pop(k)) for k in list(self.socks) if k[1] == "c"]
        for (p, _), sock in early:
            net.tune(sock)
            on_ctrl(p, sock)

    def take(self, peer: int) -> socket.socket | None:
        """The data connection ``peer`` opened to this rank, if it has (each is taken once)."""
        with self.cond:
            return self.socks.pop((peer, "d"), None)

    def drain(self) -> None:
        self._wake.drain()

    def kick(self) -> None:
        """Make :attr:`fd` readable (news for the communicator's own thread: a close frame, hora.transport.idle)."""
        self._wake.kick()

    def forget(self, peer: int) -> None:
        """``peer``'s data connection is closed by agreement: a new one from it is welcome again."""
        with self.cond:
            self._seen.discard((peer, "d"))

    def close(self) -> None:
        with self.cond:
            self.closed = True
            left, self.socks = list(self.socks.values()), {}
        self.acceptor.close()
        for s in left:
            s.close()
        self._wake.close()


class Links:
    """This rank's dials, after start-up too: ``addrs`` are every rank's, from the start-up gather."""

    def __init__(self, rank: int, prefix: str, secret: bytes, addrs: list[str], port: MeshPort,
                 dialer: Callable[..., socket.socket] | None = None):
        self.rank, self.prefix, self.secret, self.addrs, self.port = rank, prefix, secret, addrs, port
        self._connect = dialer or connect  # ``connect``'s signature (a test may reach a peer through a relay)

    def dial(self, peer: int, chan: str = "d", timeout: float | None = None) -> socket.socket:
        """A new connection to ``peer`` (a lower rank for data; any rank for control). ``timeout``: a
        start-up dial's limit; None: a later dial's (``LATE_DIAL_S``), which takes a refusal as final (the
        peer's port is open for its communicator's life: a refused rank has left, and a goodbye sent to
        every rank at shutdown must not wait seconds for each one that left first)."""
        sock = self._connect(self.addrs[peer], peer, self.rank, self.prefix, self.secret,
                             LATE_DIAL_S if timeout is None else timeout, chan, patient=timeout is not None)
        net.tune(sock, buffers=chan == "d")
        return sock

    def dial_ctrl(self, peer: int) -> socket.socket:
        return self.dial(peer, "c")


def connect(addr: str, peer: int, rank: int, prefix: str, secret: bytes, timeout: float,
            chan: str, patient: bool = True) -> socket.socket:
    """Dial ``peer`` at ``addr`` and prove this rank (``chan``: "d" data, "c" control); a refused
    connection is retried until ``timeout`` (the peer may still be opening its port) when ``patient``."""
    host, port = net.parse_addr(addr)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=5)
            return auth.connect_handshake(sock, secret, f"{rank}|{prefix}|{peer}|{chan}".encode())
        except (OSError, HoraError) as e:
            retry = patient and isinstance(e, OSError) and e.errno in (errno.ECONNREFUSED, errno.ETIMEDOUT)
            if not retry or time.monotonic() >= deadline:
                kind = HoraTimeoutError if retry else HoraError  # still refused at the deadline: not up in time
                raise kind(f"rank {rank}: cannot connect to rank {peer} at {addr}: {e}") from e
            time.sleep(0.05)
