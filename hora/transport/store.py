"""The rendezvous store: a small authenticated key-value server and its client.

The launcher (``hora run``, ``hora.run()``, the test harness) serves it; workers use it to publish
their data-port addresses, find each other, and leave a note saying why a job aborted. Every
connection is authenticated with the job secret (:mod:`hora.transport.auth`); one that fails is
dropped with a log line and the store keeps serving the others.

Wire format, both directions: ``op:u8 | len:u32 | key | len:u32 | value`` (requests) and
``status:u8 | len:u32 | payload`` (replies). ``GET`` waits (server side) until the key exists or
its timeout, carried in the value as a float64, runs out.

Start-up costs every rank a constant number of round trips whatever the job's size: ``GATHER`` waits
until the ``n`` keys ``<prefix>0`` ... ``<prefix>{n-1}`` all exist and returns their values in one reply
(a rank publishes its address with one ``SET`` and reads every peer's with one ``GATHER``). The server
answers it without a thundering herd: each distinct gather has one waiting list, woken once, when its
last key arrives, and its reply is built once and served to every rank that asks (gloo's start-up at
4k ranks went from minutes to seconds when its per-key reads were batched like this, pytorch/gloo#408).
"""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time

from hora.base.errors import HoraError, HoraTimeoutError, HoraValueError
from hora.transport import auth, net, seal
from hora.transport.acceptor import Acceptor

log = logging.getLogger("hora.store")

SET, GET, ADD, DELETE, CHECK, GATHER = range(1, 7)
OK, MISSING, TIMEOUT, BAD = range(4)
_U32 = struct.Struct("!I")
_GATHER = struct.Struct("!dI")  # timeout, number of keys
_MAX_VALUE = 64 << 20
_SHOW_MISSING = 16  # missing keys named in a gather's timeout


class StoreTimeout(HoraTimeoutError):
    """A key did not appear in the store within the timeout (a start-up timeout: a hora error, also a
    ``TimeoutError``). ``missing``: for a gather, the indices that did not ("3,7" or "" if unknown)."""

    def __init__(self, message: str, missing: str = ""):
        super().__init__(message)
        self.missing = missing


def split_values(payload: bytes, n: int) -> list[bytes]:
    """A GATHER reply (``len:u32 | value`` n times) as its values."""
    out, off = [], 0
    for _ in range(n):
        (k,) = _U32.unpack_from(payload, off)
        out.append(payload[off + 4:off + 4 + k])
        off += 4 + k
    return out


def _send_frame(sock: socket.socket, tag: int, key: bytes, value: bytes) -> None:
    sock.sendall(bytes([tag]) + _U32.pack(len(key)) + key + _U32.pack(len(value)) + value)


def _recv_frame(sock: socket.socket) -> tuple[int, bytes, bytes]:
    tag = auth.recv_exact(sock, 1)[0]
    (n,) = _U32.unpack(auth.recv_exact(sock, 4))
    if n > _MAX_VALUE:
        raise HoraValueError(f"frame of {n} bytes is too long")
    key = auth.recv_exact(sock, n) if n else b""
    (m,) = _U32.unpack(auth.recv_exact(sock, 4))
    if m > _MAX_VALUE:
        raise HoraValueError(f"frame of {m} bytes is too long")
    return tag, key, auth.recv_exact(sock, m) if m else b""


