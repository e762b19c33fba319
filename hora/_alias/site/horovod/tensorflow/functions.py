"""``horovod.tensorflow.functions``: broadcast_variables and the object collectives."""

from hora.tensorflow import (ProcessSet, allgather, allgather_object, broadcast, broadcast_,  # noqa: F401
                             broadcast_object, broadcast_object_fn, broadcast_variables, global_process_set, rank,
                             size)
from hora.tensorflow.functions import *  # noqa: F401,F403
