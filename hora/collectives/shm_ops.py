"""Collectives through a shared segment, for the ranks of one host.

:class:`ShmCollectives` makes them a group's native collectives (what the engine prefers to the
TCP algorithms). They run on a group ``g`` (:class:`hora.transport.shm.ShmGroup`): ``g.rank``, ``g.size``,
``g.chunk`` bytes per rank and slot, ``g.area(slot, p)`` (``p == g.size``: the slot's result area),
``g.acquire()`` before each use of a slot and ``g.done_after(slot, step)`` after it (or
``g.mark_free``), ``g.signal()`` to publish a step and ``g.wait(step)`` for the others to reach it.
Every rank takes the same steps in the same order; a collective takes one step per round, none to
say it is done reading (its next step says that).

Allreduce at np=2 (:func:`_allreduce_pair`), per chunk of ``g.chunk`` bytes: each rank copies its
input into its area; once the peer has too, each reduces the whole chunk itself, ``in0 op in1`` (rank
0's operand first on both ranks: the same bits everywhere, and the ring's: a+b == b+a), straight into
its output. One copy and one reduction per element, one wait per chunk, no copy-out.
Larger groups, per chunk: each rank copies its input into its area (all but its own slice), then
reduces its slice of the chunk over every rank's input into the result area, then everyone copies the
whole result out. Each element is reduced in rank order 0, 1, ..., n-1, by one rank, so every rank
gets the same bits. Small buffers skip the split: every rank reduces the whole buffer (one wait, not
two).

A fused allreduce (:func:`allreduce_parts`, the engine's ``native_allreduce_parts``) runs the same
steps on the tensors themselves: the segment is the fusion buffer. At np=2 packing is the copy-in (the
pieces of the tensors that fall in a chunk, straight into our area) and unpacking is the fold (each
output piece straight into its tensor): two passes per element where the fusion buffer took four
(pack, copy in, fold, unpack) or five (and the Average's scaling of the buffer). Larger groups run the
split pipeline so (:func:`_parts_split`): copy in from the tensors, copy out into them, postscaled
there; at np=3 and 4 (oversubscribed on 2 cores) 0.6-0.9x the fusion buffer's time and CPU
(benchmarks/shm_fused.py --np).

Memory traffic per rank for ``B`` bytes, np=2 path: copy in ``B`` (read the input, write our area),
fold ``B`` (read our input again while it is still in cache, read the peer's area across cores,
write the output in place over lines just read): ``3 B`` read and ``2 B`` written in two passes, of
which DRAM sees the input read once and the output written once (``2 B``, one memcpy's worth) while a
slot (``2 x chunk`` used at np=2) stays in cache. The split path (np > 2, and np=2 before): copy in
``(n-1)/n B``, fold ``B/n`` (read ``n`` inputs, write the result area), copy out ``B``: at np=2 ``2.5 B``
read and ``2 B`` written in three passes, the same DRAM traffic, but its copy-out writes output lines
that left the cache two chunks earlier, and its ranks wait twice per chunk's round trip (a chunk's
result needs both halves). Measured in one job (benchmarks/shm_profile.py, 64 MiB): 12% less CPU in
the phases, 7-27% less wall time. A single-copy design with Linux CMA (``process_vm_readv`` of the
peer's input into a cached temporary, reduce into our output) copies as much (``B`` per rank), but
through the kernel, which copied at 0.7x NumPy's speed here (3.3 vs 4.75 GB/s, 64 MiB in 1 MiB pieces,
page pinning included; on a quiet machine 8.7 vs 18.4 GB/s into a cached temporary, 6.8 vs 7.2 into
a 64 MiB destination: benchmarks/cma_copy.py), and its sources are the peer's DRAM pages: not built.

Only inputs that already lie in shared memory go below two passes. Buffers from ``hora.shared_empty``
(:mod:`hora.transport.arena`) do: when both ranks of a pair reduce one in place, past the first
(short) chunk :func:`_zero_copy` reads the peer's input where it is. Per rank, half the elements are
folded (read ours and the peer's, write ours) and half copied from the peer's result: ``1.5 B`` read
and ``B`` written in one pass, DRAM seeing each buffer read once and written once (both ranks' inputs
are read by someone once). ``benchmarks/allreduce.py --np 2 --rounds 3`` on a quiet machine: 64 MiB
8.0 ms against 13.1 through the segment, 16 MiB 1.3 against 2.6 ms (benchmarks/README.md, round 3).
"""

