"""The connection plan: which connections a rank opens at start-up, which on first use, and how a control
message finds its way to a rank it has no connection to.

Data: at ``init`` a rank connects only to its ring neighbours (rank - 1 and rank + 1, modulo the size),
which is all the ring allreduce, the ring allgather and broadcast need; any other peer (alltoall, a process
set whose ring is different, point-to-point in a hierarchical transport's ring of host leaders) is connected
on first use, and closed again by agreement past a bound (:mod:`hora.transport.idle`). Of a pair, the higher
rank always dials and the lower one accepts, so two ranks that need each other at the same moment open one
connection, never two; dialing needs nothing from the peer's own
threads (its accept loop, :mod:`hora.transport.acceptor`, answers), so a lower rank waiting to be dialed
waits only for higher ranks, and the highest rank waits for nobody: no cycle of waits.

Control: a tree with rank 0 at the root, ``FANOUT`` children per rank (rank ``r``'s children are
``r*FANOUT + 1`` ... ``r*FANOUT + FANOUT``), so a rank holds at most ``FANOUT + 1`` control connections
and a message crosses at most ``depth(size - 1)`` = O(log N) links. Jobs of up to ``FANOUT + 1`` ranks get
the star they always had. A descendant has a higher rank than each of its ancestors, which
:meth:`hora.transport.control.ControlPlane.send_all` uses: news sent to many ranks in descending order
passes each router before the router's own copy (which may end its engine) arrives.

Everything here is arithmetic on ranks; the simulation (``benchmarks/scale_sim.py``) and the TCP mesh use
the same functions.
"""

from __future__ import annotations

FANOUT = 8  # control-tree children per rank: at most 9 control connections per rank, depth log8(N)


def ring_neighbours(rank: int, size: int) -> tuple[int, ...]:
    """The data connections opened at start-up: the ring's previous and next rank (one for size 2)."""
    return tuple(sorted({(rank - 1) % size, (rank + 1) % size} - {rank}))


def dials(rank: int, peer: int) -> bool:
    """Whether ``rank`` opens the connection to ``peer`` (the higher rank of a pair dials)."""
    return rank > peer


def parent(rank: int, fanout: int = FANOUT) -> int | None:
    """The control tree's parent of ``rank`` (None for rank 0)."""
    return None if rank == 0 else (rank - 1) // fanout


def children(rank: int, size: int, fanout: int = FANOUT) -> range:
    """The control tree's children of ``rank`` in a job of ``size``."""
    first = rank * fanout + 1
    return range(min(first, size), min(first + fanout, size))


def depth(rank: int, fanout: int = FANOUT) -> int:
    """Links between ``rank`` and rank 0 in the control tree."""
    d = 0
    while rank:
        rank, d = (rank - 1) // fanout, d + 1
    return d


def next_hop(me: int, dst: int, fanout: int = FANOUT) -> int:
    """The neighbour of ``me`` in the control tree on the way to ``dst`` (``dst`` itself when adjacent):
    down to the child whose subtree holds ``dst``, else up to the parent."""
    x = dst
    while x > me:  # ancestors have lower ranks than their descendants
        p = (x - 1) // fanout
        if p == me:
            return x
        x = p
    up = parent(me, fanout)
    if up is None:
        raise ValueError(f"rank {dst} is not in the control tree below rank {me}")
    return up


def control_links(rank: int, size: int, fanout: int = FANOUT) -> tuple[int, ...]:
    """The control connections a rank holds: its parent and its children."""
    up = parent(rank, fanout)
    return tuple(([] if up is None else [up]) + list(children(rank, size, fanout)))


def subtree(rank: int, size: int, fanout: int = FANOUT) -> list[int]:
    """``rank`` and every rank below it in the control tree, in ascending order (level by level: the ranks
    below a contiguous range of one level are a contiguous range of the next)."""
    out: list[int] = []
    lo = hi = rank
    while lo < size:
        out.extend(range(lo, min(hi + 1, size)))
        lo, hi = lo * fanout + 1, hi * fanout + fanout
    return out
