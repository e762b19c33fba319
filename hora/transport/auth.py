"""Mutual authentication of every connection with the job secret.

Both sides prove they know the secret before any data moves: the acceptor sends a random nonce,
the connector answers with its own nonce, a small identity blob and an HMAC over both nonces and
the blob; the acceptor checks it and answers with an HMAC of its own over the same material (with a
different label, so a reflected answer is useless). A silent, garbled or wrong peer fails within
``timeout`` seconds and is dropped by the caller with a log line.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from hora.base.errors import AuthenticationError

NONCE = 32
MAC = hashlib.sha256().digest_size
HANDSHAKE_TIMEOUT = 5.0  # seconds a connecting peer may take to prove itself
_MAX_IDENT = 4096


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


def accept_handshake(sock: socket.socket, secret: bytes, timeout: float = HANDSHAKE_TIMEOUT) -> bytes:
    """Server side: authenticate the connector and return the identity blob it sent."""
    try:
        sock.settimeout(timeout)
        nonce_s = os.urandom(NONCE)
        sock.sendall(b"HORA1" + nonce_s)
        head = recv_exact(sock, NONCE + 4)
        nonce_c, (n,) = head[:NONCE], struct.unpack("!I", head[NONCE:])
        if n > _MAX_IDENT:
            raise AuthenticationError(f"identity of {n} bytes is too long")
        ident = recv_exact(sock, n) if n else b""
        mac = recv_exact(sock, MAC)
        if not hmac.compare_digest(mac, _mac(secret, b"connector", nonce_s, nonce_c, ident)):
            raise AuthenticationError("wrong HMAC (peer does not know the job secret)")
        sock.sendall(_mac(secret, b"acceptor", nonce_s, nonce_c, ident))
        sock.settimeout(None)
        return ident
    except AuthenticationError:
        raise
    except (OSError, ConnectionError) as e:
        raise AuthenticationError(f"handshake failed: {e}") from e


def connect_handshake(sock: socket.socket, secret: bytes, ident: bytes = b"",
                      timeout: float = HANDSHAKE_TIMEOUT) -> None:
    """Client side: prove we know the secret and check that the acceptor does too."""
    try:
        sock.settimeout(timeout)
        hello = recv_exact(sock, 5 + NONCE)
        if hello[:5] != b"HORA1":
            raise AuthenticationError("the other end is not a hora endpoint")
        nonce_s = hello[5:]
        nonce_c = os.urandom(NONCE)
        sock.sendall(nonce_c + struct.pack("!I", len(ident)) + ident
                     + _mac(secret, b"connector", nonce_s, nonce_c, ident))
        answer = recv_exact(sock, MAC)
        if not hmac.compare_digest(answer, _mac(secret, b"acceptor", nonce_s, nonce_c, ident)):
            raise AuthenticationError("the acceptor does not know the job secret")
        sock.settimeout(None)
    except AuthenticationError:
        raise
    except (OSError, ConnectionError) as e:
        raise AuthenticationError(f"handshake failed: {e}") from e
