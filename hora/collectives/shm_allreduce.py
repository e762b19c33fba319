"""The shared-memory allreduce family, for the ranks of one host: a buffer reduced in place or out of place
(:func:`allreduce`), a fused list of tensors reduced without a fusion buffer (:func:`allreduce_parts`).

They run on a group ``g`` (:class:`hora.transport.shm.ShmGroup`, whose API :mod:`hora.collectives.shm_ops`
describes) and take the same steps in the same order on every rank. Three paths, chosen by size and group:

* small buffers (up to :data:`SMALL_BYTES`): every rank writes its input into its area once and reduces all
  areas itself, in rank order: one wait (:func:`_allreduce_small`);
* np=2 (:func:`_allreduce_pair`): per chunk, each rank copies its input into its area and, once the peer has
  too, reduces the whole chunk itself, ``in0 op in1`` (rank 0's operand first on both ranks, so the same
  bits everywhere), straight into its output: one copy, one reduction, one wait per chunk, no copy-out;
  when both ranks reduce in place a buffer from ``hora.shared_empty``, past the first chunk each reads the
  peer's input where it is (:func:`_zero_copy`);
* larger groups (:func:`_split_steps`): per chunk each rank copies its input in, reduces its slice over every
  rank's input into the result area, and everyone copies the whole result out; each element is reduced in
  rank order by one rank, so every rank gets the same bits.

A fused allreduce (:func:`allreduce_parts`) runs the same steps on the tensors themselves: the segment is the
fusion buffer. Why these designs and what they cost, measured: benchmarks/README.md ("The shared-memory
allreduce: design and measurements").
"""

from __future__ import annotations

import ctypes

import numpy as np

from hora.base.errors import HoraError, HoraValueError
from hora.collectives.reduce import Average, Max, Min, Product, Sum, scale
from hora.transport import arena


UFUNCS = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}
# Up to this, every rank reduces everything itself after one synchronisation (n x the reads, half the
# waits; measured: benchmarks/README.md). Capped by the chunk, the size of one rank's area.
SMALL_BYTES = 256 << 10
# np=2, both buffers in shared memory (hora.transport.arena), in place: the peer's is read where it is
# (:func:`_zero_copy`), in pieces of this many bytes
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


def allreduce(g, flat: np.ndarray, op: int, src: np.ndarray | None = None, *, pair: bool = True,
              zero_copy: bool = True) -> None:
    """Reduce the 1-D contiguous ``flat`` in place over the group; or, with ``src`` (1-D, contiguous,
    as long as ``flat``, not overlapping it), reduce ``src`` into ``flat`` without writing ``src``:
    the inputs are read where they are, so an out-of-place allreduce needs no copy of its input first.
    ``pair``: np=2 takes the one-copy path (:func:`_allreduce_pair`; False: the split path larger groups
    take, for benchmarks/shm_profile.py to compare the two in one job); ``zero_copy``: that path reads a
    peer's buffer in shared memory where it is (:func:`_zero_copy`). Every rank must pass the same."""
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
    if n == 2 and pair:
        _allreduce_pair(g, flat, src, ufunc, zero_copy)
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


def _allreduce_pair(g, flat: np.ndarray, src: np.ndarray, ufunc, zero_copy: bool = True) -> None:
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
        where = arena.find(flat) if src is flat and zero_copy else None
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
