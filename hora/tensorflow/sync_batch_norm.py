"""``SyncBatchNormalization``: Keras 3's ``BatchNormalization`` whose batch statistics, in training, are
those of the whole batch over every rank.

Each rank sums its inputs and their squares over the reduction axes and counts its elements; the three
are summed over the ranks in one grouped allreduce, differentiable (the gradient of a Sum allreduce is the
Sum allreduce of the gradients, Horovod's rule), and the mean and variance come from the totals. So with
equal shards the layer computes what one process computes on the concatenated batch.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from hora.core.ops import Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import mpi_ops

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="hora")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization with statistics synchronized over the ranks (TensorFlow backend). Takes
    ``BatchNormalization``'s arguments, as Horovod's does, except ``synchronized`` (tf.distribute's);
    ``process_set`` (keyword, hora only) limits the statistics to a set's ranks."""

    def __init__(self, fused=False, **kwargs):
        if fused in (True, None):
            raise ValueError("SyncBatchNormalization does not support fused=True")
        if kwargs.pop("synchronized", False):
            raise ValueError("SyncBatchNormalization synchronizes over hora's ranks; synchronized=True is "
                             "tf.distribute's and cannot be combined with it")
        process_set = kwargs.pop("process_set", global_process_set)
        super().__init__(**kwargs)
        self._hora_process_set: ProcessSet = process_set

    def _moments(self, inputs, mask):
        ps = self._hora_process_set
        if ps.size() == 1 or not ps.included():
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        x = tf.convert_to_tensor(inputs)
        if mask is None:
            weights = tf.ones_like(x)
        else:
            weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(x)), x.dtype)
        total, squares, count = mpi_ops.grouped_allreduce(
            [tf.reduce_sum(x * weights, axes), tf.reduce_sum(tf.square(x) * weights, axes),
             tf.reduce_sum(weights, axes)], op=Sum, process_set=ps)
        count = tf.maximum(count, 1.0)
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return mean, variance
