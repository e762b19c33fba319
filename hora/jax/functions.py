"""Putting every rank on the same parameters and objects: ``broadcast_parameters`` and the object
collectives, for jax pytrees."""

from __future__ import annotations

import hora.core.ops as _core
from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax import mpi_ops
from hora.jax.bridge import settle

__all__ = ["broadcast_parameters", "broadcast_object", "allgather_object"]


def broadcast_parameters(params, root_rank: int = 0, process_set: ProcessSet = global_process_set):
    """Return ``params`` (a pytree of arrays: Flax variables, an optax state, ...) as rank ``root_rank`` has
    them, on every rank. JAX arrays are immutable, so unlike hora.torch's this returns the result rather
    than writing into its argument: ``params = hvd.broadcast_parameters(params)``. One host call."""
    return mpi_ops.broadcast(params, root_rank, "broadcast_parameters", process_set)


def broadcast_object(obj, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set):
    """Return rank ``root_rank``'s ``obj`` (anything cloudpickle serialises) on every rank (outside jit)."""
    settle()
    return _core.broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order (outside jit)."""
    settle()
    return _core.allgather_object(obj, name, process_set)
