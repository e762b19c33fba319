"""Optional integrity and encryption of hora's connections: the ``wire_protection`` knob (off,
integrity, encrypt; docs/security.md).

After the handshake (:mod:`hora.transport.auth`) both ends hold the job secret and two fresh nonces,
one from each; HKDF-SHA256 derives from them one AES-256-GCM key per direction of this connection, so
no key ever serves two connections or two directions and a counter is a safe nonce. Every frame is::

    len:u32 | head tag:16 | body (len bytes, at most CHUNK) | body tag:16

The 96-bit nonces are the frame's number in its direction (never sent): a frame that is changed,
replayed, reordered, dropped or taken from another connection fails a tag and the reader raises
:class:`TamperedError`, naming the peer, at once. The head has its own tag so that a changed length is
caught before the reader waits for bytes that will never come. ``integrity`` authenticates the body
(GMAC: AES-GCM with the body as associated data), so it goes out straight from the caller's buffer and
lands straight in the receiver's; ``encrypt`` encrypts it too, in frames of ``CHUNK`` bytes (a 64 MiB
tensor is 64 frames). Costs: benchmarks/README.md.

:class:`SealedSocket` stands in for the socket. ``send``/``recv_into`` keep a non-blocking socket's
contract (a frame counts once it is whole; until then ``BlockingIOError``, and the next call with the
same buffer resumes it), ``sendall`` and a blocking ``recv_into`` the blocking one; everything else
(``fileno``, ``setsockopt``, ``close``, a ``MSG_PEEK`` ``recv``) is the socket's own.
"""

from __future__ import annotations

import socket
import struct
import sys

from hora.base import knobs
from hora.base.errors import HoraError, HoraValueError

MODES = ("off", "integrity", "encrypt")
CODE = {"off": b"o", "integrity": b"i", "encrypt": b"e"}  # one byte of the handshake
NAME = {v: k for k, v in CODE.items()}
CHUNK = 1 << 20  # plaintext bytes per frame: big enough that the per-frame cost vanishes, small enough to stay in cache
TAG = 16
_LEN = struct.Struct("!I")
HEAD = _LEN.size + TAG
_NONCE = struct.Struct("!IQ")  # (0 for a body, 1 for a head, frame number)
EXTRA = "pip install 'hora[secure]' (or: pip install cryptography)"
TAMPERED = "failed its integrity check"  # in every TamperedError's message
CAUGHT = "frames between them were changed on the network: wire_protection caught it, nothing wrong was used"


class TamperedError(OSError):
    """A frame failed its authentication tag: it was changed, replayed, reordered or dropped on its way, or
    comes from another connection. An ``OSError``, so that each layer turns it into its own error for a
    lost connection (``PeerLostError`` naming the rank, the store's "lost the connection"), with this as
    the cause; the connection is unusable from then on."""


class MissingExtraError(HoraError):
    """``wire_protection`` is on and the ``cryptography`` package is not installed."""


def mode(given: str | None = None) -> str:
    """The protection this process asks for (``given``, else the ``wire_protection`` knob), after
    checking that the package it needs is there."""
    m = str(given or knobs.value("wire_protection")).lower()
    if m not in MODES:
        raise HoraValueError(f"wire_protection={m!r}: choose {', '.join(MODES)}")
    if m != "off":
        try:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401
        except ImportError as e:
            raise MissingExtraError(f"wire_protection={m!r} needs the 'cryptography' package, which this Python "
                                    f"({_where()}) cannot import ({e}); {EXTRA}, or set wire_protection=off") from e
    return m


def _where() -> str:
    return f"{sys.executable} on {socket.gethostname()}"


def mismatch(mine: str, theirs: str, other: str) -> str:
    """The message for two ends that disagree (``other``: who the other end is)."""
    return (f"wire protection mismatch: this process has wire_protection={mine!r}, {other} has {theirs!r}; "
            "set the same value for the launcher and every rank (hora run --wire-protection, "
            "HORA_WIRE_PROTECTION, or params.wire_protection in --config-file)")


