"""What the bindings share for ``op=Adasum`` (framework-free).

A binding that packs a step's small gradients into one flat buffer per dtype (:mod:`hora.kit.packing`)
would make Adasum see one tensor where there are many, and so compute one pair of coefficients for all of
them; Horovod's (and hora's) Adasum has per-tensor coefficients. So under Adasum every gradient travels as
its own member (the core still fuses them, keeping each one's coefficients): :func:`pack_limit`.
"""

from __future__ import annotations

from hora.collectives.reduce import Adasum
from hora.kit.packing import PACK_LIMIT

__all__ = ["pack_limit"]


def pack_limit(op: int) -> int:
    """The ``limit`` to build a :class:`hora.kit.packing.Packing` with for ``op``: 0 (pack nothing) for
    Adasum, the default otherwise."""
    return 0 if op == Adasum else PACK_LIMIT