class StoreServer:
    """Serve the store on ``host:port`` (port 0 picks a free one) until :meth:`close`.

    >>> with StoreServer(secret) as server:
    ...     addr = server.address   # "127.0.0.1:41234", for HORA_STORE_ADDR
    """

    def __init__(self, secret: str | bytes, host: str = "127.0.0.1", port: int = 0, protection: str | None = None):
        self._secret = secret.encode() if isinstance(secret, str) else secret
        self._data: dict[bytes, bytes] = {}
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        # prefix -> n -> a gather's waiting list and reply; a key "<prefix><i>" finds its gathers by its
        # prefix (the key without its trailing digits), so a SET costs O(1) however many gathers there are
        self._gathers: dict[bytes, dict[int, _Gather]] = {}
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        listener = socket.create_server((host, port), backlog=socket.SOMAXCONN)
        try:  # protection: the wire protection its clients must ask for (None: the knob; hora.transport.seal)
            self._acceptor = Acceptor(listener, self._secret, self._serve_new, "hora store", protection=protection)
        except BaseException:
            listener.close()
            raise

    @property
    def address(self) -> str:
        host, port = self._acceptor.address[:2]
        return f"{host}:{port}"

    def __enter__(self) -> "StoreServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            for by_n in self._gathers.values():
                for g in by_n.values():
                    g.cond.notify_all()
            conns = list(self._conns)
        self._acceptor.close()  # unfinished handshakes are dropped, not waited for
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(5)

    # direct access for the process that owns the server (launcher, tests)
    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._store(key.encode(), value)

    def get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key.encode())

    def _serve_new(self, sock: socket.socket, ident: bytes, peer) -> None:
        """An authenticated client (the acceptor's ``on_ready``): serve it on a thread of its own,
        since a GET may wait long for its key."""
        net.tune(sock)
        with self._cond:
            if self._closed:
                sock.close()
                return
            self._threads = [t for t in self._threads if t.is_alive()]
            t = threading.Thread(target=self._serve, args=(sock,), name="hora-store-conn", daemon=True)
            self._threads.append(t)
            self._conns.add(sock)
        t.start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            while True:
                try:
                    op, key, value = _recv_frame(sock)
                except (OSError, ConnectionError, ValueError) as e:
                    if isinstance(e, seal.TamperedError):
                        log.warning("hora store: %s; closed that connection", e)
                    return
                status, payload = self._handle(op, key, value)
                sock.sendall(bytes([status]) + _U32.pack(len(payload)) + payload)
        except OSError:
            pass
        finally:
            with self._cond:
                self._conns.discard(sock)
            sock.close()

    def _handle(self, op: int, key: bytes, value: bytes) -> tuple[int, bytes]:
        with self._cond:
            if op == SET:
                self._store(key, value)
                return OK, b""
            if op == GATHER:
                return self._gather(key, *_GATHER.unpack(value))
            if op == GET:
                (timeout,) = struct.unpack("!d", value)
                deadline = time.monotonic() + timeout
                while key not in self._data and not self._closed:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return TIMEOUT, b""
                    self._cond.wait(left)
                return (OK, self._data[key]) if key in self._data else (MISSING, b"")
            if op == ADD:
                (delta,) = struct.unpack("!q", value)
                n = int(self._data.get(key, b"0")) + delta
                self._store(key, str(n).encode())
                return OK, struct.pack("!q", n)
            if op == DELETE:
                for g in self._gathers.get(key.rstrip(b"0123456789"), {}).values():
                    g.next, g.reply = 0, None  # built again from what is left
                return (OK if self._data.pop(key, None) is not None else MISSING), b""
            if op == CHECK:
                return (OK if key in self._data else MISSING), b""
        return BAD, b"unknown op"

    def _store(self, key: bytes, value: bytes) -> None:
        """Set ``key`` (the lock held) and wake whoever waits for it: GET's waiters, and the one waiting
        list of a gather that this key completes."""
        self._data[key] = value
        self._cond.notify_all()
        for g in self._gathers.get(key.rstrip(b"0123456789"), {}).values():
            if g.reply is None and g.advance(self._data):
                g.cond.notify_all()

    def _gather(self, prefix: bytes, timeout: float, n: int) -> tuple[int, bytes]:
        """GATHER (the lock held): every value under ``prefix`` 0..n-1, once all exist, in one reply."""
        if prefix[-1:].isdigit():
            return BAD, b"a gather's prefix must not end with a digit (its keys are the prefix and an index)"
        by_n = self._gathers.setdefault(prefix, {})
        g = by_n.get(n)
        if g is None:
            g = by_n[n] = _Gather(prefix, n, threading.Condition(self._lock))
        deadline = time.monotonic() + timeout
        while not g.advance(self._data) and not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [i for i in range(g.next, n) if prefix + str(i).encode() not in self._data]
                more = f" and {len(missing) - _SHOW_MISSING} more" if len(missing) > _SHOW_MISSING else ""
                return TIMEOUT, (",".join(map(str, missing[:_SHOW_MISSING])) + more).encode()
            g.cond.wait(left)
        return (OK, g.reply) if g.reply is not None else (MISSING, b"")


class _Gather:
    """One gather's state on the server: the first index not seen yet (keys arrive in any order; each is
    looked at about once) and, once complete, the reply every asker gets."""

    __slots__ = ("prefix", "n", "cond", "next", "reply")

    def __init__(self, prefix: bytes, n: int, cond: threading.Condition):
        self.prefix, self.n, self.cond, self.next, self.reply = prefix, n, cond, 0, None

    def advance(self, data: dict[bytes, bytes]) -> bool:
        """True once every key is there (the reply then built)."""
        if self.reply is not None:
            return True
        while self.next < self.n and self.prefix + str(self.next).encode() in data:
            self.next += 1
        if self.next < self.n:
            return False
        parts = []
        for i in range(self.n):
            v = data[self.prefix + str(i).encode()]
            parts += (_U32.pack(len(v)), v)
        self.reply = b"".join(parts)
        return True