def scope_note(transport: str, m: str) -> str | None:
    """What ``wire_protection`` leaves out with this data path (rank 0 logs it once), or None."""
    if m == "off":
        return None
    if transport == "shm":
        return (f"hora: wire_protection={m}: every rank is on this host, so tensors move through shared memory "
                "and never leave the machine; the knob has no effect on them (it still seals the control and "
                "store connections)")
    if transport == "mpi":
        return (f"hora: wire_protection={m} does not cover the MPI transport's data, which MPI moves itself "
                "(only hora's own control and store connections are sealed); use --transport tcp or "
                "hierarchical, or MPI's own encryption")
    return None


def wrap(sock: socket.socket, secret: bytes, nonce_a: bytes, nonce_c: bytes, m: str, acceptor: bool,
         peer: str) -> socket.socket:
    """``sock`` sealed as ``m`` asks (itself when off). ``nonce_a``/``nonce_c``: the acceptor's and the
    connector's handshake nonces; ``peer``: how errors name the other end."""
    if m == "off":
        return sock
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    keys = HKDF(hashes.SHA256(), 64, salt=nonce_a + nonce_c, info=b"hora wire v1 " + m.encode()).derive(secret)
    to_c, to_a = keys[:32], keys[32:]
    return SealedSocket(sock, to_c if acceptor else to_a, to_a if acceptor else to_c, m == "encrypt", peer)


