"""What every transport offers: non-blocking point-to-point on byte buffers, the control plane, and
optional native collectives.

A ring step sends to the right while it receives from the left; with blocking calls both sides
could fill their socket buffers and deadlock, so ``isend``/``irecv_into`` return a request at once
and ``wait`` drives progress on every pending request of the communicator (MPI's progress-on-wait:
no extra thread, no hand-off latency for small messages).

:class:`Communicator` lists everything the engine calls; :class:`CommunicatorBase` defines all of it
for every transport (a native collective a transport lacks is None), so the layers above use plain
attribute access. Native collectives that run an algorithm on a transport's primitives (shared memory,
hierarchical) are assembled a layer up, in :mod:`hora.collectives.native`, and installed here with
:meth:`CommunicatorBase.use_natives`: the transport layer imports no algorithm.
"""

from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from hora.base.errors import HoraTimeoutError, HoraValueError
from hora.transport.control import ControlPlane

# The ring receives a segment in pieces of this many bytes (rounded down to whole elements), so that
# reducing one piece overlaps the arrival of the next; a transport that frames messages (MPI) cuts its
# sends the same way so that they match. First guess; tune with benchmarks/allreduce.py.
CHUNK_BYTES = 1 << 20

# the collectives a transport may offer natively, by the names the engine and the timeline use
OPS = ("allreduce", "allgather", "broadcast", "alltoall", "reducescatter")


class Request(Protocol):
    def wait(self, timeout: float | None = None) -> None: ...


class NativeOps:
    """A set of native collectives (ranks and roots are the group's); each is None where there is none.
    Contracts: ``native_allreduce(flat, op, src=None)`` reduces the 1-D ``flat`` in place (Average is Sum
    here: the engine scales), or ``src`` into ``flat`` without writing ``src``;
    ``native_allreduce_parts(srcs, outs, op, prescale=1.0, postscale=1.0)`` reduces the 1-D arrays
    ``srcs`` (one dtype) as one allreduce of their concatenation into ``outs`` (each ``srcs[i]`` itself,
    in place, or a fresh array of its size), scaling inputs by ``prescale`` and results by ``postscale``
    as :func:`hora.collectives.reduce.scale` does: a fused allreduce without a fusion buffer. The others
    have the contracts of ``ring.reduce_scatter`` and ``exchange``'s ``allgather_blocks``,
    ``broadcast`` and ``alltoall_blocks`` (with ``op`` instead of a reducer)."""

    native_allreduce: Callable | None = None
    native_allreduce_parts: Callable | None = None
    native_allgather: Callable | None = None
    native_broadcast: Callable | None = None
    native_alltoall: Callable | None = None
    native_reducescatter: Callable | None = None

    def close(self) -> None:
        """Release what these collectives hold (a process set's shared segment)."""


class Communicator(Protocol):
    """What the engine and the collectives call on a transport."""

    rank: int
    size: int
    name: str  # the timeline's name for this transport ("TCP", "SHM", ...)
    ctrl: ControlPlane
    native_allreduce: Callable | None
    native_allreduce_parts: Callable | None
    native_allgather: Callable | None
    native_broadcast: Callable | None
    native_alltoall: Callable | None
    native_reducescatter: Callable | None

    @property
    def broken(self) -> BaseException | None: ...

    @property
    def op_transports(self) -> dict[str, str]: ...  # op kind -> the timeline's name of what runs it

    def isend(self, peer: int, buf: np.ndarray) -> Request: ...

    def irecv_into(self, peer: int, buf: np.ndarray) -> Request: ...

    def native_group(self, ranks: tuple[int, ...]) -> NativeOps | None: ...

    def close(self) -> None: ...


