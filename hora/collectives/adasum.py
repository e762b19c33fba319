"""Adasum allreduce over point-to-point, for any number of ranks, with per-tensor coefficients.

Adasum combines two vectors ``a`` and ``b`` (the lower ranks' and the higher ranks') as

    ``(1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b``

with ``a.b``, ``|a|^2`` and ``|b|^2`` summed in float64, and a coefficient taken as 1 when its norm² is
below ``sqrt(DBL_MIN)`` (a zero vector: so zeros are Adasum's neutral element, which is what a joined rank
contributes). Parallel vectors give their mean, orthogonal ones their sum. In a fused buffer every tensor
has its own three scalars and its own two coefficients.

**The order**, for ``n`` ranks (``p`` the largest power of two <= n, ``rem = n - p``):

1. *Fold*: for ``i < rem``, rank ``2i+1`` sends its vector to rank ``2i``, which computes
   ``combine(x[2i], x[2i+1])``. The ``p`` ranks left are numbered ``v = 0..p-1`` in rank order
   (``v = r // 2`` for the even ranks below ``2 rem``, ``v = r - rem`` above).
2. *Vector halving, distance doubling* (Horovod's): at level ``k = 1..log2 p`` vrank ``v`` pairs with
   ``v ^ 2^(k-1)``; the pair splits the segment both hold (the whole buffer at level 1) in two, the lower
   vrank keeping the first part, and swaps the other parts. Each computes its part's partial scalars and
   the block of ``2^k`` vranks sum-allreduces them (recursive doubling), then each combines its part:
   ``a`` is the lower half-block's vector, ``b`` the upper's.
3. *Distance halving* allgathers the finished segments (each postscaled first, by the rank that owns
   it); then rank ``2i`` sends the result to rank ``2i+1``.

So the tree is ordered left to right, the folded pairs first: np=3 is ``c(c(x0, x1), x2)``, np=5
``c(c(c(x0, x1), x2), c(x3, x4))``, np=6 ``c(c(c(x0, x1), c(x2, x3)), c(x4, x5))``, np=7
``c(c(c(x0, x1), c(x2, x3)), c(c(x4, x5), x6))``.

**Bits.** Each element of the result is computed once, by one rank, and copied to the others, so every
rank gets the same bits. And the bits do not depend on how the buffer was cut, nor on which tensors were
fused with which (which depends on timing): the scalars are sums over fixed *blocks* (``BLOCK`` elements
counted from each tensor's own start), the parts are cut only at block edges, each block's partial sums
(of float64 products: ``np.einsum("i,i->")`` for a whole block, ``np.add.reduceat`` for a shorter one;
NumPy's own loops, not BLAS, whose threads and kernels would make the order depend on the machine) are
made by exactly one rank and travel as they are (the others add exact zeros), and a tensor's scalar is the
``np.add.reduceat`` of its blocks' partials, in order. So a tensor's result
is a function of that tensor's inputs alone: fused or not, on any transport, by the inline path (rank 0
reducing small tensors with :func:`reduce_local`, the same tree on whole vectors) or not. The combination
is computed in float64 (float32 for float16 and bfloat16) and rounded once to the buffer's dtype per
level; data travels in the buffer's dtype.

**Cost** per rank, ``B`` bytes at np = p = 2^L: ``B (1 - 1/p)`` sent halving plus as much allgathering (a
ring allreduce's bytes; parts are within a block of even), plus ``L (L + 1) / 2`` messages of ``24`` bytes
per block of scalars; a folded pair adds ``B`` each way. The arithmetic (float64 products and combination)
is the cost on a CPU, not the bytes: a shared-memory variant (every input gathered through the segment, each
rank computing a slice of every round of the tree, the scalars summed by the segment) was measured against
this over the TCP mesh on the same shm ranks, 16 MiB float32, interleaved: np=2 86-91 ms against 69-72, np=4
152-169 against 134-160 (load 7 on 2 cores). Not kept.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import numpy as np

from hora.base.errors import HoraValueError

SQRT_DBL_MIN = math.sqrt(sys.float_info.min)  # ~1.5e-154: below it a norm² counts as zero
# The scalars' summation blocks (elements, from each tensor's start): parts are cut only at their edges, so
# at most half a block from even; 24 bytes of scalars travel per block (16 MiB of float32: 12 KiB).
BLOCK = 8192
# Elements per float64 conversion: the temporaries (3 x 64 KiB) stay in cache. Measured on 2 Mi float32
# (one rank's half of 16 MiB at np=2), loaded machine, best of 5: partials 10 ms at 8192 against 13.5 at
# 4096 and 32768; the combination 4.5 ms at 8192 against 9.5 at 32768.
BATCH = 8192
FLOATS = ("float16", "bfloat16", "float32", "float64")


def check_dtype(name: str, what: str = "allreduce") -> None:
    """Refuse a dtype Adasum cannot combine (integers and bool: its coefficients are fractions)."""
    if name not in FLOATS:
        raise HoraValueError(f"{what}: op=Adasum needs a floating-point tensor, got {name}; use one of "
                             f"{', '.join(FLOATS)} (or op=Sum / Average for integers)")


def work_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype the combination is computed in: float32 for the 16-bit floats, float64 otherwise."""
    return np.dtype(np.float32) if dtype.itemsize == 2 else np.dtype(np.float64)


