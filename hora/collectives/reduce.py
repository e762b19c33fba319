"""Reduction operators and scaling with Horovod's numerics.

- integers are scaled in float64 and truncated back (so Average of integers truncates toward 0);
- float16 and bfloat16 add pairwise in float32 and round once per add (NumPy's and ml_dtypes' own
  ``add`` do exactly this), and are scaled in float32;
- every other float is reduced and scaled in its own precision.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from hora.base.errors import HoraValueError

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}

# dtypes by name: bfloat16 comes from ml_dtypes, which only needs importing once a user has one
REDUCIBLE = ("uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "bfloat16")
MOVABLE = REDUCIBLE + ("bool",)
_HALF = ("float16", "bfloat16")

_UFUNC = {Average: np.add, Sum: np.add, Min: np.minimum, Max: np.maximum, Product: np.multiply}

Reducer = Callable[[np.ndarray, np.ndarray], None]


def reducer(op: int) -> Reducer:
    """``f(dst, src)``: ``dst = dst (op) src`` in place."""
    ufunc = _UFUNC[op]

    def reduce(dst: np.ndarray, src: np.ndarray) -> None:
        ufunc(dst, src, out=dst)

    return reduce


def fill_identity(buf: np.ndarray, op: int) -> None:
    """Fill ``buf`` with ``op``'s neutral element: what a rank that has joined (``hora.join()``)
    contributes, so that the result is the reduction over the ranks that did not join. Zero for
    Sum and Average (Horovod's joined ranks send zeros, and Average still divides by the full size);
    the largest value for Min, the smallest for Max and one for Product, where Horovod's zeros would
    give a meaningless result (the Max of -2 and -3 would be 0). The caller must not prescale it."""
    if op == Min or op == Max:
        kind = buf.dtype.kind
        if kind in "iu":
            info = np.iinfo(buf.dtype)
            buf.fill(info.max if op == Min else info.min)
        else:
            buf.fill(np.inf if op == Min else -np.inf)
    else:
        buf.fill(1 if op == Product else 0)


def scale(buf: np.ndarray, factor: float) -> None:
    """Multiply ``buf`` by ``factor`` in place, with Horovod's precision rules."""
    if factor == 1.0 or buf.size == 0:
        return
    if buf.dtype.kind in "iu":
        buf[...] = buf.astype(np.float64) * factor  # assignment truncates toward zero
    elif dtype_name(buf.dtype) in _HALF:
        buf[...] = buf.astype(np.float32) * np.float32(factor)
    else:
        np.multiply(buf, buf.dtype.type(factor), out=buf)


_NAMES: dict[np.dtype, str] = {}  # numpy computes dtype.name in Python each time; it is asked per collective


def dtype_name(dtype: np.dtype) -> str:
    """``dtype.name``, cached."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = np.dtype(dtype).name
    return name


def check_dtype(dtype: np.dtype, op_kind: str) -> str:
    """The dtype's name; raises a ValueError naming the dtype when ``op_kind`` cannot move or reduce it."""
    name = dtype_name(dtype)
    allowed = REDUCIBLE if op_kind in ("allreduce", "reducescatter") else MOVABLE
    if name not in allowed:
        names = ", ".join(allowed)
        raise HoraValueError(f"{op_kind}: dtype {np.dtype(dtype)} is not supported; use one of {names}")
    return name
