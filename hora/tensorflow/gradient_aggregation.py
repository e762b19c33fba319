"""``LocalGradientAggregationHelper``: Horovod's local gradient accumulation for ``backward_passes_per_step``.

The helper adds each pass's gradients into local (non-trainable) variables and counts the passes; on the
``backward_passes_per_step``-th it reduces the sums over the ranks (``allreduce_func(grads, vars)``, local
variables excepted) and clears them. ``apply_gradients`` applies only on that pass (the counter is back at
0) and otherwise just advances the optimizer's ``iterations``. The counter moves in step on every rank, so
every rank takes the same branch of each ``tf.cond``. One class serves eager code and ``tf.function``
(Horovod has a graph helper and ``LocalGradientAggregationHelperEager``; both names are here, with their
signatures). The accumulators are created on the first pass, lifted out of any function being traced.
"""

from __future__ import annotations

import tensorflow as tf

from hora.base.errors import HoraValueError
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["LocalGradientAggregationHelper", "LocalGradientAggregationHelperEager"]


class LocalGradientAggregationHelper:
    """Accumulate gradients locally and reduce them once every ``backward_passes_per_step`` passes.

    ``allreduce_func(grads, vars) -> grads`` reduces a list of gradients; ``average_aggregated_gradients``
    divides the reduced sums by the number of passes (Horovod's default sums them). ``rank`` and
    ``optimizer_type``: accepted, no effect (Horovod's graph helper names its variables after them)."""

    _OPTIMIZER_TYPE_KERAS = "optimizer_type_keras"
    _OPTIMIZER_TYPE_LEGACY = "optimizer_type_legacy"

    def __init__(self, backward_passes_per_step: int, allreduce_func, sparse_as_dense: bool,
                 average_aggregated_gradients: bool, rank: int | None = None, optimizer_type: str | None = None,
                 process_set: ProcessSet = global_process_set, scale_local_gradients: bool = True, name: str = ""):
        if backward_passes_per_step <= 0:
            raise ValueError("backward_passes_per_step must be > 0")
        self.backward_passes_per_step = backward_passes_per_step
        self._allreduce_grads = allreduce_func
        self.sparse_as_dense = sparse_as_dense
        self.average_aggregated_gradients = average_aggregated_gradients
        self.rank, self.optimizer_type, self.name = rank, optimizer_type, name
        self.process_set, self.scale_local_gradients = process_set, scale_local_gradients
        self.counter = None
        self.locally_aggregated_grads: list = []
        self._local: set[int] = set()  # id(variable): Keras variables are unhashable

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: accumulated but not reduced (divided by the set's size
        when ``scale_local_gradients``)."""
        self._local.add(id(var))

    def _dense(self, grad):
        if isinstance(grad, tf.IndexedSlices):
            if not self.sparse_as_dense:
                raise HoraValueError("IndexedSlices are not supported when backward_passes_per_step > 1 and "
                                     "sparse_as_dense is False; pass sparse_as_dense=True")
            return tf.convert_to_tensor(grad)
        return grad

    def _create(self, grads: list) -> None:
        with tf.init_scope():  # once, outside any tf.function being traced
            self.counter = tf.Variable(0, dtype=tf.int32, trainable=False, name="hora_aggregation_counter")
            self.locally_aggregated_grads = [
                tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False, name=f"hora_aggregation_{k}")
                for k, g in enumerate(grads)]

    def compute_gradients(self, grads, vars) -> list:
        """Add this pass's ``grads`` (of ``vars``) to the sums; on the last pass of a step return the
        reduced sums and clear them, else the sums so far (which the optimizer does not apply)."""
        grads, vars = list(grads), list(vars)
        present = [i for i, g in enumerate(grads) if g is not None]
        dense = [tf.convert_to_tensor(self._dense(grads[i])) for i in present]
        if self.counter is None:
            self._create(dense)
        if len(dense) != len(self.locally_aggregated_grads):
            raise HoraValueError(f"backward_passes_per_step: {len(dense)} gradients in this pass, "
                                 f"{len(self.locally_aggregated_grads)} in the first; the variables that get "
                                 "gradients must not change between passes")
        added = [s.assign_add(g) for s, g in zip(self.locally_aggregated_grads, dense)]
        with tf.control_dependencies(added):
            count = self.counter.assign_add(1)
        used = [vars[i] for i in present]

        def last():
            sums = [s.read_value() for s in self.locally_aggregated_grads]
            out = self._reduce(sums, used)
            with tf.control_dependencies(out):
                cleared = [self.counter.assign(0)] + [s.assign(tf.zeros_like(s))
                                                      for s in self.locally_aggregated_grads]
            with tf.control_dependencies(cleared):
                return [tf.identity(o) for o in out]

        def keep():
            return [s.read_value() for s in self.locally_aggregated_grads]
        with tf.control_dependencies([count]):
            summed = tf.cond(tf.equal(count, self.backward_passes_per_step), last, keep) if dense else []
        summed = list(summed) if isinstance(summed, (list, tuple)) else [summed]
        out: list = [None] * len(grads)
        for i, s in zip(present, summed):
            out[i] = s
        return out

    def _reduce(self, grads: list, vars: list) -> list:
        shared = [i for i, v in enumerate(vars) if id(v) not in self._local]
        out = list(grads)
        if shared:
            for i, r in zip(shared, self._allreduce_grads([grads[i] for i in shared], [vars[i] for i in shared])):
                out[i] = r
        size = self.process_set.size()
        for i, v in enumerate(vars):
            if id(v) in self._local and self.scale_local_gradients and size > 1:
                out[i] = out[i] / tf.cast(size, out[i].dtype)
        if self.average_aggregated_gradients:
            out = [g / tf.cast(self.backward_passes_per_step, g.dtype) for g in out]
        return out

    def apply_gradients(self, apply_grads_closure, optimizer, *args, **kwargs):
        """Run ``apply_grads_closure()`` on the pass that reduced (the counter is back at 0); on the others
        advance ``optimizer.iterations`` only. Returns a boolean tensor: whether it applied."""
        if self.counter is None:  # no gradients at all went through compute_gradients
            return apply_grads_closure()
        pairs = list(args[0]) if args else list(kwargs.get("grads_and_vars", ()))
        _build(optimizer, [v for g, v in pairs if g is not None])
        grads = [g for g, _ in pairs if g is not None]

        def applied():
            done = [x for x in tf.nest.flatten(apply_grads_closure()) if x is not None]
            with tf.control_dependencies(done):
                return tf.constant(True)

        def skipped():
            iterations = getattr(optimizer, "iterations", None)
            done = [iterations.assign_add(1)] if iterations is not None else []
            with tf.control_dependencies(done):
                return tf.constant(False)
        with tf.control_dependencies(grads):
            due = tf.equal(self.counter.read_value(), 0)
        return tf.cond(due, applied, skipped)


def _build(optimizer, variables: list) -> None:
    """Create the optimizer's slots now, outside the ``tf.cond`` branch that applies (a variable created
    inside a branch of a traced function is refused): the Keras 2 optimizers' own ways to build."""
    with tf.init_scope():
        if hasattr(optimizer, "_create_all_weights"):  # tf_keras.optimizers.legacy
            optimizer._create_all_weights(variables)
        elif hasattr(optimizer, "build"):  # tf_keras.optimizers: a no-op once built
            optimizer.build(variables)


class LocalGradientAggregationHelperEager(LocalGradientAggregationHelper):
    """Horovod's eager helper's name and signature; the same helper."""

    def __init__(self, backward_passes_per_step: int, allreduce_func, sparse_as_dense: bool,
                 average_aggregated_gradients: bool, process_set: ProcessSet = global_process_set,
                 scale_local_gradients: bool = True):
        super().__init__(backward_passes_per_step, allreduce_func, sparse_as_dense, average_aggregated_gradients,
                         process_set=process_set, scale_local_gradients=scale_local_gradients)