class Blocks:
    """The fixed summation blocks of a (fused) buffer of tensors of ``counts`` elements: tensor ``t`` spans
    ``bounds[t]:bounds[t+1]`` and owns blocks ``first[t]:first[t+1]``; block ``i`` spans
    ``edges[i]:edges[i+1]`` (strictly increasing: empty tensors own no block)."""

    def __init__(self, counts: list[int]):
        c = np.asarray(counts, np.int64)
        self.bounds = np.concatenate(([0], np.cumsum(c)))
        per = (c + BLOCK - 1) // BLOCK
        self.first = np.concatenate(([0], np.cumsum(per)))
        owner = np.repeat(np.arange(len(c)), per)
        starts = self.bounds[owner] + (np.arange(len(owner)) - self.first[owner]) * BLOCK
        self.edges = np.append(starts, self.bounds[-1])
        self.owner = owner

    @property
    def count(self) -> int:
        return len(self.owner)

    def halves(self, lo: int, hi: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """``[lo, hi)`` (block edges) cut at the block edge nearest its middle (the lower one on a tie)."""
        e = self.edges
        mid = lo + (hi - lo) // 2
        k = int(np.searchsorted(e, mid))
        if e[k] != mid and mid - e[k - 1] <= e[k] - mid:
            k -= 1
        cut = int(e[k])
        return (lo, cut), (cut, hi)


def partials(a: np.ndarray, b: np.ndarray, lo: int, blocks: Blocks) -> np.ndarray:
    """``(3, blocks)`` float64: each block's ``a.b``, ``a.a`` and ``b.b`` for the blocks inside the segment
    ``a``, ``b`` (elements ``lo..lo+len(a)``, block edges at both ends); zero for the other blocks."""
    out = np.zeros((3, blocks.count))
    e = blocks.edges
    i, end = int(np.searchsorted(e, lo)), int(np.searchsorted(e, lo + a.size))
    m = min(a.size, max(BATCH, BLOCK))
    xb, yb, tb = np.empty(m), np.empty(m), np.empty(m)
    while i < end:  # a batch of whole blocks of at most BATCH elements (or one block)
        k = min(end, max(i + 1, int(np.searchsorted(e, e[i] + BATCH, side="right")) - 1))
        s, f = int(e[i]) - lo, int(e[k]) - lo
        x, y, t = xb[:f - s], yb[:f - s], tb[:f - s]
        x[...], y[...] = a[s:f], b[s:f]
        if f - s == BLOCK:  # a whole block (always alone in its batch): einsum's fused loop, 3x faster
            for row, (u, w) in enumerate(((x, y), (x, x), (y, y))):
                out[row, i] = np.einsum("i,i->", u, w)
        else:  # shorter blocks (a tensor's last, small tensors), several at once
            rel = e[i:k] - e[i]
            for row, (u, w) in enumerate(((x, y), (x, x), (y, y))):
                np.multiply(u, w, out=t)
                out[row, i:k] = np.add.reduceat(t, rel)
        i = k
    return out


def tensor_sums(blocks: Blocks, parts: np.ndarray) -> np.ndarray:
    """``(T, 3)``: each tensor's ``(a.b, a.a, b.b)``, the ``add.reduceat`` of its blocks' ``parts``, in order."""
    out = np.zeros((len(blocks.bounds) - 1, 3))
    has = blocks.first[1:] > blocks.first[:-1]
    if has.any():
        out[has] = np.add.reduceat(parts, blocks.first[:-1][has], axis=1).T
    return out


def coefficients(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each tensor's ``(ca, cb)`` from its ``(a.b, a.a, b.b)``; 1 where a norm² is below sqrt(DBL_MIN)."""
    ab, aa, bb = sums[:, 0], sums[:, 1], sums[:, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        ca = np.where(aa >= SQRT_DBL_MIN, 1.0 - ab / (2.0 * aa), 1.0)
        cb = np.where(bb >= SQRT_DBL_MIN, 1.0 - ab / (2.0 * bb), 1.0)
    return ca, cb


def combine(a: np.ndarray, b: np.ndarray, lo: int, bounds: np.ndarray, ca: np.ndarray, cb: np.ndarray,
            out: np.ndarray) -> None:
    """``out = ca[t] a + cb[t] b`` per tensor ``t`` (elements ``lo..lo+len(a)``), in :func:`work_dtype`,
    rounded once into ``out`` (which may be ``a`` or ``b``). Element by element: the cut does not matter."""
    wd = work_dtype(out.dtype)
    ca, cb = ca.astype(wd), cb.astype(wd)
    xb, yb = np.empty(min(a.size, BATCH), wd), np.empty(min(a.size, BATCH), wd)
    for c in range(0, a.size, BATCH):
        e = min(c + BATCH, a.size)
        first = int(np.searchsorted(bounds, lo + c, side="right")) - 1
        last = int(np.searchsorted(bounds, lo + e, side="left"))
        ts = np.arange(first, last)
        x, y = xb[:e - c], yb[:e - c]
        x[...], y[...] = a[c:e], b[c:e]
        if len(ts) == 1:
            fa, fb = ca[ts[0]], cb[ts[0]]
        else:  # per element: each tensor's length inside the batch
            lens = np.minimum(bounds[ts + 1], lo + e) - np.maximum(bounds[ts], lo + c)
            fa, fb = np.repeat(ca[ts], lens), np.repeat(cb[ts], lens)
        np.multiply(x, fa, out=x)
        np.multiply(y, fb, out=y)
        np.add(x, y, out=x)
        out[c:e] = x


def pair(a: np.ndarray, b: np.ndarray, blocks: Blocks, out: np.ndarray) -> None:
    """``combine(a, b)`` of two whole vectors on one rank (a fold, and :func:`reduce_local`)."""
    ca, cb = coefficients(tensor_sums(blocks, partials(a, b, 0, blocks)))
    combine(a, b, 0, blocks.bounds, ca, cb, out)


def _layout(n: int) -> tuple[int, int, int]:
    """``(p, rem, levels)``: the largest power of two <= n, the ranks folded in, log2 p."""
    p = 1 << (n.bit_length() - 1)
    return p, n - p, p.bit_length() - 1


# -- on the ranks ---------------------------------------------------------------------------------------
def _swap(comm, peer: int, send: np.ndarray, recv: np.ndarray) -> None:
    """Send ``send`` to ``peer`` while receiving ``recv`` from it (empty parts are skipped on both sides)."""
    reqs = [comm.irecv_into(peer, recv)] if recv.size else []
    if send.size:
        reqs.append(comm.isend(peer, send))
    for q in reqs:
        q.wait()


def allreduce(comm, flat: np.ndarray, counts: list[int], scratch, finish: Callable | None = None) -> None:
    """Adasum of the 1-D ``flat`` over ``comm``'s ranks, in place; ``counts``: the element counts of the
    tensors fused in it (their coefficients are their own). ``finish(segment)`` (the postscale) runs once on
    every element, on the rank that computed it, before it is copied to the others."""
    n, r = comm.size, comm.rank
    if n == 1 or flat.size == 0:
        if finish is not None:
            finish(flat)
        return
    blocks = Blocks(counts)
    p, rem, levels = _layout(n)
    real = lambda vv: 2 * vv if vv < rem else vv + rem  # noqa: E731 - the rank of vrank vv
    if r < 2 * rem:
        if r % 2:  # folded in: give our vector to the even neighbour, get the result back
            comm.isend(r - 1, flat).wait()
            comm.irecv_into(r - 1, flat).wait()
            return
        tmp = scratch.get(flat.nbytes, flat.dtype)
        comm.irecv_into(r + 1, tmp).wait()
        pair(flat, tmp, blocks, flat)
    v = r // 2 if r < 2 * rem else r - rem
    segs = [(0, flat.size)]
    for k in range(1, levels + 1):
        bit = 1 << (k - 1)
        upper = bool(v & bit)
        low, high = blocks.halves(*segs[-1])
        (klo, khi), (olo, ohi) = (high, low) if upper else (low, high)
        theirs = scratch.get((khi - klo) * flat.itemsize, flat.dtype)
        _swap(comm, real(v ^ bit), flat[olo:ohi], theirs)
        mine = flat[klo:khi]
        a, b = (theirs, mine) if upper else (mine, theirs)
        parts = partials(a, b, klo, blocks)
        for j in range(k):  # over the 2^k vranks: each block's partials are one rank's, the others' exact zeros
            q = v ^ (1 << j)
            got = np.empty_like(parts)
            _swap(comm, real(q), parts, got)
            parts = parts + got if v < q else got + parts
        ca, cb = coefficients(tensor_sums(blocks, parts))
        combine(a, b, klo, blocks.bounds, ca, cb, mine)
        segs.append((klo, khi))
    if finish is not None:
        finish(flat[segs[-1][0]:segs[-1][1]])
    for k in range(levels, 0, -1):  # distance halving: the partner holds the other half of level k-1's segment
        klo, khi = segs[k]
        plo, phi = segs[k - 1]
        olo, ohi = (plo, klo) if klo > plo else (khi, phi)
        _swap(comm, real(v ^ (1 << (k - 1))), flat[klo:khi], flat[olo:ohi])
    if r < 2 * rem:
        comm.isend(r + 1, flat).wait()


# -- on one process -------------------------------------------------------------------------------------
def reduce_local(inputs: list[np.ndarray], counts: list[int],
                 finish: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
    """What :func:`allreduce` computes over ``len(inputs)`` ranks (``inputs[r]``: rank r's 1-D buffer), on
    one process and on whole vectors, bit for bit (see the module's "Bits"); the inputs are not written."""
    blocks = Blocks(counts)
    vs = [np.array(x, copy=True).reshape(-1) for x in inputs]
    if len(vs) > 1 and vs[0].size:
        p, rem, _ = _layout(len(vs))
        for i in range(rem):
            pair(vs[i], vs[i + 1], blocks, vs[i])  # the fold: c(x[2i], x[2i+1]) in place of both
            del vs[i + 1]
        while len(vs) > 1:
            for i in range(len(vs) // 2):
                pair(vs[i], vs[i + 1], blocks, vs[i])
                del vs[i + 1]
    if finish is not None:
        finish(vs[0])
    return vs[0]
