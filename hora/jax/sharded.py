"""``DistributedOptimizer(tx, zero_stage=1)``: an optax transformation whose wrapped state covers this rank's
slice of the parameters only (ZeRO stage 1; :mod:`hora.kit.sharding` has the layout).

``init(params)`` lays the parameters end to end and gives the wrapped transformation this rank's slice (a
1-D array). ``update`` packs the gradients the same way, reduce-scatters them in one ordered host call (each
rank gets its slice, averaged), runs the wrapped transformation on the slice and all-gathers the slices'
updates in a second host call, so every rank returns the whole pytree of updates. Works eagerly and inside
``jax.jit``. Stage 2 is accepted and behaves as stage 1: XLA owns the gradient buffers of a jitted step, and
the full gradients are an input of ``update`` that it cannot free.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit import sharding
from hora.kit.frontend import predivide
from hora.jax import bridge
from hora.jax.compression import Compression

if TYPE_CHECKING:
    import optax

_ids = itertools.count()  # every rank creates its optimizers in the same order: the same collective names


class ShardedState(NamedTuple):
    """The state of a sharded ``DistributedOptimizer``: the wrapped transformation's, over this rank's slice."""

    inner: Any


def _wire(compression) -> str | None:
    return sharding.compression_wire(compression, Compression)


def make(optimizer, op, compression, backward_passes_per_step, gradient_predivide_factor, process_set,
         zero_stage) -> optax.GradientTransformationExtraArgs:
    import optax

    sharding.check_shardable(op, "DistributedOptimizer")
    if backward_passes_per_step != 1:
        raise HoraValueError("DistributedOptimizer(zero_stage=...): backward_passes_per_step > 1 is not supported "
                             "yet in hora.jax; accumulate with optax.MultiSteps(DistributedOptimizer(tx, "
                             f"zero_stage={zero_stage}), every_k_schedule={backward_passes_per_step})")
    inner = optax.with_extra_args_support(optimizer)
    wire = _wire(compression)
    pre, post = predivide(op, gradient_predivide_factor)
    name = f"jax.zero.{next(_ids)}"

    def layout(tree):
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        dtypes = {np.dtype(x.dtype) for x in leaves}
        if len(dtypes) > 1:
            raise HoraValueError(f"DistributedOptimizer(zero_stage=...): the parameters must share one dtype, got "
                                 f"{sorted(str(d) for d in dtypes)}. Not supported yet: keep the sharded optimizer "
                                 "to one dtype")
        plan = sharding.make_plan([int(np.prod(x.shape)) for x in leaves], process_set.size())
        return leaves, treedef, plan, plan.range(process_set.rank())

    def flat(leaves):
        return jnp.concatenate([jnp.ravel(x) for x in leaves])

    def init(params):
        leaves, _, _, (lo, hi) = layout(params)
        return ShardedState(inner.init(flat(leaves)[lo:hi]))

    def update(grads, state, params=None, **extra):
        leaves, treedef, plan, (lo, hi) = layout(grads)
        g = flat(leaves)
        if process_set.size() > 1:
            def reduce(x):
                return [sharding.reduce_scatter_async(x, plan.counts(0, plan.total), f"{name}.rs", op, pre, post,
                                                      wire, process_set).wait()]
            (mine,) = bridge.host_call(reduce, [g], [jax.ShapeDtypeStruct((hi - lo,), g.dtype)], "sharded update")
        else:
            mine = g
        p = None if params is None else flat(jax.tree_util.tree_leaves(params))[lo:hi]
        upd, new_inner = inner.update(mine, state.inner, p, **extra)
        if process_set.size() > 1:
            def gather(x):
                return [_core.synchronize(sharding.allgather_async(x, f"{name}.ag", process_set))]
            (full,) = bridge.host_call(gather, [upd], [jax.ShapeDtypeStruct((plan.total,), upd.dtype)],
                                       "sharded update")
        else:
            full = upd
        offsets = plan.offsets
        out = [full[offsets[i]:offsets[i + 1]].reshape(x.shape) for i, x in enumerate(leaves)]
        return jax.tree_util.tree_unflatten(treedef, out), ShardedState(new_inner)

    return optax.GradientTransformationExtraArgs(init, update)


def _slice(params, process_set):
    leaves = jax.tree_util.tree_leaves(params)
    plan = sharding.make_plan([int(np.prod(x.shape)) for x in leaves], process_set.size())
    return plan, plan.range(process_set.rank())


def consolidate(state: ShardedState, params, process_set=None):
    """The whole state, as the unsharded transformation keeps it (each slice-shaped array of the wrapped
    state gathered and shaped like ``params``), on every rank: what to save as a checkpoint that plain optax
    loads and that :func:`shard` slices at any number of ranks. Collective."""
    from hora.core.process_sets import global_process_set

    ps = process_set or global_process_set
    plan, (lo, hi) = _slice(params, ps)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    offsets = plan.offsets

    def whole(x):
        if getattr(x, "shape", None) != (hi - lo,):
            return x
        full = _core.allgather(np.ascontiguousarray(np.asarray(x)), name="jax.zero.consolidate", process_set=ps)
        return jax.tree_util.tree_unflatten(treedef, [jnp.asarray(full[offsets[i]:offsets[i + 1]]).reshape(p.shape)
                                                      for i, p in enumerate(leaves)])
    return jax.tree_util.tree_map(whole, state.inner)


def shard(full, params, template: ShardedState, process_set=None) -> ShardedState:
    """This rank's :class:`ShardedState` of a whole state (:func:`consolidate`'s, or the unsharded
    transformation's) at the current number of ranks; ``template``: ``tx.init(params)`` of the sharded
    transformation (it says which arrays are slice-shaped)."""
    from hora.core.process_sets import global_process_set

    ps = process_set or global_process_set
    _, (lo, hi) = _slice(params, ps)

    def mine(t, f):
        if getattr(t, "shape", None) != (hi - lo,):
            return f
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(f)])[lo:hi]
    return ShardedState(jax.tree_util.tree_map(mine, template.inner, full))
