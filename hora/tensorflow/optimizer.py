"""``DistributedOptimizer`` for TensorFlow: a ``tf.compat.v1.train.Optimizer`` wrapper whose
``compute_gradients`` returns the gradients reduced over the ranks (one host call for the dense ones),
or, for a Keras optimizer, ``hora.keras.DistributedOptimizer``.

``backward_passes_per_step`` > 1 accumulates gradients locally as Horovod does: one non-trainable local
variable per gradient and a counter; the reduction and the update run (in a ``tf.cond``, the same branch
on every rank since the counters move in step) only on every ``backward_passes_per_step``-th call, and
the update is skipped on the others (the global step still advances, as in Horovod).
"""

from __future__ import annotations

import tensorflow as tf

from hora.base.errors import HoraValueError
from hora.kit.frontend import check_optimizer_args
from hora.core.ops import Average
from hora.core.process_sets import ProcessSet, global_process_set
from hora.kit.sharding import check_stage
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradient_tape import GradientReducer

__all__ = ["DistributedOptimizer"]


class _Accumulator:
    """Local accumulation over ``passes`` calls of ``compute_gradients`` (see the module docstring)."""

    def __init__(self, passes: int, average: bool):
        self.passes, self.average = passes, average
        self.sums: list | None = None
        self.counter = None

    def _local(self, initial, name: str):
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])

    def compute(self, grads: list, reduce) -> list:
        """Add ``grads`` to the sums; on the last pass return the reduced sums (else the sums, unused)."""
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(grads[i]) for i in present]
        if self.sums is None:
            with tf.init_scope():  # created once, outside any tf.function being traced
                self.counter = self._local(0, "hora_aggregation_counter")
                self.sums = [self._local(tf.zeros(g.shape, g.dtype), f"hora_aggregation_{k}")
                             for k, g in enumerate(dense)]
        if len(dense) != len(self.sums):
            raise HoraValueError(f"backward_passes_per_step: {len(dense)} gradients this pass, {len(self.sums)} "
                                 "on the first; the set of variables with gradients must not change")
        clear = tf.cond(tf.equal(self.counter, 0), lambda: tf.group(*[s.assign(tf.zeros_like(s)) for s in self.sums]),
                        tf.no_op)
        with tf.control_dependencies([clear]):
            added = tf.group(*[s.assign_add(g) for s, g in zip(self.sums, dense)])
        with tf.control_dependencies([added]):
            count = self.counter.assign_add(1)

        def last():
            values = [s.read_value() for s in self.sums]
            if self.average:
                values = [v / tf.cast(self.passes, v.dtype) for v in values]
            out = reduce(values)
            with tf.control_dependencies(out):
                reset = self.counter.assign(0)
            with tf.control_dependencies([reset]):
                return [tf.identity(o) for o in out]

        with tf.control_dependencies([count]):
            summed = tf.cond(tf.equal(count, self.passes), last, lambda: [s.read_value() for s in self.sums])
        summed = summed if isinstance(summed, (list, tuple)) else [summed]
        out = list(grads)
        for i, s in zip(present, summed):
            out[i] = s
        return out

    def apply(self, grads_and_vars, apply_fn, global_step):
        """``apply_fn()`` when the counter is back at 0 (a reduction just ran), else only the global step."""
        grads = [g for g, _ in grads_and_vars if g is not None]
        with tf.control_dependencies(grads):
            due = tf.equal(self.counter.read_value(), 0)

        def skip():
            return global_step.assign_add(1).op if global_step is not None else tf.no_op()
        return tf.cond(due, lambda: tf.group(apply_fn()), lambda: tf.group(skip()))


