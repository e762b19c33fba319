"""Socket settings shared by the store and the data mesh.

Keepalive and ``TCP_USER_TIMEOUT`` make a peer whose host vanished without a FIN or RST (a cut
link) show up as an error in seconds instead of the kernel's default of hours.
"""

from __future__ import annotations

import socket

from hora.base.errors import HoraValueError

KEEPALIVE_IDLE = 2  # s of silence before the first probe
KEEPALIVE_INTERVAL = 1  # s between probes
KEEPALIVE_COUNT = 5  # unanswered probes before the connection is declared dead
USER_TIMEOUT_MS = 8_000  # unacknowledged data (or unanswered keepalives) older than this kills the connection
BUFFER_BYTES = 4 << 20  # socket buffers: room for a few chunks in flight; see benchmarks (noisy on 2 cores)


def tune(sock: socket.socket, buffers: bool = False) -> None:
    """Low latency (no Nagle), dead-peer detection, and optionally large buffers."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        opt = getattr(socket, name, None)
        if opt is not None:
            sock.setsockopt(socket.IPPROTO_TCP, opt, value)
    if buffers:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)


def parse_addr(addr: str) -> tuple[str, int]:
    """'host:port' (or '[v6]:port') -> (host, port), with a clear error for anything else."""
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit():
        raise HoraValueError(f"bad address {addr!r}: expected host:port")
    return host.strip("[]"), int(port)
