"""Elastic training for JAX (hora only: Horovod has no JAX binding): :func:`run` and :class:`JaxState`.

    state = hvd.elastic.JaxState(params=params, opt_state=opt_state, epoch=0)

    @hvd.elastic.run
    def train(state):
        ...
        state.params, state.opt_state = step(state.params, state.opt_state, batch)
        state.commit()

JAX code is functional: the training loop rebinds ``state.params`` rather than mutating it, so the state is
an ``ObjectState`` whose values may be pytrees of ``jax.Array``. A commit copies them (a device copy: safe
with donated buffers); a sync sends every array leaf of rank 0's commit in one broadcast (no pickling of the
arrays) and the rest as an object. A peer lost inside a jitted step reaches Python as JAX's runtime error
carrying hora's in its text; :func:`run` recognises it, as the TensorFlow binding's does.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

import hora.core.basics as _basics
from hora.kit import frontend as _frontend
from hora.kit.compressors import compressor_handler
from hora.elastic.handlers import HandledState, raising_internal
from hora.elastic import ObjectState, reset, run_fn
from hora.jax.functions import broadcast_object, broadcast_parameters

__all__ = ["run", "JaxState"]


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: roll back on a lost peer (also one raised inside ``jax.jit``), keep the
    state on a change of hosts, re-form the job, sync from rank 0 and call ``func`` again."""
    return run_fn(raising_internal(func), functools.partial(reset, _frontend.shutdown))


class JaxState(HandledState, ObjectState):
    """``JaxState(params=..., opt_state=..., epoch=0)``: every keyword is an attribute, committed (copied),
    restored and synced from rank 0 together; pytrees of arrays travel as arrays. A ``Compression.topk/
    powersgd`` compressor (``compression=comp``) is kept in place: its state is saved and loaded back."""

    def __init__(self, **kwargs: Any):
        rest = self._take_handlers(kwargs, compressor_handler)
        super().__init__(bcast_object=broadcast_object, get_rank=_basics.rank, **rest)

    def sync(self) -> None:
        for handler in self._handlers.values():  # HandledState.sync's part: this sync replaces the chain
            handler.sync()
            handler.save()
        if not self._saved_state:
            return
        leaves, treedef = jax.tree.flatten(self._saved_state)
        is_array = [isinstance(leaf, jax.Array) for leaf in leaves]
        plain = [None if a else leaf for leaf, a in zip(leaves, is_array)]
        specs = [(leaf.shape, leaf.dtype) for leaf, a in zip(leaves, is_array) if a]
        treedef, plain, is_array, specs = broadcast_object((treedef, plain, is_array, specs))
        mine = [leaf for leaf in leaves if isinstance(leaf, jax.Array)]
        if _basics.rank() != 0 or len(mine) != len(specs):  # a newcomer's own arrays may not even match
            mine = [jnp.zeros(shape, dtype) for shape, dtype in specs]
        received = iter(broadcast_parameters(mine) if specs else [])
        self._saved_state = jax.tree.unflatten(treedef, [next(received) if a else leaf
                                                         for leaf, a in zip(plain, is_array)])
        self._set_attrs()
