"""``horovod.tensorflow.elastic`` is ``hora.tensorflow.elastic``."""

from hora.elastic import HorovodInternalError, ObjectState, run_fn  # noqa: F401
from hora.tensorflow import broadcast_object, broadcast_object_fn, init, rank, shutdown  # noqa: F401
from hora.tensorflow.elastic import *  # noqa: F401,F403
from hora.tensorflow.elastic import TensorFlowKerasState, TensorFlowState, broadcast_variables, run  # noqa: F401
