"""Collectives that move data without reducing it: allgather, broadcast, alltoall.

On a full mesh each rank posts all its sends and receives at once and lets the communicator
progress them together; for the small worlds of one host this beats a ring's ``size - 1``
dependent steps. (A pipelined tree for large worlds is future work: the root's outbound bytes
grow with ``size``.)
"""

from __future__ import annotations

import numpy as np


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
    peers = [p for p in range(comm.size) if p != r]
    exchange(comm, {p: mine for p in peers}, {p: out[bounds[p]:bounds[p + 1]] for p in peers})


def broadcast(comm, buf: np.ndarray, root: int) -> None:
    """Copy root's ``buf`` into everyone's ``buf`` in place."""
    if comm.rank == root:
        exchange(comm, {p: buf for p in range(comm.size) if p != root}, {})
    else:
        exchange(comm, {}, {root: buf})


def alltoall_blocks(comm, send: np.ndarray, send_bounds: list[int], out: np.ndarray,
                    recv_bounds: list[int]) -> None:
    """Rank ``p`` gets ``send[send_bounds[p]:send_bounds[p+1]]``; we receive into ``out``'s blocks."""
    r = comm.rank
    out[recv_bounds[r]:recv_bounds[r + 1]] = send[send_bounds[r]:send_bounds[r + 1]]
    peers = [p for p in range(comm.size) if p != r]
    exchange(comm, {p: send[send_bounds[p]:send_bounds[p + 1]] for p in peers},
             {p: out[recv_bounds[p]:recv_bounds[p + 1]] for p in peers})

