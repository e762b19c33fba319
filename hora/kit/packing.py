"""How a list of arrays crosses into one host call: the small ones packed into one flat buffer per dtype.

A host call's cost grows with its number of inputs and outputs (a ``tf.numpy_function``: ~1 ms for 50
against ~55 µs for one; a JAX ``io_callback``: 50 small arrays ~4x one of their total size), and so does the
core's for a grouped allreduce's members (at np=2, 50 small tensors ~1.9 ms, the same bytes as one ~0.5 ms).
So every binding that hands a step's gradients to the host packs them with :class:`Packing`: which arrays
share a buffer, where each one sits in it, and the NumPy split (views, no copy) and join on the host side.
A binding only does its framework's ravel/concatenate on the way in and split/reshape on the way out.

The plan depends only on the shapes and dtypes, so it is the same on every rank whose tensors are. A packed
buffer hides its arrays' shapes from the core, which would otherwise refuse tensors that differ between
ranks: two ranks whose models differ but whose gradients add up to as many elements per dtype would reduce
unrelated numbers together, a wrong answer. So a plan has a :attr:`Packing.layout`, a digest of its shapes,
dtypes and buckets, which the binding hands the core with the buffers (``grouped_allreduce(..., layout=)``):
the coordinator compares it across ranks every step, as it compares shapes, and a difference is a
MismatchError on every rank; in the steady state it costs nothing (the response cache holds it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable, Sequence

import numpy as np

__all__ = ["PACK_LIMIT", "Packing", "slices"]

# Below this many bytes an array travels packed with the others of its dtype; at or above it the copy into the
# buffer would cost more than one more member does, so it travels alone, as it is.
PACK_LIMIT = 1 << 20


class Packing:
    """The buckets of a list of arrays: each array of ``PACK_LIMIT`` bytes or more, or of a size not known
    yet (a ``None`` dimension), alone and unchanged; the smaller ones raveled into one flat buffer per dtype,
    in the bucket where that dtype first appears.

    ``shapes``: each array's shape (``None`` for an unknown dimension); ``dtypes``: anything hashable that
    tells dtypes apart (NumPy dtypes, framework dtypes, names); ``itemsizes``: bytes per element of each."""

    def __init__(self, shapes: Sequence[Sequence[int | None]], dtypes: Sequence[Hashable],
                 itemsizes: Sequence[int], limit: int = PACK_LIMIT) -> None:
        self.shapes = [tuple(s) for s in shapes]
        self.dtypes = [str(d) for d in dtypes]
        self.sizes = [math.prod(s) if all(isinstance(d, int) for d in s) else None for s in self.shapes]
        self.buckets: list[list[int]] = []  # per buffer: the indices of its arrays, in order
        first: dict = {}
        for i, (dtype, n, itemsize) in enumerate(zip(dtypes, self.sizes, itemsizes)):
            if n is None or n * itemsize >= limit:
                self.buckets.append([i])
            elif dtype in first:
                self.buckets[first[dtype]].append(i)
            else:
                first[dtype] = len(self.buckets)
                self.buckets.append([i])
        digest = hashlib.blake2b(repr((self.dtypes, self.shapes, self.buckets)).encode(), digest_size=8).digest()
        self.layout = int.from_bytes(digest, "big") >> 1 or 1  # non-zero (0: not packed), fits an int64

    @staticmethod
    def packed(bucket: Sequence[int]) -> bool:
        """True when ``bucket`` travels as a flat buffer (more than one array), False when its one array
        travels as it is."""
        return len(bucket) > 1

    def buffer_shapes(self) -> list[tuple]:
        """Each buffer's shape: ``(total elements,)`` for a packed bucket, the array's own shape otherwise."""
        return [(sum(self.sizes[i] for i in b),) if self.packed(b) else self.shapes[b[0]] for b in self.buckets]

    def cuts(self, bucket: Sequence[int]) -> list[int]:
        """The element counts of ``bucket``'s arrays, in order (where a framework's ``split`` cuts)."""
        return [self.sizes[i] for i in bucket]

    def pack(self, arrays: Sequence, ravel: Callable, concat: Callable) -> list:
        """The buffers: ``concat([ravel(a), ...])`` per packed bucket, the array itself otherwise."""
        return [concat([ravel(arrays[i]) for i in b]) if self.packed(b) else arrays[b[0]] for b in self.buckets]

    def unpack(self, buffers: Sequence, split: Callable, reshape: Callable) -> list:
        """The inverse of :meth:`pack`: ``split(buffer, cuts)`` gives a packed buffer's flat pieces, each
        ``reshape(piece, shape)``d back; an unpacked buffer is the array itself."""
        out: list = [None] * len(self.shapes)
        for b, buffer in zip(self.buckets, buffers):
            if not self.packed(b):
                out[b[0]] = buffer
                continue
            for i, piece in zip(b, split(buffer, self.cuts(b))):
                out[i] = reshape(piece, self.shapes[i])
        return out

    # -- the host side, on NumPy -------------------------------------------------------------------------
    def pack_np(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """:meth:`pack` on NumPy arrays (each packed bucket one copy)."""
        return self.pack([np.asarray(a) for a in arrays], np.ravel, np.concatenate)

    def unpack_np(self, buffers: Sequence[np.ndarray]) -> list[np.ndarray]:
        """:meth:`unpack` on NumPy buffers: the arrays are views of the buffers (no copy)."""
        return self.unpack([np.asarray(b) for b in buffers], slices, np.reshape)


def slices(buffer, cuts: Sequence[int]) -> list:
    """``buffer`` cut into consecutive pieces of ``cuts`` elements by slicing (views on NumPy; works on any
    array type that slices, e.g. ``jax.numpy``)."""
    out, at = [], 0
    for n in cuts:
        out.append(buffer[at:at + n])
        at += n
    return out
