"""JAX arrays to hora's NumPy core and back: one host call per collective (or per pytree).

Inside ``jax.jit`` (any traced input) the call is a ``jax.experimental.io_callback(..., ordered=True)``:
XLA keeps it and runs it in program order, so every rank submits its collectives in the same order (what
the core's automatic names need). Each costs ~0.2 ms, so a whole gradient pytree goes out in one callback;
and since a callback's cost also grows with its number of arguments (50 small arrays cost ~4x one array of
their total size), arrays under 1 MiB travel packed, one flat buffer per dtype, unpacked into views on the
host and packed again for the trip back (:class:`hora.kit.packing.Packing`).
Outside ``jit`` the host function runs at once on NumPy views of the arrays, after
``jax.effects_barrier()`` so that an eager collective cannot overtake one still queued by a jitted call
(which would give the ranks different orders).

An ordered callback cannot be batched: under ``jax.vmap`` the call raises a :class:`HoraValueError` that
says so (through ``jax.custom_batching.custom_vmap``) instead of JAX's generic message.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit.adasum import pack_limit
from hora.kit.packing import PACK_LIMIT, Packing, slices
from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax import device as _device

__all__ = ["host_call", "grouped_allreduce", "packed_allreduce", "traced", "settle", "packing", "pack", "unpack"]


def traced(arrays: Sequence) -> bool:
    """True when any of ``arrays`` is a tracer (we are inside ``jit``, ``grad`` of a jitted function, ...)."""
    return any(isinstance(a, jax.core.Tracer) for a in arrays)


def settle() -> None:
    """Wait until every ordered host callback already dispatched has run (an eager collective goes after)."""
    jax.effects_barrier()


def _vmap_refused(what: str):
    def rule(axis_size, in_batched, *args):
        raise HoraValueError(f"{what}: hora's collectives cannot run under jax.vmap: each is one ordered host "
                             "call that every rank must make in the same order, and a batched call has no order. "
                             "Call the collective outside vmap on the stacked array (it reduces each element), "
                             "or vmap only the computation around it")
    return rule


def host_call(fn: Callable, inputs: list, result_shapes: list | None, what: str = "collective",
              device: bool = False) -> list:
    """``fn(*numpy arrays) -> list of arrays`` on the host, returned as jax arrays.

    ``result_shapes``: a ``jax.ShapeDtypeStruct`` per output. Under ``jit`` they are fixed when the function
    is traced, and a result of another shape is refused with a HoraValueError (``what`` names the
    collective); outside ``jit`` they are not needed (``None``: whatever ``fn`` returns).
    ``device``: ``fn`` hands its arrays straight to the core, so outside ``jit`` arrays that are all on CUDA
    devices go as device memory and come back as GPU arrays (:mod:`hora.jax.device`).
    """
    inputs = list(inputs)
    if not traced(inputs):
        settle()
        arrays = _device.device_arrays(inputs, what) if device and _device.on_gpu(inputs) else None
        if arrays is not None:
            return [_device.array(r) for r in fn(*arrays)]
        return [jnp.asarray(r) for r in fn(*[np.asarray(a) for a in inputs])]
    if result_shapes is None:
        raise HoraValueError(f"{what}: the shape of its result is known only when it runs, so it cannot run "
                             "inside jax.jit; call it outside jit")
    shapes = list(result_shapes)
    ins, outs = packing(inputs), packing(shapes)
    out_structs = _structs(outs, shapes)

    def run(*buffers):
        out = [np.asarray(r) for r in fn(*ins.unpack_np(buffers))]
        for r, s in zip(out, shapes):
            if r.shape != tuple(s.shape):
                raise HoraValueError(f"{what}: inside jax.jit the result's shape is fixed when the function is "
                                     f"traced ({tuple(s.shape)}), but the ranks' inputs made {r.shape}; give "
                                     "every rank the same shapes inside jit, or call it outside jit")
        return outs.pack_np(out)

    @jax.custom_batching.custom_vmap
    def call(*xs):
        return io_callback(run, out_structs, *xs, ordered=True)
    call.def_vmap(_vmap_refused(what))
    return unpack(outs, call(*pack(ins, inputs)))


def packing(arrays: Sequence, limit: int = PACK_LIMIT) -> Packing:
    """The packing plan of ``arrays`` (jax arrays, tracers or ``jax.ShapeDtypeStruct``s)."""
    dtypes = [np.dtype(a.dtype) for a in arrays]
    return Packing([a.shape for a in arrays], dtypes, [d.itemsize for d in dtypes], limit)


def pack(plan: Packing, arrays: Sequence) -> list:
    """``arrays`` as ``plan``'s buffers, by ``jax.numpy`` (in the traced program)."""
    return plan.pack(arrays, jnp.ravel, jnp.concatenate)


def unpack(plan: Packing, buffers: Sequence) -> list:
    """The arrays back from ``plan``'s buffers, by ``jax.numpy``."""
    return plan.unpack(buffers, slices, jnp.reshape)


def _structs(plan: Packing, arrays: Sequence) -> list:
    """A ``jax.ShapeDtypeStruct`` per buffer of ``plan`` (a callback's result type)."""
    return [jax.ShapeDtypeStruct(shape, arrays[b[0]].dtype) for shape, b in zip(plan.buffer_shapes(), plan.buckets)]


def grouped_allreduce(arrays: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set, *,
                      layout: int = 0) -> list:
    """Allreduce ``arrays`` (jax arrays or tracers) as one group in one host call; not differentiable
    (``hora.jax.grouped_allreduce`` is). ``layout``: a packing plan's digest
    (:attr:`hora.kit.packing.Packing.layout`), compared across ranks."""
    arrays = [a if isinstance(a, jax.core.Tracer) else jnp.asarray(a) for a in arrays]
    if not arrays:
        return []

    def run(*xs):
        return _core.grouped_allreduce(list(xs), op, prescale_factor, postscale_factor, name, process_set,
                                       layout=layout)
    return host_call(run, arrays, [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays], "grouped_allreduce")


def packed_allreduce(arrays: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """:func:`grouped_allreduce` of the small arrays packed into one flat buffer per dtype (:func:`packing`),
    so the core sees one member per dtype: one tensor costs it ~40 us where 50 small ones cost ~500 us, and
    the sum of a concatenation is the concatenation of the sums."""
    plan = packing(arrays, pack_limit(op))  # Adasum: each array its own member (its own coefficients)
    return unpack(plan, grouped_allreduce(pack(plan, arrays), op, prescale_factor, postscale_factor, name,
                                          process_set, layout=plan.layout))
