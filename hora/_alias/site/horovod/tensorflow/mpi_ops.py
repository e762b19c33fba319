"""``horovod.tensorflow.mpi_ops``: the op functions and basics of ``hora.tensorflow``."""

from hora.core.build import *  # noqa: F401,F403
from hora.tensorflow.basics import *  # noqa: F401,F403
from hora.tensorflow.mpi_ops import *  # noqa: F401,F403
from hora.tensorflow.ops_more import *  # noqa: F401,F403
from horovod import _shim
from horovod.tensorflow._names import *  # noqa: F401,F403
from horovod.tensorflow._names import REASONS as _REASONS
from horovod.tensorflow._names import check_num_rank_power_of_2, handle_average_backwards_compatibility  # noqa: F401

_shim.fill(globals(), {"MPI_LIB": _REASONS["MPI_LIB"]})