class _DistributedOptimizer(tf.compat.v1.train.Optimizer):
    """Delegates to the wrapped optimizer; ``compute_gradients`` reduces what it returns."""

    def __init__(self, optimizer, name, use_locking, reducer: GradientReducer, backward_passes_per_step: int,
                 average_aggregated_gradients: bool):
        super().__init__(name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking)
        self._optimizer, self._reducer = optimizer, reducer
        self._acc = _Accumulator(backward_passes_per_step, average_aggregated_gradients) \
            if backward_passes_per_step > 1 else None

    def compute_gradients(self, *args, **kwargs):
        """The wrapped optimizer's ``(gradient, variable)`` pairs with the gradients reduced over the ranks."""
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        if not pairs:
            return pairs
        grads, variables = [list(x) for x in zip(*pairs)]
        if self._acc is None:
            grads = self._reducer(grads, variables)
        else:
            present = [v for g, v in zip(grads, variables) if g is not None]

            def reduce(values):
                return self._reducer(values, present)
            grads = self._acc.compute(grads, reduce)
        return list(zip(grads, variables))

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = list(grads_and_vars)
        if self._acc is None:
            return self._optimizer.apply_gradients(grads_and_vars, global_step, name)
        return self._acc.apply(grads_and_vars,
                               lambda: self._optimizer.apply_gradients(grads_and_vars, global_step, name),
                               global_step)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: not reduced, scaled by ``1/size`` when
        ``scale_local_gradients`` (as Horovod's; for model-parallel parts)."""
        self._reducer.register_local(var)

    def get_slot(self, *args, **kwargs):
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args, **kwargs):
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args, **kwargs):
        return self._optimizer.variables(*args, **kwargs)


def _is_keras_optimizer(optimizer) -> bool:
    return any(c.__module__.split(".")[0] in ("keras", "tf_keras") for c in type(optimizer).__mro__)


def DistributedOptimizer(optimizer, name: str | None = None, use_locking: bool = False, device_dense: str = "",
                         device_sparse: str = "", compression=Compression.none, sparse_as_dense: bool = False,
                         backward_passes_per_step: int = 1, op: int = Average, gradient_predivide_factor: float = 1.0,
                         average_aggregated_gradients: bool = False, num_groups: int = 0, groups=None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True,
                         zero_stage: int = 0):
    """Wrap ``optimizer`` so that the gradients it applies are reduced (``op``) over the ranks.

    A ``tf.compat.v1.train.Optimizer`` gets a v1 wrapper (``compute_gradients``, ``apply_gradients``,
    ``minimize``, ``get_slot``, ``get_slot_names``, ``variables``, ``register_local_var``); a Keras optimizer
    is wrapped by ``hora.keras.DistributedOptimizer``. ``use_locking`` goes to the v1 base class.

    ``zero_stage=1`` (a Keras optimizer, custom loops): each rank keeps the optimizer state of its slice of the
    variables only; give it the local gradients of a plain ``tf.GradientTape`` (:mod:`hora.tensorflow.sharded`,
    docs/sharded_optimizer.md).

    >>> opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1 * hvd.size()))
    >>> train_op = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    """
    check_optimizer_args("DistributedOptimizer", op, gradient_predivide_factor, backward_passes_per_step)
    stage = check_stage(zero_stage, "DistributedOptimizer")
    if stage:
        if not _is_keras_optimizer(optimizer) or backward_passes_per_step != 1:
            raise HoraValueError("DistributedOptimizer(zero_stage=...): hora.tensorflow shards a Keras optimizer's "
                                 "state with backward_passes_per_step=1; not supported yet: v1 optimizers, "
                                 "accumulation")
        from hora.tensorflow.sharded import ShardedOptimizer

        return ShardedOptimizer(optimizer, op, compression, gradient_predivide_factor, process_set, stage)
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        reducer = GradientReducer("DistributedOptimizer", compression, sparse_as_dense, op, gradient_predivide_factor,
                                  num_groups, groups, process_set, device_dense, device_sparse, scale_local_gradients)
        return _DistributedOptimizer(optimizer, name, use_locking, reducer, backward_passes_per_step,
                                     average_aggregated_gradients)
    if _is_keras_optimizer(optimizer):
        from hora.keras.optimizer import DistributedOptimizer as keras_distributed  # lazily: Keras loads only here

        return keras_distributed(
            optimizer, name=name, device_dense=device_dense, device_sparse=device_sparse, compression=compression,
            sparse_as_dense=sparse_as_dense, gradient_predivide_factor=gradient_predivide_factor, op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients, num_groups=num_groups, groups=groups,
            process_set=process_set, scale_local_gradients=scale_local_gradients)
    raise HoraValueError(f"DistributedOptimizer: {type(optimizer).__name__} is neither a "
                         "tf.compat.v1.train.Optimizer nor a Keras optimizer")