class SealedSocket:
    """A connection whose frames are sealed (see the module docstring); ``peer`` names the other end."""

    def __init__(self, sock: socket.socket, send_key: bytes, recv_key: bytes, encrypt: bool, peer: str):
        from cryptography.exceptions import InvalidTag
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        self._sock, self._tx, self._rx = sock, AESGCM(send_key), AESGCM(recv_key)
        self._invalid = InvalidTag
        self._encrypt, self.peer = encrypt, peer
        self._tx_n = self._rx_n = 0
        self._out: list[memoryview] = []  # the frame being written
        self._out_plain = 0
        self._head_out = bytearray(HEAD)
        self._head = bytearray(HEAD)  # the frame being read: head, then body and tag
        self._hgot, self._blen, self._bgot, self._direct = 0, -1, 0, False
        self._body = bytearray(CHUNK + TAG)  # reused for every frame that is not read in place
        # encrypt: ciphertext out and plaintext in through reused buffers where cryptography has *_into (50 does;
        # older releases allocate each frame)
        self._into = encrypt and hasattr(self._tx, "encrypt_into")
        self._ct = bytearray(CHUNK + TAG) if self._into else None
        self._plain = bytearray(CHUNK) if self._into else None
        self._tag = bytearray(TAG)
        self._left = memoryview(b"")  # plaintext of the last frame that the caller has not taken yet

    def __getattr__(self, name: str):
        return getattr(self._sock, name)

    def __repr__(self) -> str:
        return f"<sealed {'encrypt' if self._encrypt else 'integrity'} {self._sock!r}>"

    # -- writing ---------------------------------------------------------------------------------
    def send(self, data, flags: int = 0) -> int:
        """Write one frame of ``data`` (at most ``CHUNK`` bytes) and return its plaintext size, or raise
        ``BlockingIOError`` before it is whole (call again with the same ``data``)."""
        if not self._out:
            view = memoryview(data).cast("B")[:CHUNK]
            if not len(view):
                return 0
            self._seal(view)
        while self._out:
            self._advance(self._sock.sendmsg(self._out))
        n, self._out_plain = self._out_plain, 0
        return n

    def sendall(self, data, flags: int = 0) -> None:
        view = memoryview(data).cast("B")
        off = 0
        while off < len(view):
            off += self.send(view[off:])

    def _nonce(self, head: int, n: int) -> bytes:
        return _NONCE.pack(head, n)

    def _seal(self, view: memoryview) -> None:
        n, i = len(view), self._tx_n
        self._tx_n += 1
        _LEN.pack_into(self._head_out, 0, n)
        self._head_out[_LEN.size:] = self._tx.encrypt(self._nonce(1, i), b"", bytes(self._head_out[:_LEN.size]))
        head = memoryview(self._head_out)
        if self._into:
            body = memoryview(self._ct)[:n + TAG]
            self._tx.encrypt_into(self._nonce(0, i), view, None, body)
            self._out = [head, body]
        elif self._encrypt:
            self._out = [head, memoryview(self._tx.encrypt(self._nonce(0, i), view, None))]
        else:
            self._out = [head, view, memoryview(self._tx.encrypt(self._nonce(0, i), b"", view))]
        self._out_plain = n

    def _advance(self, k: int) -> None:
        while k and self._out:
            first = self._out[0]
            if k >= len(first):
                k -= len(first)
                self._out.pop(0)
            else:
                self._out[0] = first[k:]
                k = 0

    # -- reading ---------------------------------------------------------------------------------
    def recv_into(self, buffer, nbytes: int = 0, flags: int = 0) -> int:
        """Read the next frame's plaintext into ``buffer`` (0: the peer closed between frames). A frame
        that fits lands in ``buffer`` in integrity mode, else in a reused buffer and is copied out; what
        does not fit waits for the next call."""
        view = memoryview(buffer).cast("B")
        if nbytes:
            view = view[:nbytes]
        if not len(view):
            return 0
        if len(self._left):
            return self._serve(view)
        head = memoryview(self._head)
        while self._hgot < HEAD:
            k = self._sock.recv_into(head[self._hgot:])
            if k == 0:
                if self._hgot == 0:
                    return 0
                raise ConnectionError(f"{self.peer} closed the connection in the middle of a frame")
            self._hgot += k
        if self._blen < 0:
            self._open_head(view)
        n, body = self._blen, memoryview(self._body)
        while self._bgot < n + TAG:
            if self._direct:
                into = view[self._bgot:n] if self._bgot < n else memoryview(self._tag)[self._bgot - n:]
            else:
                into = body[self._bgot:n + TAG]
            k = self._sock.recv_into(into)
            if k == 0:
                raise ConnectionError(f"{self.peer} closed the connection in the middle of a frame")
            self._bgot += k
        return self._open_body(view)

    def _open_head(self, view: memoryview) -> None:
        try:
            self._rx.decrypt(self._nonce(1, self._rx_n), bytes(self._head[_LEN.size:]), bytes(self._head[:_LEN.size]))
        except self._invalid:
            raise self._tampered("head") from None
        (n,) = _LEN.unpack_from(self._head)
        if n > CHUNK:  # a valid head never says so; guard anyway
            raise self._tampered("length")
        self._blen, self._bgot = n, 0
        self._direct = not self._encrypt and n <= len(view)

    def _open_body(self, view: memoryview) -> int:
        n, nonce = self._blen, self._nonce(0, self._rx_n)
        body = memoryview(self._body)
        try:
            if self._direct:
                self._rx.decrypt(nonce, bytes(self._tag), view[:n])
            elif self._into and n <= len(view):  # straight into the caller's buffer
                self._rx.decrypt_into(nonce, body[:n + TAG], None, view[:n])
                self._direct = True
            elif self._into:
                self._rx.decrypt_into(nonce, body[:n + TAG], None, memoryview(self._plain)[:n])
                self._left = memoryview(self._plain)[:n]
            elif self._encrypt:
                self._left = memoryview(self._rx.decrypt(nonce, body[:n + TAG], None))
            else:
                self._rx.decrypt(nonce, bytes(body[n:n + TAG]), body[:n])
                self._left = body[:n]
        except self._invalid:
            raise self._tampered("body") from None
        self._rx_n += 1
        self._hgot, self._blen, self._bgot = 0, -1, 0
        return n if self._direct else self._serve(view)

    def _serve(self, view: memoryview) -> int:
        k = min(len(view), len(self._left))
        view[:k] = self._left[:k]
        self._left = self._left[k:]
        return k

    def _tampered(self, part: str) -> TamperedError:
        return TamperedError(f"frame {self._rx_n} from {self.peer} {TAMPERED} ({part}): it was "
                             "changed, replayed, reordered or dropped on the network, so this connection cannot "
                             "be trusted any more (wire_protection="
                             f"{'encrypt' if self._encrypt else 'integrity'})")