class StoreClient:
    """Thread-safe client of a :class:`StoreServer`.

    >>> store = StoreClient("127.0.0.1:41234", secret)
    >>> store.set("job/addr/0", b"127.0.0.1:5000"); store.get("job/addr/1", timeout=30)
    """

    def __init__(self, addr: str, secret: str | bytes, timeout: float = 30.0, protection: str | None = None):
        self.addr = addr
        secret_b = secret.encode() if isinstance(secret, str) else secret
        host, port = net.parse_addr(addr)
        deadline = time.monotonic() + timeout
        while True:  # the launcher may still be starting the store
            try:
                self._sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() >= deadline:  # a start-up timeout, like StoreTimeout
                    raise HoraTimeoutError(f"cannot reach the hora store at {addr} within {timeout:g} s: {e}; "
                                           "is the launcher running and HORA_STORE_ADDR right?") from e
                time.sleep(0.05)
        try:  # a refused handshake (wrong secret, another protection, the peer closed) leaves no socket open
            net.tune(self._sock)
            self._sock = auth.connect_handshake(self._sock, secret_b, protection=protection)
        except BaseException:
            self._sock.close()
            raise
        self._lock = threading.Lock()
        self.round_trips = 0  # requests made (start-up's cost, counted by tests and the scale simulation)

    def close(self) -> None:
        """Close the connection; a call another thread is blocked in (a long ``get``) fails at once."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # (a close alone would leave that thread blocked in recv)
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass

    def _call(self, op: int, key: str, value: bytes, timeout: float | None = None) -> tuple[int, bytes]:
        with self._lock:
            self.round_trips += 1
            try:
                self._sock.settimeout(None if timeout is None else timeout + 10)
                _send_frame(self._sock, op, key.encode(), value)
                status = auth.recv_exact(self._sock, 1)[0]
                (n,) = _U32.unpack(auth.recv_exact(self._sock, 4))
                return status, auth.recv_exact(self._sock, n) if n else b""
            except (OSError, ConnectionError) as e:
                raise HoraError(f"lost the connection to the hora store at {self.addr}: {e}") from e

    def set(self, key: str, value: bytes) -> None:
        self._call(SET, key, value, 10)

    def get(self, key: str, timeout: float = 30.0) -> bytes:
        status, payload = self._call(GET, key, struct.pack("!d", timeout), timeout)
        if status != OK:
            raise StoreTimeout(f"store key {key!r} did not appear within {timeout:g} s")
        return payload

    def try_get(self, key: str) -> bytes | None:
        status, payload = self._call(GET, key, struct.pack("!d", 0.0), 0.0)
        return payload if status == OK else None

    def gather(self, prefix: str, n: int, timeout: float = 30.0) -> list[bytes]:
        """The values of ``<prefix>0`` ... ``<prefix>{n-1}``, in one round trip, once all exist; a
        :class:`StoreTimeout` naming the missing indices if they do not within ``timeout``."""
        status, payload = self._call(GATHER, prefix, _GATHER.pack(timeout, n), timeout)
        if status == BAD:
            raise HoraValueError(f"store gather {prefix!r}: {payload.decode(errors='replace')}")
        if status != OK:
            raise StoreTimeout(f"store keys {prefix!r}0..{n - 1}: [{payload.decode(errors='replace')}] did not "
                               f"appear within {timeout:g} s", missing=payload.decode(errors="replace"))
        return split_values(payload, n)

    def add(self, key: str, delta: int = 1) -> int:
        return struct.unpack("!q", self._call(ADD, key, struct.pack("!q", delta), 10)[1])[0]

    def delete(self, key: str) -> bool:
        return self._call(DELETE, key, b"", 10)[0] == OK

    def check(self, key: str) -> bool:
        return self._call(CHECK, key, b"", 10)[0] == OK


def agree(store: StoreClient, key: str, voters: dict[str, str], me: str | None, vote: str,
          timeout: float) -> str:
    """One verdict for a collective setup (a shared segment mapped by every rank of a host, every host's
    segment), the same on every caller: each voter named in ``voters`` (name -> how reasons call it)
    publishes ``vote`` ("" when its part worked, else why not) under ``key/<name>``, and every caller
    (``me`` is None for one that does not vote) reads every vote. Returns the failures, ``"label: why"``
    joined by "; ", or "" when every part worked: then all go ahead, else all fall back together
    (a rank that went ahead alone would wait forever for the others).

    Two round trips per voter, one per other caller, whatever the number of voters: the votes are
    stored under ``key/<i>`` (``i`` the voter's place in ``voters``) and read with one gather."""
    names = list(voters)
    if me is not None:
        store.set(f"{key}/{names.index(me)}", vote.encode() or b"ok")
    got = store.gather(f"{key}/", len(names), timeout=timeout) if names else []
    return "; ".join(f"{voters[name]}: {v.decode(errors='replace')}" for name, v in zip(names, got) if v != b"ok")
