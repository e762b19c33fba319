"""Collectives through a shared segment, for the ranks of one host: the data-movement ops (reducescatter,
allgather, broadcast, alltoall) here, the allreduce family in :mod:`hora.collectives.shm_allreduce`.

:class:`ShmCollectives` makes them a group's native collectives (what the engine prefers to the
TCP algorithms). They run on a group ``g`` (:class:`hora.transport.shm.ShmGroup`): ``g.rank``, ``g.size``,
``g.chunk`` bytes per rank and slot, ``g.area(slot, p)`` (``p == g.size``: the slot's result area),
``g.acquire()`` before each use of a slot and ``g.done_after(slot, step)`` after it (or
``g.mark_free``), ``g.signal()`` to publish a step and ``g.wait(step)`` for the others to reach it.
Every rank takes the same steps in the same order; a collective takes one step per round, none to
say it is done reading (its next step says that).
"""

from __future__ import annotations

import traceback

import numpy as np

from hora.base.errors import HoraValueError
from hora.collectives import shm_allreduce
from hora.collectives.shm_allreduce import _fold, _ufunc
from hora.transport.base import NativeOps


def reducescatter(g, buf: np.ndarray, bounds: list[int], op: int) -> None:
    """Afterwards ``buf[bounds[r]:bounds[r+1]]`` holds the reduction of that block over the group.
    Every rank's block advances by ``chunk / n`` per round, so all ranks reduce at once."""
    n, r = g.size, g.rank
    ufunc = _ufunc(op)
    if n == 1:
        return
    dt, isz = buf.dtype, buf.itemsize
    c = max(1, g.chunk // n // isz)  # elements of each block per round
    longest = max(bounds[q + 1] - bounds[q] for q in range(n))
    for j in range(0, longest, c):
        pieces = [(bounds[q] + min(j, bounds[q + 1] - bounds[q]), bounds[q] + min(j + c, bounds[q + 1] - bounds[q]))
                  for q in range(n)]
        slot = g.acquire()
        mine = g.area(slot, r, dt)
        for q, (a, b) in enumerate(pieces):
            if q != r:
                mine[q * c:q * c + b - a] = buf[a:b]
        s = g.signal()
        g.wait(s)
        a, b = pieces[r]
        if b > a:
            acc = g.area(slot, n, dt)[r * c:r * c + b - a]
            srcs = [buf[a:b] if p == r else g.area(slot, p, dt)[r * c:r * c + b - a] for p in range(n)]
            _fold(ufunc, srcs, acc)
            buf[a:b] = acc
        g.done_after(slot, s)


def _rounds(g, nbytes: int) -> range:
    return range(0, nbytes, g.chunk)


def allgather(g, mine: np.ndarray, out: np.ndarray, bounds: list[int]) -> None:
    """``out[bounds[p]:bounds[p+1]]`` gets rank ``p``'s ``mine`` (1-D views of one dtype)."""
    n, r = g.size, g.rank
    out[bounds[r]:bounds[r + 1]] = mine
    src, dst, isz = mine.view(np.uint8), out.view(np.uint8), out.itemsize
    lens = [(bounds[p + 1] - bounds[p]) * isz for p in range(n)]
    for j in _rounds(g, max(lens)):
        slot = g.acquire()
        k = max(0, min(g.chunk, lens[r] - j))
        g.area(slot, r)[:k] = src[j:j + k]
        s = g.signal()
        g.wait(s)
        for p in g.others:
            k = max(0, min(g.chunk, lens[p] - j))
            if k:
                dst[bounds[p] * isz + j:bounds[p] * isz + j + k] = g.area(slot, p)[:k]
        g.done_after(slot, s)


def broadcast(g, buf: np.ndarray, root: int) -> None:
    """Copy ``root``'s ``buf`` (1-D) into everyone's ``buf``."""
    raw = buf.view(np.uint8)
    for j in _rounds(g, raw.nbytes):
        k = min(g.chunk, raw.nbytes - j)
        slot = g.acquire()
        if g.rank == root:
            g.area(slot, root)[:k] = raw[j:j + k]
            s = g.signal()
        else:
            s = g.signal()
            g.wait(s, [root])
            raw[j:j + k] = g.area(slot, root)[:k]
        g.done_after(slot, s)


def alltoall(g, send: np.ndarray, send_bounds: list[int], out: np.ndarray, recv_bounds: list[int]) -> None:
    """Rank ``p`` gets ``send[send_bounds[p]:send_bounds[p+1]]``; ``out[recv_bounds[p]:...]`` gets
    rank ``p``'s block for us. The ranks first publish their send bounds (one step)."""
    n, r = g.size, g.rank
    parity = g.meta_turn  # metadata is double buffered: a fast rank may start the next alltoall early
    g.meta_turn ^= 1
    g.meta(r, parity)[:n + 1] = send_bounds
    g.wait(g.signal())
    sb = [g.meta(p, parity)[:n + 1].tolist() for p in range(n)]
    for p in range(n):
        if sb[p][r + 1] - sb[p][r] != recv_bounds[p + 1] - recv_bounds[p]:
            raise HoraValueError(f"alltoall: rank {p} sends {sb[p][r + 1] - sb[p][r]} elements to rank {r}, "
                                 f"which expects {recv_bounds[p + 1] - recv_bounds[p]}")
    out[recv_bounds[r]:recv_bounds[r + 1]] = send[send_bounds[r]:send_bounds[r + 1]]
    src, dst, isz = send.view(np.uint8), out.view(np.uint8), out.itemsize
    for j in _rounds(g, max(s[n] for s in sb) * isz):
        slot = g.acquire()
        k = max(0, min(g.chunk, sb[r][n] * isz - j))
        g.area(slot, r)[:k] = src[j:j + k]
        s = g.signal()
        g.wait(s)
        for p in g.others:  # our block in p's send buffer, clipped to this round's bytes
            a, b = max(sb[p][r] * isz, j), min(sb[p][r + 1] * isz, j + g.chunk)
            if b > a:
                o = recv_bounds[p] * isz + a - sb[p][r] * isz
                dst[o:o + b - a] = g.area(slot, p)[a - j:b - j]
        g.done_after(slot, s)


class ShmCollectives(NativeOps):
    """The native collectives of one shared-memory group (the job's, or a process set's); ranks and
    roots are the group's. Each has the contract of the algorithm over point-to-point it replaces.
    ``pair`` and ``zero_copy`` choose the np=2 allreduce's paths (:func:`shm_allreduce.allreduce`); a
    benchmark may switch them on every rank alike (``comm.native_allreduce.__self__``)."""

    def __init__(self, group):
        self._group = group
        self.pair = True
        self.zero_copy = True

    def _run(self, fn, *args, **kwargs) -> None:
        g = self._group
        if g.ctrl is not None and g.ctrl.broken is not None:
            raise g.ctrl.broken
        g.begin()
        try:
            fn(g, *args, **kwargs)
        except BaseException as e:
            g.abort()  # this rank's steps no longer match the others': the group is done, peers are told
            # the traceback's frames hold views of the segment: clear them, or the user's
            # `except` block (where elastic code shuts down and re-inits) keeps it mapped
            traceback.clear_frames(e.__traceback__)
            raise
        finally:
            g.end()

    def native_allreduce(self, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
        """Reduce the 1-D ``flat`` in place (Average is Sum here: the engine scales); with ``src``,
        reduce ``src`` into ``flat`` and leave ``src`` unwritten (out of place without a copy first)."""
        self._run(shm_allreduce.allreduce, flat, op, src, pair=self.pair, zero_copy=self.zero_copy)

    def native_allreduce_parts(self, srcs: list, outs: list, op: int, prescale: float = 1.0,
                               postscale: float = 1.0) -> None:
        """Reduce the 1-D ``srcs`` into ``outs`` as one allreduce of their concatenation, each input
        scaled by ``prescale`` first and each output by ``postscale`` after
        (:func:`shm_allreduce.allreduce_parts`)."""
        self._run(shm_allreduce.allreduce_parts, srcs, outs, op, prescale, postscale)

    def native_reducescatter(self, buf: np.ndarray, bounds: list[int], op: int) -> None:
        """``ring.reduce_scatter``'s contract: afterwards ``buf[bounds[r]:bounds[r+1]]`` is reduced
        (Average is Sum here)."""
        self._run(reducescatter, buf, bounds, op)

    def native_allgather(self, mine: np.ndarray, out: np.ndarray, bounds: list[int]) -> None:
        """``exchange.allgather_blocks``'s contract."""
        self._run(allgather, mine, out, bounds)

    def native_broadcast(self, buf: np.ndarray, root: int) -> None:
        """``exchange.broadcast``'s contract."""
        self._run(broadcast, buf, root)

    def native_alltoall(self, send: np.ndarray, send_bounds: list[int], out: np.ndarray,
                        recv_bounds: list[int]) -> None:
        """``exchange.alltoall_blocks``'s contract."""
        self._run(alltoall, send, send_bounds, out, recv_bounds)

    def close(self) -> None:
        self._group.close()
