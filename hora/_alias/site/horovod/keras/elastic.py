"""``horovod.keras.elastic`` is ``hora.keras.elastic``."""

from hora.keras.elastic import *  # noqa: F401,F403
from hora.keras.elastic import (CommitStateCallback, KerasState, UpdateBatchStateCallback,  # noqa: F401
                                UpdateEpochStateCallback, run)
from hora.tensorflow.elastic import TensorFlowKerasState  # noqa: F401
