"""Ring reduce-scatter and allreduce over a non-blocking communicator.

The buffer is cut into ``size`` segments. Reduce-scatter takes ``size - 1`` steps: at step ``s``
rank ``r`` sends segment ``r-s-1`` to the right and receives segment ``r-s-2`` from the left,
reducing it into its own copy, so after the last step rank ``r`` owns the fully reduced segment
``r``. Allgather then passes the finished segments round the ring in ``size - 1`` more steps.
Each segment is reduced in one fixed order and then copied everywhere, so every rank ends up with
bitwise identical bytes. Received segments arrive in chunks so the reduction of one chunk overlaps
the arrival of the next (the kernel keeps receiving into the socket buffer meanwhile, and keeps
draining the step's send from its send buffer). Forwarding each chunk as soon as it is reduced,
instead of sending the segment at the next step's start, was measured against this (np 2 and 4, 1 to
64 MiB, interleaved in one job on 2 busy cores, load 3 to 6): no faster, up to 30% slower at 64 MiB (more requests and
wake-ups per byte), so the steps stay whole; on a link slower than the CPU the bubble it removes is
one chunk's reduction per step, a few percent.
"""

from __future__ import annotations

import numpy as np

from hora.collectives.reduce import Reducer
from hora.transport.base import CHUNK_BYTES  # receives are cut this way; MPI cuts its sends alike (a contract)


def even_bounds(count: int, parts: int) -> list[int]:
    """Boundaries splitting ``count`` items into ``parts``; the lowest parts get one extra."""
    base, extra = divmod(count, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + base + (1 if i < extra else 0))
    return bounds


class Scratch:
    """A reusable receive buffer, grown on demand (allocating per call costs page faults)."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def get(self, nbytes: int, dtype: np.dtype) -> np.ndarray:
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.nbytes), np.uint8)
        return self._buf[:nbytes].view(dtype)


def reduce_scatter(comm, buf: np.ndarray, bounds: list[int], reduce: Reducer, scratch: Scratch) -> None:
    """Reduce ``buf`` (1-D, every rank's own contribution) in place so that on return
    ``buf[bounds[r]:bounds[r+1]]`` on rank ``r`` holds the reduction over all ranks."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg = lambda i: buf[bounds[i % n]:bounds[i % n + 1]]  # noqa: E731
    tmp_all = scratch.get(max(bounds[i + 1] - bounds[i] for i in range(n)) * buf.itemsize, buf.dtype)
    chunk = max(1, CHUNK_BYTES // max(1, buf.itemsize))
    for s in range(n - 1):
        out, into = seg(r - s - 1), seg(r - s - 2)
        send = comm.isend(right, out)
        tmp = tmp_all[:into.size]
        pieces = [(a, min(a + chunk, into.size)) for a in range(0, into.size, chunk)]
        recvs = [comm.irecv_into(left, tmp[a:b]) for a, b in pieces]
        for (a, b), req in zip(pieces, recvs):
            req.wait()
            reduce(into[a:b], tmp[a:b])
        send.wait()


def ring_allgather_segments(comm, buf: np.ndarray, bounds: list[int]) -> None:
    """Each rank owns ``buf[bounds[r]:bounds[r+1]]``; afterwards every rank has every segment."""
    n, r = comm.size, comm.rank
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    seg = lambda i: buf[bounds[i % n]:bounds[i % n + 1]]  # noqa: E731
    for s in range(n - 1):
        send = comm.isend(right, seg(r - s))
        comm.irecv_into(left, seg(r - s - 1)).wait()
        send.wait()


def allreduce(comm, buf: np.ndarray, reduce: Reducer, finish=None, scratch: Scratch | None = None) -> None:
    """Ring allreduce of the 1-D contiguous ``buf`` in place. ``finish(segment)`` runs on each
    rank's own reduced segment before it is shared (postscaling happens there, once per element)."""
    bounds = even_bounds(buf.size, comm.size)
    reduce_scatter(comm, buf, bounds, reduce, scratch or Scratch())
    if finish is not None:
        finish(buf[bounds[comm.rank]:bounds[comm.rank + 1]])
    ring_allgather_segments(comm, buf, bounds)
