"""``horovod.tensorflow.keras`` is :mod:`hora.keras` under Horovod's TensorFlow name: the same objects, except
:func:`DistributedOptimizer` and ``callbacks.BestModelCheckpoint``, which take this module's positional order.

``tf.keras`` is Keras 3 on TensorFlow >= 2.16, or Keras 2 (``tf_keras``) under ``TF_USE_LEGACY_KERAS=1``;
hora serves both (:mod:`hora.keras.flavour`).
"""

import importlib

from hora.keras import *  # noqa: F401,F403
from hora.keras import __all__  # noqa: F401
from hora.keras.compression import Compression
from hora.keras.optimizer import distributed_optimizer
from hora.core.ops import Average
from hora.core.process_sets import global_process_set

# the submodules, as Horovod's; imported by name: `from hora.tensorflow.keras import callbacks` would find the
# star import's hora.keras.callbacks and never load this package's own (its BestModelCheckpoint's order)
callbacks = importlib.import_module("hora.tensorflow.keras.callbacks")
elastic = importlib.import_module("hora.tensorflow.keras.elastic")


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """Wrap a Keras 3 or a ``tf_keras`` optimizer so that its gradients are reduced (``op``) over the ranks;
    ``horovod.tensorflow.keras``'s signature (see :func:`hora.keras.DistributedOptimizer`)."""
    return distributed_optimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                 gradient_predivide_factor, op, backward_passes_per_step,
                                 average_aggregated_gradients, num_groups, groups, process_set, scale_local_gradients)
