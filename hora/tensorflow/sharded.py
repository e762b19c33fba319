"""``hora.tensorflow.DistributedOptimizer(keras_optimizer, zero_stage=1)`` for custom training loops: the
wrapped Keras optimizer's state covers this rank's slice of the variables only (:mod:`hora.kit.sharding`).

It takes the *local* gradients (a plain ``tf.GradientTape``, not ``DistributedGradientTape``: the reduction
is its job). ``apply_gradients(zip(grads, variables))`` packs them into one flat vector, reduce-scatters it in
one host call (this rank gets its slice, averaged), lets the wrapped optimizer update *piece* variables (one
per parameter the slice touches, refreshed from the model's variables first, so weights loaded in between
are seen), then all-gathers the pieces in a second host call and assigns every variable. Eager or inside a
``tf.function`` (the pieces and the wrapped optimizer's slots are created at the first call, lifted out of
the function by ``tf.init_scope``). Not a Keras optimizer itself: ``model.fit`` needs
``hora.keras.DistributedOptimizer(opt, zero_stage=1)`` (:mod:`hora.keras.sharded`). Stage 2 is accepted and behaves as 1
(the gradients are the tape's tensors, which TensorFlow owns).
"""

from __future__ import annotations

import itertools

import numpy as np
import tensorflow as tf

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit import sharding
from hora.kit.frontend import predivide
from hora.tensorflow import bridge
from hora.tensorflow.compression import Compression

_ids = itertools.count()  # ranks create their optimizers in the same order: the same collective names


def _wire(compression) -> str | None:
    return sharding.compression_wire(compression, Compression)


class ShardedOptimizer:
    """The wrapped Keras optimizer (``.optimizer``), updating this rank's slice; see the module docstring."""

    def __init__(self, optimizer, op, compression, gradient_predivide_factor, process_set, zero_stage):
        sharding.check_shardable(op, "DistributedOptimizer")
        self.optimizer, self.op, self.process_set, self.zero_stage = optimizer, op, process_set, zero_stage
        self._wire = _wire(compression)
        self._scales = predivide(op, gradient_predivide_factor)
        self._name = f"tf.zero.{next(_ids)}"
        self._pieces: list | None = None
        self.plan = None

    @property
    def variables(self) -> list:
        """The wrapped optimizer's variables: its slots are slice-sized."""
        return list(self.optimizer.variables)

    def build(self, variables) -> None:
        """Lay ``variables`` out and create this rank's pieces and the wrapped optimizer's state (done by the
        first ``apply_gradients`` otherwise)."""
        import keras

        variables = list(variables)
        dtypes = {v.dtype for v in variables}
        if len(dtypes) > 1:
            raise HoraValueError(f"DistributedOptimizer(zero_stage=...): the variables must share one dtype, got "
                                 f"{sorted(str(d) for d in dtypes)}. Not supported yet: keep the sharded optimizer "
                                 "to one dtype")
        self.plan = sharding.make_plan([int(np.prod(v.shape)) for v in variables], self.process_set.size())
        with tf.init_scope():
            self._pieces = [(i, a, b, keras.Variable(np.asarray(variables[i]).reshape(-1)[a:b],
                                                     name=f"hora_zero_piece_{i}"))
                            for i, a, b in self.plan.pieces(self.process_set.rank())]
            self.optimizer.build([p for *_, p in self._pieces])

    def apply_gradients(self, grads_and_vars):
        pairs = list(grads_and_vars)
        variables = [v for _, v in pairs]
        if self._pieces is None:
            self.build(variables)
        if len(variables) != len(self.plan.sizes):
            raise HoraValueError(f"DistributedOptimizer(zero_stage=...): built for {len(self.plan.sizes)} variables, "
                                 f"given {len(variables)}; give the same variables at every step")
        lo, hi = self.plan.range(self.process_set.rank())
        dtype = variables[0].dtype
        flat = tf.concat([tf.reshape(tf.zeros_like(v) if g is None else tf.convert_to_tensor(g), [-1])
                          for g, v in pairs], 0)
        pre, post = self._scales
        counts = self.plan.counts(0, self.plan.total)

        def reduce(x):
            return [sharding.reduce_scatter_async(x, counts, f"{self._name}.rs", self.op, pre, post, self._wire,
                                                  self.process_set).wait()]
        (mine,) = bridge.host_call(reduce, [flat], [dtype], [(hi - lo,)])
        grads = tf.split(mine, [b - a for _, a, b, _ in self._pieces]) if self._pieces else []
        for i, a, b, piece in self._pieces:  # from the model: weights set since the last step are seen
            piece.assign(tf.reshape(variables[i], [-1])[a:b])
        if self._pieces:
            self.optimizer.apply_gradients(zip(grads, [p for *_, p in self._pieces]))
        updated = tf.concat([tf.convert_to_tensor(p) for *_, p in self._pieces], 0) if self._pieces \
            else tf.zeros([0], dtype)

        def gather(x):
            return [_core.synchronize(sharding.allgather_async(x, f"{self._name}.ag", self.process_set))]
        (full,) = bridge.host_call(gather, [updated], [dtype], [(self.plan.total,)])
        offsets = self.plan.offsets
        for i, v in enumerate(variables):
            v.assign(tf.reshape(full[offsets[i]:offsets[i + 1]], v.shape))