from __future__ import annotations

import ctypes
import traceback

import numpy as np

from hora.base.errors import HoraError, HoraValueError
from hora.collectives.reduce import Average, Max, Min, Product, Sum, scale
from hora.transport import arena
from hora.transport.base import NativeOps

UFUNCS = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}
# Up to this, every rank reduces everything itself after one synchronisation (n x the reads, half the
# waits). np=2, same run, time per allreduce one-step vs pipelined: 128 KiB 0.05 vs 0.06 ms, 256 KiB
# 0.07-0.16 vs 0.31-0.51 ms, 512 KiB 0.26 vs 0.26 ms, 1 MiB even (a wait costs more than the extra
# reads on a loaded 2-core machine). Capped by the chunk, the size of one rank's area.
SMALL_BYTES = 256 << 10
# np=2 takes the one-copy path (:func:`_allreduce_pair`); False sends it down the split path that
# larger groups take (benchmarks/shm_profile.py switches it to compare the two in one job)
PAIR = True
# np=2, both buffers in shared memory (hora.transport.arena), in place: read the peer's where it is
# (:func:`_zero_copy`), in pieces of this many bytes
ZERO_COPY = True
ZERO_COPY_BYTES = 8 << 20
# np=2 past one chunk: the first chunk's size (the one that carries the descriptors)
HEAD_BYTES = 64 << 10


def _ufunc(op: int):
    try:
        return UFUNCS[op]
    except KeyError:
        raise HoraValueError(f"shared-memory allreduce: op {op} is not supported (Average, Sum, Min, Max, "
                             "Product are)") from None


def _fold(ufunc, srcs: list, out: np.ndarray) -> None:
    """``out = srcs[0] op srcs[1] op ...``, left to right; ``out`` may be none of the srcs past the first two."""
    ufunc(srcs[0], srcs[1], out=out)
    for s in srcs[2:]:
        ufunc(out, s, out=out)


def _split(m: int, n: int, r: int) -> tuple[int, int]:
    """Rank ``r``'s part of ``m`` items split ``n`` ways (the lowest parts get one more)."""
    base, extra = divmod(m, n)
    lo = r * base + min(r, extra)
    return lo, lo + base + (r < extra)


