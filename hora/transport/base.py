"""What every transport offers the collectives: non-blocking point-to-point on byte buffers.

A ring step sends to the right while it receives from the left; with blocking calls both sides
could fill their socket buffers and deadlock, so ``isend``/``irecv_into`` return a request at once
and ``wait`` drives progress on every pending request of the communicator (MPI's progress-on-wait:
no extra thread, no hand-off latency for small messages).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Request(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...

    def test(self) -> bool: ...


class Communicator(Protocol):
    rank: int
    size: int

    def isend(self, peer: int, buf: np.ndarray) -> Request: ...

    def irecv_into(self, peer: int, buf: np.ndarray) -> Request: ...

    def close(self) -> None: ...


def byte_view(a: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array (any dtype, bfloat16 too)."""
    if not a.flags.c_contiguous:
        raise ValueError("transport buffers must be C-contiguous")
    return memoryview(a.reshape(-1).view(np.uint8))


class LocalCommunicator:
    """The world of one rank: collectives never reach the network."""

    def __init__(self) -> None:
        self.rank, self.size = 0, 1

    def isend(self, peer: int, buf: np.ndarray) -> Request:
        raise ValueError(f"rank 0 of a world of size 1 has no peer {peer}")

    irecv_into = isend

    def close(self) -> None:
        pass


class OverMesh:
    """Base of a transport that wraps the TCP mesh (``self._tcp``): whatever it does not define
    itself — the control plane, point-to-point, ``close`` ... — is the mesh's."""

    _tcp: object

    def __getattr__(self, name):  # isend, irecv_into, send_ctrl, recv_ctrl, ctrl_fds, _socks ...
        if name.startswith("__") or name == "_tcp":
            raise AttributeError(name)
        return getattr(self._tcp, name)

    @property
    def on_ctrl(self):
        return self._tcp.on_ctrl

    @on_ctrl.setter
    def on_ctrl(self, fn) -> None:
        self._tcp.on_ctrl = fn

    @property
    def broken(self):
        return self._tcp.broken
