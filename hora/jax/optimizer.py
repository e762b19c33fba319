"""``DistributedOptimizer``: an optax transformation that averages gradients over ranks before the wrapped one.

``update`` sends the whole gradient pytree in one grouped allreduce (one ordered host call, see
:mod:`hora.jax.bridge`) of one flat buffer per dtype, so it runs eagerly or inside a jitted train step;
the wrapped transformation then sees the same gradients on every rank and every rank's parameters stay
equal.

With ``backward_passes_per_step=k`` the gradients are accumulated locally and only every k-th call
communicates and applies the wrapped transformation (inside ``jax.lax.cond``, so the other calls make no host
call at all); those calls return zero updates. The k passes are summed, as in hora.torch (where they
accumulate in ``.grad``) and Horovod's other bindings; ``average_aggregated_gradients=True`` takes their mean
instead (Horovod's TensorFlow name for it; what ``optax.MultiSteps`` does).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from hora.base import knobs
from hora.kit.compressors import check_compression_op, is_stateful
from hora.kit.frontend import check_optimizer_args, predivide
from hora.core.ops import Average
from hora.core.process_sets import ProcessSet, global_process_set
from hora.kit.sharding import check_stage
from hora.jax import bridge
from hora.jax.compression import Compression

if TYPE_CHECKING:
    import optax

__all__ = ["DistributedOptimizer", "AccumulationState"]

_ids = itertools.count()  # every rank creates its optimizers in the same order: the same group names


class AccumulationState(NamedTuple):
    """The state of a ``DistributedOptimizer`` with ``backward_passes_per_step > 1``."""

    mini_step: jax.Array  # calls since the last applying one
    acc: Any  # the sum of the gradients of those calls
    inner: Any  # the wrapped transformation's state


def DistributedOptimizer(optimizer, op: int = Average, compression=Compression.none,  # noqa: N802 - Horovod's name
                         backward_passes_per_step: int = 1, gradient_predivide_factor: float = 1.0,
                         process_set: ProcessSet = global_process_set,
                         average_aggregated_gradients: bool = False,
                         zero_stage: int = 0) -> optax.GradientTransformationExtraArgs:
    """Wrap the optax transformation ``optimizer`` so that its ``update`` gets the gradients reduced over the
    ranks of ``process_set`` (``op``: Average or Sum; ``compression``: how they travel;
    ``gradient_predivide_factor``: divide before the sum and by size/factor after it). ``zero_stage=1``: the
    wrapped state covers this rank's slice of the parameters only (:mod:`hora.jax.sharded`,
    docs/sharded_optimizer.md).

    >>> tx = hvd.DistributedOptimizer(optax.adam(1e-3))
    >>> updates, opt_state = tx.update(grads, opt_state, params)   # inside a jitted step
    """
    import optax  # only this needs it: hora.jax's collectives work without optax installed

    check_optimizer_args("DistributedOptimizer", op, gradient_predivide_factor, backward_passes_per_step)
    check_compression_op(compression, op, "DistributedOptimizer")
    stage = check_stage(zero_stage, "DistributedOptimizer")
    if stage:
        from hora.jax import sharded

        return sharded.make(optimizer, op, compression, backward_passes_per_step, gradient_predivide_factor,
                            process_set, stage)
    inner = optax.with_extra_args_support(optimizer)
    pre, post = predivide(op, gradient_predivide_factor)
    name = f"jax.DistributedOptimizer.{next(_ids)}"

    def reduce(grads):
        # as in hora.torch: a world of one does not communicate, unless elastic training may grow it
        if not process_set.included() or (process_set.size() == 1 and not knobs.value("elastic")):
            return grads
        leaves, treedef = jax.tree_util.tree_flatten(grads)
        if is_stateful(compression):  # Compression.topk/powersgd: the whole pytree in one host call
            paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
            out = bridge.host_call(lambda *a: compression.reduce(paths, list(a), op, pre, post, process_set, name),
                                   leaves, [jax.ShapeDtypeStruct(g.shape, g.dtype) for g in leaves], name)
            return jax.tree_util.tree_unflatten(treedef, out)
        pairs = [compression.compress(g) for g in leaves]
        wire = [c for c, _ in pairs]
        # one flat buffer per dtype (arrays of 1 MiB or more alone), see bridge.packed_allreduce
        out = bridge.packed_allreduce(wire, op, pre, post, name, process_set)
        return jax.tree_util.tree_unflatten(treedef, [compression.decompress(o, ctx)
                                                      for o, (_, ctx) in zip(out, pairs)])

    def apply(grads, state, params, extra):
        return inner.update(reduce(grads), state, params, **extra)

    if backward_passes_per_step == 1:
        return optax.GradientTransformationExtraArgs(
            inner.init, lambda updates, state, params=None, **extra: apply(updates, state, params, extra))
    k = backward_passes_per_step

    def init(params):
        return AccumulationState(jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, params),
                                 inner.init(params))

    def update(updates, state, params=None, **extra):
        acc = jax.tree_util.tree_map(lambda a, g: a + g.astype(a.dtype), state.acc, updates)

        def applying(acc, inner_state):
            scale = k if average_aggregated_gradients else 1
            total = jax.tree_util.tree_map(lambda a, g: (a / scale).astype(g.dtype), acc, updates)
            out, new_inner = apply(total, inner_state, params, extra)
            return out, AccumulationState(jnp.zeros((), jnp.int32), jax.tree_util.tree_map(jnp.zeros_like, acc),
                                          new_inner)

        def accumulating(acc, inner_state):
            shapes = jax.eval_shape(lambda a, s: apply(a, s, params, extra)[0], acc, inner_state)
            zeros = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            return zeros, AccumulationState(state.mini_step + 1, acc, inner_state)

        return jax.lax.cond(state.mini_step == k - 1, applying, accumulating, acc, state.inner)

    return optax.GradientTransformationExtraArgs(init, update)
