"""Hierarchical allreduce: shared memory inside each host, a ring across hosts, shared memory back.

With ``L`` ranks on each of ``H`` hosts the buffer is cut into ``L`` slices:

1. inside each host the ranks reduce-scatter through shared memory, so local rank ``l`` holds
   slice ``l`` reduced over its host;
2. local rank ``l`` allreduces slice ``l`` with local rank ``l`` of every other host, a TCP ring of
   ``H`` ranks; the ``L`` rings run at once, so every rank's connections carry traffic;
3. inside each host the ranks allgather the slices through shared memory.

Each host sends ``2(H-1)/H`` of the buffer over the network (a flat ring of ``H*L`` ranks sends
``2(HL-1)/HL`` through each host's links) in ``2(H-1)`` dependent steps instead of ``2(HL-1)``.
Each slice is reduced in one fixed order (host-local order, then the ring's) and then copied
everywhere, so every rank gets the same bits; the order differs from the flat ring's, so floats
agree with it within rounding, integers and Min/Max exactly.

Small buffers, where each step's latency is the cost, take one step fewer: a shared-memory
allreduce inside each host, then every local rank runs the cross ring on the whole buffer (the ``L``
rings reduce identical inputs in the same positions, so they agree bit for bit), and no allgather.
"""

from __future__ import annotations

import traceback

import numpy as np

from hora.collectives import ring
from hora.collectives.reduce import reducer
from hora.collectives.shm_ops import ShmCollectives
from hora.transport.base import NativeOps

SMALL_BYTES = 64 << 10  # up to this, each local rank runs the cross ring on the whole buffer (see allreduce)


def allreduce(local, local_rank: int, local_size: int, cross, flat: np.ndarray, op: int,
              scratch: ring.Scratch) -> None:
    """Reduce the 1-D ``flat`` in place (Average is Sum here: the engine scales).

    ``local`` offers ``native_allreduce``, ``native_reducescatter`` and ``native_allgather`` over this
    host's ranks (this rank is ``local_rank`` of ``local_size``); ``cross`` is a point-to-point
    communicator over the ranks with the same local rank on every host.
    """
    if flat.nbytes <= SMALL_BYTES:  # latency-bound: skip the split, and with it the allgather's step
        local.native_allreduce(flat, op)  # every local rank gets its host's sum, with the same bits ...
        if cross.size > 1:  # ... so every cross ring reduces the same inputs: the same bits everywhere
            ring.allreduce(cross, flat, reducer(op), scratch=scratch)
        return
    bounds = ring.even_bounds(flat.size, local_size)
    local.native_reducescatter(flat, bounds, op)  # 1. slice l reduced over this host
    mine = flat[bounds[local_rank]:bounds[local_rank + 1]]
    if cross.size > 1:
        ring.allreduce(cross, mine, reducer(op), scratch=scratch)  # 2. ... and over every host
    local.native_allgather(mine, flat, bounds)  # 3. every slice to every local rank


class HierarchicalAllreduce(NativeOps):
    """The native allreduce of one set of ranks spread evenly over hosts (the job, or a process set),
    on the :class:`hora.transport.hierarchical.HostLayout` the transport opened for them."""

    def __init__(self, layout):
        self._group, self._cross = layout.group, layout.cross
        self._local = ShmCollectives(layout.group)
        self._scratch = ring.Scratch()

    def native_allreduce(self, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
        """Reduce the 1-D ``flat`` in place (Average is Sum here: the engine scales); ``src``, if
        given, is the input (copied into ``flat`` first)."""
        if src is not None:
            flat[...] = src
        ctrl = self._group.ctrl
        if ctrl is not None and ctrl.broken is not None:
            raise ctrl.broken
        try:
            allreduce(self._local, self._group.rank, self._group.size, self._cross, flat, op, self._scratch)
        except BaseException as e:
            # half-way through, this host's ranks are at different steps of the group: it cannot be
            # used again, and leaving it as aborted tells the local peers at once (they may be waiting
            # on us in shared memory while we were the one that saw a remote rank go)
            self._group.abort()
            traceback.clear_frames(e.__traceback__)  # frames hold views of the segment
            raise

    def close(self) -> None:
        self._group.close()
