"""JAX arrays to hora's NumPy core and back: one ordered host callback per collective (or pytree).

``jax.experimental.io_callback(..., ordered=True)`` is kept under ``jax.jit`` and runs in program order
(the same order on every rank); outside ``jit`` it simply runs. A whole gradient pytree goes out in one
callback per step (each costs ~0.2 ms).
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import io_callback

import hora.core.ops as _core
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["host_call", "grouped_allreduce"]


def host_call(fn, inputs: list, result_shapes: list) -> list:
    """``fn(*arrays) -> list of arrays`` on the host; ``result_shapes``: ``jax.ShapeDtypeStruct`` per output."""
    def run(*arrays):
        return [np.asarray(r) for r in fn(*[np.asarray(a) for a in arrays])]
    return list(io_callback(run, list(result_shapes), *inputs, ordered=True))


def grouped_allreduce(arrays: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Allreduce ``arrays`` (jax arrays or tracers) as one group in one host callback."""
    arrays = [jax.numpy.asarray(a) for a in arrays]
    if not arrays:
        return []

    def run(*xs):
        return _core.grouped_allreduce(list(xs), op, prescale_factor, postscale_factor, name, process_set)
    return host_call(run, arrays, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays])
