"""Mutual authentication of every connection with the job secret.

Both sides prove they know the secret before any data moves: the acceptor sends a random nonce,
the connector answers with its own nonce, a small identity blob and an HMAC over both nonces and
the blob; the acceptor checks it and answers with an HMAC of its own over the same material (with a
different label, so a reflected answer is useless). A silent, garbled or wrong peer fails within
``HANDSHAKE_TIMEOUT`` seconds and is dropped by the acceptor with a log line.

Each side also states its ``wire_protection`` (one byte after its nonce, under the HMACs): two that
differ fail here, each naming both settings; two that agree on integrity or encrypt seal the connection
with keys derived from the secret and both nonces (:mod:`hora.transport.seal`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from hora.base.errors import AuthenticationError
from hora.transport import seal

NONCE = 32
MAC = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 5.0  # seconds a connecting peer may take to prove itself
_MAX_IDENT = 4096
_HEAD = NONCE + 1 + 4  # the connector's nonce, its wire protection, its identity's length
HELLO = 5 + NONCE + 1  # the acceptor's hello: magic, nonce, its wire protection


def new_secret() -> str:
    """A fresh job secret, hex encoded so it can travel in an environment variable."""
    return os.urandom(32).hex()


def _mac(secret: bytes, label: bytes, *parts: bytes) -> bytes:
    h = hmac.new(secret, label, hashlib.sha256)
    for p in parts:
        h.update(struct.pack("!I", len(p)))
        h.update(p)
    return h.digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed during handshake")
        got += k
    return bytes(buf)


class AcceptHandshake:
    """The acceptor's side of one handshake, fed by whatever the connection delivers, so that one
    thread can run many of them at once (:mod:`hora.transport.acceptor`): a silent or slow client
    then holds a slot, never the others' turn.

    ``out`` holds bytes to send (the hello at first, the answer once the connector proved itself);
    :meth:`received` takes bytes read from the connection and raises :class:`AuthenticationError`
    when they are wrong. ``ident`` is the connector's identity blob once it is proved; ``done`` when
    the answer has gone out too. ``mode``: this end's wire protection (:func:`seal.mode`).
    """

    __slots__ = ("_secret", "_nonce", "_got", "out", "ident", "mode", "_nonce_c")

    def __init__(self, secret: bytes, mode: str = "off"):
        self._secret = secret
        self._nonce = os.urandom(NONCE)
        self._got = bytearray()
        self.mode = mode
        self.out = bytearray(b"HORA1" + self._nonce + seal.CODE[mode])
        self.ident: bytes | None = None
        self._nonce_c = b""

    @property
    def done(self) -> bool:
        return self.ident is not None and not self.out

    def missing(self) -> int:
        """How many more bytes the connector must send before the next step (0 once proved)."""
        if self.ident is not None:
            return 0
        head = _HEAD
        if len(self._got) < head:
            return head - len(self._got)
        return head + self._ident_len() + MAC - len(self._got)

    def _ident_len(self) -> int:
        (n,) = struct.unpack("!I", self._got[_HEAD - 4:_HEAD])
        if n > _MAX_IDENT:
            raise AuthenticationError(f"identity of {n} bytes is too long")
        return n

    def received(self, data: bytes) -> None:
        """Take ``data`` from the connector; once its nonce, identity and HMAC are in, check them."""
        if len(data) > self.missing():  # it may not speak before our answer: nothing valid does
            raise AuthenticationError("the connector sent more than a handshake before it was answered")
        self._got += data
        if self.missing() or self.ident is not None:
            return
        nonce_c, code, n = bytes(self._got[:NONCE]), bytes(self._got[NONCE:NONCE + 1]), self._ident_len()
        ident = bytes(self._got[_HEAD:_HEAD + n])
        mac = bytes(self._got[_HEAD + n:])
        modes = seal.CODE[self.mode] + code
        if not hmac.compare_digest(mac, _mac(self._secret, b"connector", self._nonce, nonce_c, ident, modes)):
            raise AuthenticationError("wrong HMAC (peer does not know the job secret)")
        if code != seal.CODE[self.mode]:
            theirs = seal.NAME.get(code, repr(code))
            raise AuthenticationError(seal.mismatch(self.mode, theirs, "the connecting process"))
        self.ident, self._nonce_c = ident, nonce_c
        self.out += _mac(self._secret, b"acceptor", self._nonce, nonce_c, ident, modes)

    def wrap(self, sock: socket.socket, peer: str) -> socket.socket:
        """``sock`` (this handshake's, done) sealed as both ends agreed; ``peer`` names the connector."""
        return seal.wrap(sock, self._secret, self._nonce, self._nonce_c, self.mode, True, peer)


def connect_handshake(sock: socket.socket, secret: bytes, ident: bytes = b"",
                      timeout: float = HANDSHAKE_TIMEOUT, sealed: bool = True,
                      protection: str | None = None) -> socket.socket:
    """Client side: prove we know the secret, check that the acceptor does too and that both ask for
    the same wire protection (``protection``, else the knob), and return the connection to use: ``sock``
    itself, or ``sock`` sealed (:mod:`hora.transport.seal`) unless ``sealed`` is False (a connection
    written to by C code, the pulse's). It owns ``sock``: whatever fails (refused, wrong secret, the peer
    closed, no ``cryptography`` to seal with), ``sock`` is closed before the error propagates."""
    try:
        return _connect_handshake(sock, secret, ident, timeout, sealed, protection)
    except BaseException:
        sock.close()
        raise


def _connect_handshake(sock: socket.socket, secret: bytes, ident: bytes, timeout: float, sealed: bool,
                       protection: str | None) -> socket.socket:
    mode = seal.mode(protection)
    try:
        sock.settimeout(timeout)
        hello = recv_exact(sock, HELLO)
        if hello[:5] != b"HORA1" or hello[-1:] not in seal.NAME:
            raise AuthenticationError("the other end is not a hora endpoint (or not of this version)")
        nonce_s, theirs = hello[5:5 + NONCE], seal.NAME[hello[-1:]]
        nonce_c = os.urandom(NONCE)
        modes = hello[-1:] + seal.CODE[mode]
        sock.sendall(nonce_c + seal.CODE[mode] + struct.pack("!I", len(ident)) + ident
                     + _mac(secret, b"connector", nonce_s, nonce_c, ident, modes))
        if theirs != mode:  # sent first, so that the acceptor names both settings too
            raise AuthenticationError(seal.mismatch(mode, theirs, "the accepting process"))
        answer = recv_exact(sock, MAC)
        if not hmac.compare_digest(answer, _mac(secret, b"acceptor", nonce_s, nonce_c, ident, modes)):
            raise AuthenticationError("the acceptor does not know the job secret")
        sock.settimeout(None)
    except AuthenticationError:
        raise
    except (OSError, ConnectionError) as e:
        raise AuthenticationError(f"handshake failed: {e}") from e
    if not sealed:
        return sock
    try:
        peer = "{}:{}".format(*sock.getpeername()[:2])
    except OSError:
        peer = "the acceptor"
    return seal.wrap(sock, secret, nonce_s, nonce_c, mode, False, peer)
