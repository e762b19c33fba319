"""``SyncBatchNormalization``: Keras's ``BatchNormalization`` whose batch statistics, in training, are those of
the whole batch over every rank.

Each rank sums its inputs and their squares over the reduction axes and counts its elements; the three
are summed over the ranks in one grouped allreduce, differentiable (the gradient of a Sum allreduce is the
Sum allreduce of the gradients, Horovod's rule), and the mean and variance come from the totals. So with
equal shards the layer computes what one process computes on the concatenated batch.

It is a Keras 3 layer; under ``TF_USE_LEGACY_KERAS=1`` (Keras 2 code, :mod:`hora.keras.flavour`) making one
makes its ``tf_keras`` twin, for ``tf.keras`` models.
"""

from __future__ import annotations

import functools

import keras
import tensorflow as tf

from hora.core.ops import Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.keras.flavour import Flavoured, tf_keras
from hora.tensorflow import mpi_ops

__all__ = ["SyncBatchNormalization"]


def _check(fused, kwargs: dict) -> ProcessSet:
    """Horovod's arguments: ``fused=True`` refused, ``synchronized`` too; returns ``process_set``."""
    if fused in (True, None):
        raise ValueError("SyncBatchNormalization does not support fused=True")
    if kwargs.pop("synchronized", False):
        raise ValueError("SyncBatchNormalization synchronizes over hora's ranks; synchronized=True is "
                         "tf.distribute's and cannot be combined with it")
    return kwargs.pop("process_set", global_process_set)


def _sync_moments(inputs, axes: list, mask, ps: ProcessSet, keepdims: bool = False):
    """The mean and variance of ``inputs`` over ``axes`` and over every rank of ``ps`` (one allreduce)."""
    x = tf.convert_to_tensor(inputs)
    if mask is None:
        weights = tf.ones_like(x)
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
    total, squares, count = mpi_ops.grouped_allreduce(
        [tf.reduce_sum(x * weights, axes, keepdims=keepdims), tf.reduce_sum(tf.square(x) * weights, axes,
                                                                           keepdims=keepdims),
         tf.reduce_sum(weights, axes, keepdims=keepdims)], op=Sum, process_set=ps)
    count = tf.maximum(count, 1.0)
    mean = total / count
    return mean, tf.maximum(squares / count - tf.square(mean), 0.0)


@keras.saving.register_keras_serializable(package="hora")
class SyncBatchNormalization(Flavoured, keras.layers.BatchNormalization):
    """Batch normalization with statistics synchronized over the ranks (TensorFlow backend). Takes
    ``BatchNormalization``'s arguments, as Horovod's does (``fused=False``; Keras 3's own layer has no
    ``fused``), except ``synchronized`` (tf.distribute's); ``process_set`` (keyword, hora only) limits the
    statistics to a set's ranks."""

    def __init__(self, fused=False, **kwargs):
        process_set = _check(fused, kwargs)
        super().__init__(**kwargs)
        self._hora_process_set: ProcessSet = process_set

    @classmethod
    def _legacy_twin(cls):
        return _legacy_class() if cls is SyncBatchNormalization else None

    def _moments(self, inputs, mask):
        ps = self._hora_process_set
        if ps.size() == 1 or not ps.included():
            return super()._moments(inputs, mask)
        return _sync_moments(inputs, list(self._reduction_axes), mask, ps)


@functools.lru_cache(maxsize=None)
def _legacy_class() -> type:
    """The ``tf_keras`` twin (Horovod's layer, on Keras 2's ``BatchNormalization``)."""

    class SyncBatchNormalization(tf_keras().layers.BatchNormalization):
        __doc__ = globals()["SyncBatchNormalization"].__doc__

        def __init__(self, fused=False, **kwargs):
            process_set = _check(fused, kwargs)
            kwargs["name"] = kwargs.get("name") or "sync_batch_normalization"
            super().__init__(fused=False, **kwargs)
            self._hora_process_set: ProcessSet = process_set

        def _calculate_mean_and_var(self, inputs, reduction_axes, keep_dims, mask=None):
            ps = self._hora_process_set
            if ps.size() == 1 or not ps.included():
                return super()._calculate_mean_and_var(inputs, reduction_axes, keep_dims, mask=mask)
            return _sync_moments(inputs, list(reduction_axes), mask, ps, keep_dims)

    SyncBatchNormalization.__module__ = __name__
    return SyncBatchNormalization
