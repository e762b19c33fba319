"""Hierarchical allreduce of device tensors (``HOROVOD_HIERARCHICAL_ALLREDUCE=1``): NCCL inside each host,
hora's host ring between hosts, NCCL inside each host again, as Horovod does it:

1. the tensors are packed into the device fusion buffer, padded to ``L`` equal blocks (``L``: ranks per host);
2. ``ncclReduceScatter`` on the host's communicator: local rank ``i`` holds its host's reduction of block ``i``
   (the prescale factor is its pre-multiplier);
3. block ``i`` goes down to pinned host memory, is allreduced by hora's ring among the ranks with local rank
   ``i`` on every host (``L`` rings at once, each over ``1/L`` of the data), scaled there with Horovod's
   numerics (Average folded into the postscale), and goes back up;
4. ``ncclAllGather`` on the host's communicator: every rank has every block; the tensors are unpacked.

Step 3 waits on the host for step 2, in the thread that drives the engine, by polling an event with the
checks of :mod:`hora.engine.device_wait` (NCCL's asynchronous error, the control plane, the stall bounds):
never inside CUDA, so a host peer lost during step 2 aborts the communicators and fails the rank. The host's
communicator is split from the global one (``ncclCommSplit``, color = host) where NCCL has it, else made
from a fresh unique id per host; the ring runs over the host transport among the ranks of one local rank.
Only the global process set uses it, and only where there are several hosts, each with the same number
(> 1) of ranks; elsewhere the flat NCCL allreduce runs, and rank 0 says why once.
"""

from __future__ import annotations

import dataclasses
import math

from hora.base.device import ITEMSIZE
from hora.collectives.reduce import Average, Max, Min, Product, Sum
from hora.engine import messages as m
from hora.engine.device_ops import pack, unpack
from hora.engine.execute import allreduce_flat, dtype_of
from hora.transport import cuda, nccl_lib
from hora.transport.base import SubCommunicator

_NCCL_OP = {Sum: nccl_lib.SUM, Average: nccl_lib.SUM, Product: nccl_lib.PROD, Max: nccl_lib.MAX,
            Min: nccl_lib.MIN}


@dataclasses.dataclass
class Layout:
    """``hosts``: the global ranks of each host (hosts in the order of their first rank, ranks in order);
    ``host``: this rank's host's index; ``local``: this rank's index on it."""

    hosts: list[list[int]]
    host: int
    local: int

    @property
    def cross_ranks(self) -> tuple[int, ...]:
        """The ranks with this rank's local index, one per host: its ring between hosts."""
        return tuple(h[self.local] for h in self.hosts)


def layout(hostnames: list[str], rank: int) -> tuple[Layout | None, str]:
    """The host layout of the global set from every rank's host name, or (None, why it is not hierarchical)."""
    by_host: dict[str, list[int]] = {}
    for r, h in enumerate(hostnames):
        by_host.setdefault(h, []).append(r)
    hosts = list(by_host.values())
    sizes = sorted({len(h) for h in hosts})
    if len(hosts) < 2:
        return None, "all ranks are on one host"
    if len(sizes) > 1:
        return None, f"hosts run different numbers of ranks ({', '.join(map(str, sizes))})"
    if sizes[0] < 2:
        return None, "every host runs one rank"
    host = next(i for i, h in enumerate(hosts) if rank in h)
    return Layout(hosts, host, hosts[host].index(rank)), ""


@dataclasses.dataclass
class Hierarchy:
    """What a hierarchical allreduce runs on: the host's NCCL communicator and the ring between hosts."""

    local: object  # NcclComm of this host's ranks
    cross: SubCommunicator
    layout: Layout


def build(lay: Layout, parent, make_local, comm) -> Hierarchy:
    """``parent``: the global NCCL communicator (split where NCCL can); ``make_local(key suffix, rank, size,
    ranks)`` makes a communicator from a fresh unique id otherwise; ``comm``: the global host communicator."""
    size, ranks = len(lay.hosts[0]), tuple(lay.hosts[lay.host])
    if parent.lib.has("ncclCommSplit"):
        local = parent.split(lay.host, lay.local, size, ranks)
    else:
        local = make_local(f"local/{lay.host}", lay.local, size, ranks)
    return Hierarchy(local, SubCommunicator(comm, lay.cross_ranks), lay)


def allreduce(resp: m.Response, pends: list, h: Hierarchy, lane, n: int, scratch) -> tuple[list, list]:
    """Steps 1-4 above for one (fused) allreduce response; ``(done, keep)`` as in :mod:`device_ops`."""
    rt, s, dtype, nc = lane.rt, lane.stream, resp.dtype, h.local
    item = ITEMSIZE[dtype]
    counts = [math.prod(sh) for sh in resp.shapes]
    total, size = sum(counts), nc.size
    block = -(-total // size)  # elements per local rank, the last block padded
    fb = lane.fusion((size + 1) * block * item)
    mine = fb + size * block * item
    keep: list = []
    pack(lane, pends, counts, resp, fb, keep)
    off = fb + total * item
    if size * block > total:  # the padding's result is dropped: any value does
        rt.memset(off, 0, (size * block - total) * item, s)
    op = nc.premul_sum(resp.pre, dtype) if resp.pre != 1.0 else _NCCL_OP[resp.op]
    nc.reducescatter(fb, mine, block, dtype, op, s)
    pinned = lane.pinned(block * item)
    rt.copy(pinned.ctypes.data, mine, block * item, cuda.D2H, s)
    lane.drain(f"hierarchical allreduce {', '.join(resp.names[:3])} (its reduce-scatter inside the host)")
    host = pinned[:block * item].view(dtype_of(dtype))
    post = resp.post * (1.0 / n if resp.op == Average else 1.0)
    allreduce_flat(h.cross, host, Sum if resp.op == Average else resp.op, 1.0, post, scratch)
    rt.copy(mine, pinned.ctypes.data, block * item, cuda.H2D, s)
    nc.allgather(mine, fb, block, dtype, s)
    if len(counts) > 1:
        lane.fused = (len(counts), total * item)
    return unpack(lane, pends, counts, dtype, fb), keep
