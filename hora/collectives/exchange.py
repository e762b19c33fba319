"""Collectives that move data without reducing it: allgather, broadcast, alltoall.

On a full mesh each rank posts all its sends and receives at once and lets the communicator
progress them together; for the small worlds of one host this beats a ring's ``size - 1``
dependent steps. Above ``RING_ABOVE`` ranks allgather and broadcast run on the ring instead, so they
use only the connections the plan opens at start-up (:mod:`hora.transport.plan`: a rank connects to
every other only for alltoall); broadcast is pipelined in chunks along the ring from the root. (A
pipelined tree would cut broadcast's ``size - 1`` hops of latency: future work.)
"""

from __future__ import annotations

import numpy as np

from hora.collectives.ring import ring_allgather_segments
from hora.transport.base import CHUNK_BYTES

RING_ABOVE = 16  # larger worlds allgather and broadcast on the ring (O(1) connections per rank)


def exchange(comm, sends: dict[int, np.ndarray], recvs: dict[int, np.ndarray]) -> None:
    """Post every send and receive, then wait for all of them."""
    reqs = [comm.irecv_into(p, b) for p, b in recvs.items() if b.size]
    reqs += [comm.isend(p, b) for p, b in sends.items() if b.size]
    for q in reqs:
        q.wait()


def allgather_blocks(comm, mine: np.ndarray, out: np.ndarray, bounds: list[int]) -> None:
    """``out[bounds[p]:bounds[p+1]]`` receives rank ``p``'s block (1-D views); ``mine`` is ours."""
    r = comm.rank
    out[bounds[r]:bounds[r + 1]] = mine
    if comm.size > RING_ABOVE:
        ring_allgather_segments(comm, out, bounds)
        return
    peers = [p for p in range(comm.size) if p != r]
    exchange(comm, {p: mine for p in peers}, {p: out[bounds[p]:bounds[p + 1]] for p in peers})


def broadcast(comm, buf: np.ndarray, root: int) -> None:
    """Copy root's ``buf`` into everyone's ``buf`` in place."""
    if comm.size > RING_ABOVE:
        _ring_broadcast(comm, buf, root)
    elif comm.rank == root:
        exchange(comm, {p: buf for p in range(comm.size) if p != root}, {})
    else:
        exchange(comm, {}, {root: buf})


def _ring_broadcast(comm, buf: np.ndarray, root: int) -> None:
    """Root's ``buf`` along the ring, chunk by chunk: each rank receives a chunk from its left and passes
    it on to its right (the rank before the root only receives)."""
    n, r = comm.size, comm.rank
    right, left = (r + 1) % n, (r - 1) % n
    flat = buf.reshape(-1).view(np.uint8)
    sends = []
    for a in range(0, max(1, flat.size), CHUNK_BYTES):
        piece = flat[a:a + CHUNK_BYTES]
        if r != root:
            comm.irecv_into(left, piece).wait()
        if right != root:
            sends.append(comm.isend(right, piece))
    for q in sends:
        q.wait()


def alltoall_blocks(comm, send: np.ndarray, send_bounds: list[int], out: np.ndarray,
                    recv_bounds: list[int]) -> None:
    """Rank ``p`` gets ``send[send_bounds[p]:send_bounds[p+1]]``; we receive into ``out``'s blocks."""
    r = comm.rank
    out[recv_bounds[r]:recv_bounds[r + 1]] = send[send_bounds[r]:send_bounds[r + 1]]
    peers = [p for p in range(comm.size) if p != r]
    exchange(comm, {p: send[send_bounds[p]:send_bounds[p + 1]] for p in peers},
             {p: out[recv_bounds[p]:recv_bounds[p + 1]] for p in peers})

