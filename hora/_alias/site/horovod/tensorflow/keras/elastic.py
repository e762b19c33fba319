"""``horovod.tensorflow.keras.elastic`` is ``hora.tensorflow.keras.elastic``."""

from hora.tensorflow.elastic import TensorFlowKerasState  # noqa: F401
from hora.tensorflow.keras.elastic import *  # noqa: F401,F403
from hora.tensorflow.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                           UpdateEpochStateCallback, run)
