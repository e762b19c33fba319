"""``horovod.tensorflow.mpi_ops``: the op functions and basics of ``hora.tensorflow``."""

from hora.tensorflow.basics import *  # noqa: F401,F403
from hora.tensorflow.mpi_ops import *  # noqa: F401,F403
from hora.tensorflow.ops_more import *  # noqa: F401,F403