class CommunicatorBase(NativeOps):
    """Defaults for everything :class:`Communicator` lists: no native collectives, no process-set
    groups, every op kind run by this transport."""

    rank: int
    size: int
    ctrl: ControlPlane
    name = "TCP"

    @property
    def broken(self) -> BaseException | None:
        return self.ctrl.broken

    @property
    def op_transports(self) -> dict[str, str]:
        return {k: self.name for k in OPS}

    def native_group(self, ranks: tuple[int, ...]) -> NativeOps | None:
        """Native collectives among ``ranks`` (a process set; collective over them), or None."""
        return None

    def use_natives(self, ops: NativeOps, group: Callable[[tuple[int, ...]], NativeOps | None] | None = None) -> None:
        """Install the native collectives that :mod:`hora.collectives.native` assembled from this
        transport's primitives (and ``group(ranks)``, which does the same for a process set)."""
        self.native_allreduce = ops.native_allreduce
        self.native_allreduce_parts = ops.native_allreduce_parts
        self.native_allgather = ops.native_allgather
        self.native_broadcast = ops.native_broadcast
        self.native_alltoall = ops.native_alltoall
        self.native_reducescatter = ops.native_reducescatter
        if group is not None:
            self.native_group = group

    def close(self) -> None:
        pass

    def _wait_for(self, req: "PendingRequest", timeout: float | None) -> None:
        """A transport's progress loop: return once ``req`` is done (raising a failure that ended it
        on the request), or raise :class:`HoraTimeoutError` after ``timeout`` s."""
        raise NotImplementedError


class PendingRequest:
    """Base of one transport's pending send or receive: ``wait`` lets the communicator progress until
    it is done, then raises the failure that ended it, if any."""

    __slots__ = ("comm", "peer", "done", "error")

    def __init__(self, comm, peer: int, done: bool):
        self.comm, self.peer, self.done = comm, peer, done
        self.error: BaseException | None = None

    def wait(self, timeout: float | None = None) -> None:
        if not self.done:
            self.comm._wait_for(self, timeout)
        if self.error is not None:
            raise self.error


def timed_out(rank: int, peer: int, timeout: float) -> HoraTimeoutError:
    """The error of a data wait that ran past its timeout."""
    return HoraTimeoutError(f"rank {rank}: no progress with rank {peer} in {timeout:g} s")


def byte_view(a: np.ndarray) -> memoryview:
    """A flat writable-if-possible byte view of a C-contiguous array (any dtype, bfloat16 too)."""
    if not a.flags.c_contiguous:
        raise HoraValueError("transport buffers must be C-contiguous")
    return memoryview(a.reshape(-1).view(np.uint8))


class LocalCommunicator(CommunicatorBase):
    """The world of one rank: collectives never reach the network, and the control plane has no peers."""

    name = "LOCAL"

    def __init__(self) -> None:
        self.rank, self.size = 0, 1
        self.ctrl = ControlPlane(0)

    def isend(self, peer: int, buf: np.ndarray) -> Request:
        raise HoraValueError(f"rank 0 of a world of size 1 has no peer {peer}")

    irecv_into = isend

    def close(self) -> None:
        self.ctrl.close()


class SubCommunicator(CommunicatorBase):
    """Point-to-point among some of ``comm``'s ranks, numbered 0.. in the order given: a process set's
    view of the job, or a hierarchical ring's view of the ranks with one local rank. ``native``, if
    given, are the group's own collectives (closed with this)."""

    def __init__(self, comm: Communicator, ranks, native: NativeOps | None = None):
        self.comm, self.ranks = comm, tuple(ranks)
        self.rank, self.size = self.ranks.index(comm.rank), len(self.ranks)
        self.ctrl, self.name = comm.ctrl, comm.name
        self.native = native
        if native is not None:
            self.use_natives(native)

    def global_rank(self, rank: int) -> int:
        return self.ranks[rank]

    def local_rank(self, global_rank: int) -> int:
        return self.ranks.index(global_rank)

    def isend(self, peer: int, buf: np.ndarray) -> Request:
        return self.comm.isend(self.ranks[peer], buf)

    def irecv_into(self, peer: int, buf: np.ndarray) -> Request:
        return self.comm.irecv_into(self.ranks[peer], buf)

    @property
    def broken(self) -> BaseException | None:
        return self.comm.broken

    def close(self) -> None:
        if self.native is not None:
            self.native.close()