def allreduce(g, flat: np.ndarray, op: int, src: np.ndarray | None = None) -> None:
    """Reduce the 1-D contiguous ``flat`` in place over the group; or, with ``src`` (1-D, contiguous,
    as long as ``flat``, not overlapping it), reduce ``src`` into ``flat`` without writing ``src``:
    the inputs are read where they are, so an out-of-place allreduce needs no copy of its input first."""
    n, r = g.size, g.rank
    ufunc = _ufunc(op)
    if src is None:
        src = flat
    elif src.shape != flat.shape or src.dtype != flat.dtype:
        raise HoraValueError(f"shared-memory allreduce: src {src.dtype}{src.shape} does not match "
                             f"the output {flat.dtype}{flat.shape}")
    if n == 1 or flat.size == 0:
        if src is not flat:
            flat[...] = src
        return
    dt, isz = flat.dtype, flat.itemsize
    raw, inp = flat.view(np.uint8), src.view(np.uint8)
    if flat.nbytes <= min(SMALL_BYTES, g.chunk):
        _allreduce_small(g, flat, inp, ufunc)
        return
    if n == 2 and PAIR:
        _allreduce_pair(g, flat, src, ufunc)
        return
    per = g.chunk // isz
    count = flat.size

    def fill(j: int, slot: int) -> None:
        _copy_in(g, inp, isz, count, per, j * per, slot)

    def fold(j: int, slot: int) -> None:
        a = j * per
        lo, hi = _split(min(per, count - a), n, r)
        srcs = [src[a + lo:a + hi] if p == r else g.area(slot, p, dt)[lo:hi] for p in range(n)]
        _fold(ufunc, srcs, g.area(slot, n, dt)[lo:hi])

    def drain(j: int, slot: int) -> None:
        _copy_out(g, raw, isz, count, per, j * per, slot)

    _split_steps(g, -(-count // per), fill, fold, drain)


def _split_steps(g, k: int, fill, fold, drain) -> None:
    """The pipeline of groups larger than 2 over ``k`` chunks: ``fill(j, slot)`` writes this rank's
    operand of chunk ``j`` into its area of ``slot`` (all but its own slice, which it reads where it
    is), ``fold(j, slot)`` reduces its slice of chunk ``j`` over every rank's operand into the result
    area, ``drain(j, slot)`` copies the whole result of chunk ``j`` out.

    One wait per chunk: between two waits a rank drains chunk ``j - 1``, folds its slice of ``j`` and
    fills ``j + 1``, so the one signal after them says all three. (Needs three slots: chunk ``j + 1``'s
    slot held chunk ``j - 2``, which every rank drained before the signal we just waited for.)"""
    slots = [g.acquire()]
    fill(0, slots[0])
    s = g.signal()
    for j in range(k):
        g.wait(s)
        if j:
            drain(j - 1, slots[j - 1])
        fold(j, slots[j])
        if j + 1 < k:
            slots.append(g.acquire())
            fill(j + 1, slots[j + 1])
        s = g.signal()
        if j:
            g.mark_free(slots[j - 1], s)
    g.wait(s)
    drain(k - 1, slots[-1])
    g.done_after(slots[-1], s)


def _allreduce_pair(g, flat: np.ndarray, src: np.ndarray, ufunc) -> None:
    """np=2: each rank copies its whole input chunk into its area, and once the peer has too, reduces
    the whole chunk itself, straight into its output: ``flat = in0 op in1`` (rank 0's operand first on
    both ranks, so both get the same bits). One copy and one reduction per element, one wait per
    chunk, no result area and no copy-out. The steps are :func:`_pair_steps`'.

    With the first chunk each rank publishes where its buffer lies in shared memory (its descriptor,
    :mod:`hora.transport.arena`); when both reduce in place an array that lies there, the rest of the
    buffer goes :func:`_zero_copy`'s way once the first chunk is folded. Both ranks decide alike from
    the same two descriptors."""
    r, dt = g.rank, flat.dtype
    per = g.chunk // flat.itemsize
    count = flat.size
    starts = pair_starts(count, per, flat.itemsize)
    k = len(starts)
    switch = None
    if k > 1:
        where = arena.find(flat) if src is flat and ZERO_COPY else None
        d = g.desc(r)
        d[1:] = 0
        if where is not None:
            d[1:5] = (*where, flat.nbytes)
        d[0] = where is not None

        def switch() -> bool:
            pd = g.desc(1 - r)
            if where is None or not pd[0]:
                return False
            if int(pd[4]) != flat.nbytes:
                raise HoraValueError(f"shared-memory allreduce: rank {g.members[1 - r]}'s buffer holds "
                                     f"{int(pd[4])} bytes, this rank's {flat.nbytes}")
            peer = g.peer_view(1 - r, int(pd[1]), int(pd[2]), int(pd[3]), int(pd[4]))
            if peer is None:
                raise HoraError(f"shared-memory allreduce: cannot map rank {g.members[1 - r]}'s array from "
                                "hora.shared_empty through /proc/<pid>/fd (ranks run as different users, or "
                                "/proc is mounted hidepid?); allocate the buffer with np.empty instead")
            g.zero_copy += 1
            head = starts[1]
            _zero_copy(g, flat[head:], peer.view(dt)[head:], ufunc)
            return True

    def bounds(j: int) -> tuple[int, int]:
        return starts[j], starts[j + 1] if j + 1 < k else count

    def fill(j: int, slot: int) -> None:
        a, b = bounds(j)
        _pair_in(g.area(slot, r, dt), src, a, b - a)

    def fold(j: int, slot: int) -> None:
        a, b = bounds(j)
        _pair_fold(ufunc, r, src[a:b], g.area(slot, 1 - r, dt)[:b - a], flat[a:b])

    _pair_steps(g, k, fill, fold, switch)


def pair_starts(count: int, per: int, itemsize: int) -> list[int]:
    """Where np=2's chunks of a ``count``-element buffer start: past one chunk of ``per`` elements
    the first is a short one (``HEAD_BYTES``), which carries the descriptors of
    :func:`_allreduce_pair`; what it holds goes through the segment even when the rest is read
    where it lies. ``allreduce_parts`` cuts the concatenation alike: both take the same steps."""
    if count <= per:
        return [0]
    head = min(per, max(1, HEAD_BYTES // itemsize))
    return [0, *range(head, count, per)]


def _pair_steps(g, k: int, fill, fold, switch=None) -> None:
    """The np=2 pipeline over ``k`` chunks: ``fill(j, slot)`` writes this rank's operand of chunk ``j``
    into its area of ``slot``; ``fold(j, slot)`` reduces chunk ``j`` from both areas (or from our own
    input and the peer's area) into the output, reading the peer's area only.

    Per chunk ``j`` a rank waits for the peer's fill of ``j`` (which also says the peer is done
    reading the slot that chunk ``j + 1`` takes: its fold of ``j - 2``), fills ``j + 1``, publishes
    that, then folds ``j``: one step and one wait per chunk. ``switch`` (with ``k > 1``), called
    once the peer's first chunk is there, may take over the chunks after the first: True says it
    did, and the pipeline folds chunk 0 and ends."""
    slot = g.acquire()
    fill(0, slot)
    s = g.signal()
    for j in range(k):
        cur = slot
        if j + 1 < k:
            slot = g.acquire()
            g.wait(s)
            if j == 0 and switch is not None and switch():
                fold(0, cur)  # the slot is free once the peer's next step (the next call's) is seen
                g.done_after(cur, g.step)
                return
            fill(j + 1, slot)
            s2 = g.signal()
        else:
            g.wait(s)
        fold(j, cur)
        g.done_after(cur, g.step)  # the peer's next step after this one says it has folded this chunk
        if j + 1 < k:
            s = s2


def _zero_copy(g, own: np.ndarray, peer: np.ndarray, ufunc) -> None:
    """np=2, both buffers in shared memory, in place: ``own`` is this rank's, ``peer`` the peer's,
    mapped here. Per piece, rank ``r`` reduces its half into its own buffer, ``in0 op in1`` (rank
    0's operand first, as everywhere), and once the peer has reduced the other half, copies that
    half of the result from the peer's buffer into its own. Per element one fold (half of them) or
    one copy (the other half): one pass, where going through the segment takes two.

    One step per piece: a rank folds piece ``j``, publishes that, then copies the peer's half of
    piece ``j - 1`` (whose fold the step it last waited for announced) while the peer folds ``j``
    (other memory). Nobody writes memory the other still reads: a rank's fold writes its own half,
    which the peer reads only after the announcing step; its copy writes the peer's half of its own
    buffer, which the peer read in a fold announced before. A last step says both are done reading
    the other's buffer: after it, either may return and write its buffer again."""
    r = g.rank
    count = own.size
    per = max(1, ZERO_COPY_BYTES // own.itemsize)
    k = -(-count // per)

    def fold(j: int) -> None:
        a = j * per
        lo, hi = _split(min(per, count - a), 2, r)
        o = own[a + lo:a + hi]
        _pair_fold(ufunc, r, o, peer[a + lo:a + hi], o)

    def copy(j: int) -> None:
        a = j * per
        lo, hi = _split(min(per, count - a), 2, 1 - r)
        own[a + lo:a + hi] = peer[a + lo:a + hi]

    fold(0)
    s = g.signal()
    for j in range(1, k):
        g.wait(s)  # the peer folded piece j - 1
        fold(j)
        s2 = g.signal()
        copy(j - 1)
        s = s2
    g.wait(s)
    copy(k - 1)
    g.wait(g.signal())  # both are done reading the other's buffer


def _pair_in(area: np.ndarray, src: np.ndarray, a: int, m: int) -> None:
    area[:m] = src[a:a + m]


def _pair_fold(ufunc, r: int, own: np.ndarray, peer: np.ndarray, out: np.ndarray) -> None:
    if r == 0:
        ufunc(own, peer, out=out)
    else:
        ufunc(peer, own, out=out)


def allreduce_parts(g, srcs: list, outs: list, op: int, prescale: float = 1.0, postscale: float = 1.0) -> None:
    """Reduce the tensors ``srcs`` (1-D, contiguous, one dtype) into ``outs`` as one allreduce of
    their concatenation, with no fusion buffer: the segment is it. ``outs[i]`` is ``srcs[i]`` itself
    (in place) or a fresh array. Each result has the bits of :func:`allreduce` on the packed buffer
    (prescaled before, postscaled after), and takes its steps, so ranks may mix the two.

    np=2, per chunk of the (virtual) concatenation: the pieces of ``srcs`` in it are copied into our
    area (the packing is the copy-in) and scaled by ``prescale``; once the peer's are there, each
    output piece is ``area0 op area1`` (rank 0's operand first), then scaled by ``postscale`` while
    still in cache (the unpacking is the fold). Two passes per element instead of the fusion
    buffer's four or five. Larger groups (:func:`_parts_split`) run the split pipeline the same way.

    The fold (or copy-out) of chunk ``j`` writes in-place tensors before later chunks are copied in, so
    when an in-place tensor shares memory with another input (one array submitted twice) and there
    is more than one chunk, the call goes through a packed copy instead."""
    ufunc = _ufunc(op)
    if len(srcs) != len(outs):
        raise HoraValueError(f"shared-memory allreduce: {len(srcs)} inputs but {len(outs)} outputs")
    dt = srcs[0].dtype if srcs else None
    for s, o in zip(srcs, outs):
        if s.dtype != dt or o.dtype != dt or s.shape != o.shape or s.ndim != 1:
            raise HoraValueError(f"shared-memory allreduce: parts {s.dtype}{s.shape} -> {o.dtype}{o.shape} "
                                 f"are not 1-D of one dtype ({dt}) and matching sizes")
    total = sum(s.size for s in srcs)
    if total == 0:
        return
    per = g.chunk // dt.itemsize
    n, r = g.size, g.rank
    if n < 2 or (total > per and _aliased(srcs, outs)):
        _packed(g, srcs, outs, op, prescale, postscale)
        return
    plan = _plan(srcs, outs, total, pair_starts(total, per, dt.itemsize) if n == 2 else range(0, total, per))
    # Our operand read from the input itself rather than from our copy of it in the area (the same
    # numbers when nothing was prescaled): in place, the fold then writes over lines it has just read,
    # instead of fetching the output's lines from memory first (measured: ~10-30% faster per call at np=2)
    direct = prescale == 1.0 and not _aliased(srcs, outs)
    if n > 2 and total * dt.itemsize > min(SMALL_BYTES, g.chunk):
        _parts_split(g, plan, per, ufunc, dt, direct, prescale, postscale)
        return
    # np=2's pipeline, or (larger groups, one small chunk) allreduce's one step: every rank reduces it all
    direct = direct and n == 2  # past two operands, _fold's output may not be one of them

    def fill(j: int, slot: int) -> None:
        m, ins, _ = plan[j]
        mine = g.area(slot, r, dt)[:m]
        if len(ins) == 1:
            mine[...] = ins[0]
        else:
            np.concatenate(ins, out=mine)
        scale(mine, prescale)

    def fold(j: int, slot: int) -> None:
        areas = [g.area(slot, p, dt) for p in range(n)]
        _, ins, folds = plan[j]
        for x, (o, a, b) in zip(ins, folds):
            _fold(ufunc, [x if direct and p == r else areas[p][a:b] for p in range(n)], o)
            scale(o, postscale)

    _pair_steps(g, len(plan), fill, fold)  # n > 2 here means one chunk: allreduce's one-step path


def _parts_split(g, plan: list, per: int, ufunc, dt, direct: bool, prescale: float, postscale: float) -> None:
    """Groups larger than 2: :func:`allreduce`'s split pipeline on the tensors. The fill copies the
    pieces in the chunk straight into our area (but our own slice, unless prescaled: then all of it,
    scaled, and the fold reads it there); the fold reduces our slice piece by piece into the result
    area; the drain copies each output piece straight out of the result area and postscales it while
    it is in cache. Three passes per element (a third of one for the fold) where the fusion buffer
    took five or six (pack, copy in, fold, copy out, unpack, and the Average's scaling)."""
    n, r = g.size, g.rank

    def fill(j: int, slot: int) -> None:
        m, ins, folds = plan[j]
        mine = g.area(slot, r, dt)
        if not direct:
            if len(ins) == 1:
                mine[:m] = ins[0]
            else:
                np.concatenate(ins, out=mine[:m])
            scale(mine[:m], prescale)
            return
        lo, hi = _split(m, n, r)
        for x, (_, a, b) in zip(ins, folds):
            if a < lo:
                e = min(b, lo)
                mine[a:e] = x[:e - a]
            if b > hi:
                u = max(a, hi)
                mine[u:b] = x[u - a:]

    def fold(j: int, slot: int) -> None:
        m, ins, folds = plan[j]
        lo, hi = _split(m, n, r)
        areas = [g.area(slot, p, dt) for p in range(n)]
        res = g.area(slot, n, dt)
        for x, (_, a, b) in zip(ins, folds):
            u, v = max(a, lo), min(b, hi)
            if u < v:
                _fold(ufunc, [x[u - a:v - a] if direct and p == r else areas[p][u:v] for p in range(n)], res[u:v])

    def drain(j: int, slot: int) -> None:
        res = g.area(slot, n, dt)
        for o, a, b in plan[j][2]:
            o[...] = res[a:b]
            scale(o, postscale)

    _split_steps(g, len(plan), fill, fold, drain)


def _plan(srcs: list, outs: list, total: int, starts: list[int]) -> list:
    """Per chunk (``starts``: where each begins) of the concatenation of ``srcs``: (its length, the pieces of
    ``srcs`` in it, in order, and (piece of ``outs``, start, end in the chunk) for each); once per
    call, so a chunk's fill is one copy (or one ``np.concatenate``) and its fold one ufunc per piece."""
    plan = []
    i = pos = 0
    for j, c in enumerate(starts):
        m = (starts[j + 1] if j + 1 < len(starts) else total) - c
        ins, folds = [], []
        filled = 0
        while filled < m:
            s = srcs[i]
            take = min(s.size - pos, m - filled)
            if take:
                whole = pos == 0 and take == s.size
                ins.append(s if whole else s[pos:pos + take])
                folds.append((outs[i] if whole else outs[i][pos:pos + take], filled, filled + take))
                pos += take
                filled += take
            if pos == s.size:
                i, pos = i + 1, 0
        plan.append((m, ins, folds))
    return plan


def _address(a: np.ndarray) -> int:
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(a))  # 4x faster than __array_interface__
    except (TypeError, ValueError):  # read-only (or empty)
        return a.__array_interface__["data"][0]


def _aliased(srcs: list, outs: list) -> bool:
    """Whether an in-place part (``outs[i] is srcs[i]``) shares memory with another input."""
    if not any(o is s for s, o in zip(srcs, outs)):
        return False
    spans = sorted((_address(s), s.nbytes) for s in srcs if s.size)
    end = 0
    for start, nbytes in spans:
        if start < end:
            return True
        end = max(end, start + nbytes)
    return False


def _packed(g, srcs: list, outs: list, op: int, prescale: float, postscale: float) -> None:
    """The fusion buffer's way: pack, allreduce, unpack (where the direct way does not apply)."""
    flat = np.concatenate(srcs)
    scale(flat, prescale)
    allreduce(g, flat, op)
    scale(flat, postscale)
    off = 0
    for o in outs:
        o[...] = flat[off:off + o.size]
        off += o.size


def _allreduce_small(g, flat: np.ndarray, inp: np.ndarray, ufunc) -> None:
    """One synchronisation: every rank writes its whole input into its area and publishes the step;
    once every rank has, each reduces all areas itself, in rank order (the same bits everywhere).
    No step says "done reading": a rank's next step comes after it, which is what reusing the slot
    waits for (:meth:`ShmGroup.done_after`)."""
    slot = g.acquire()
    g.area(slot, g.rank)[:inp.size] = inp
    s = g.signal()
    g.wait(s)
    m = flat.size
    _fold(ufunc, [g.area(slot, p, flat.dtype)[:m] for p in range(g.size)], flat)
    g.done_after(slot, s)


def _copy_in(g, inp, isz, count, per, a, slot) -> None:
    """Our input for the chunk at element ``a`` into our area, all but the slice we reduce ourselves."""
    m = min(per, count - a)
    lo, hi = _split(m, g.size, g.rank)
    mine = g.area(slot, g.rank)
    mine[:lo * isz] = inp[a * isz:(a + lo) * isz]
    mine[hi * isz:m * isz] = inp[(a + hi) * isz:(a + m) * isz]


def _copy_out(g, raw, isz, count, per, a, slot) -> None:
    m = min(per, count - a)
    raw[a * isz:(a + m) * isz] = g.area(slot, g.size)[:m * isz]


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
    roots are the group's. Each has the contract of the algorithm over point-to-point it replaces."""

    def __init__(self, group):
        self._group = group

    def _run(self, fn, *args) -> None:
        g = self._group
        if g.ctrl is not None and g.ctrl.broken is not None:
            raise g.ctrl.broken
        g.begin()
        try:
            fn(g, *args)
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
        self._run(allreduce, flat, op, src)

    def native_allreduce_parts(self, srcs: list, outs: list, op: int, prescale: float = 1.0,
                               postscale: float = 1.0) -> None:
        """Reduce the 1-D ``srcs`` into ``outs`` as one allreduce of their concatenation, each input
        scaled by ``prescale`` first and each output by ``postscale`` after (:func:`allreduce_parts`)."""
        self._run(allreduce_parts, srcs, outs, op, prescale, postscale)

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
