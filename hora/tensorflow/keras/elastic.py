"""``horovod.tensorflow.keras.elastic`` is :mod:`hora.keras.elastic`: the same objects (tf.keras is Keras 3)."""

from hora.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                UpdateEpochStateCallback, run)
from hora.keras.elastic import __all__  # noqa: F401
