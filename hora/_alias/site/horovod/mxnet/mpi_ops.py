"""``horovod.mxnet.mpi_ops``: the collectives and basics of ``hora.mxnet``."""

from hora.core.build import *  # noqa: F401,F403
from hora.mxnet import *  # noqa: F401,F403
from hora.mxnet.mpi_ops import *  # noqa: F401,F403
from horovod import _shim
from horovod.common.util import (check_installed_version, get_average_backwards_compatibility_fun,  # noqa: F401
                                 get_ext_suffix)
import hora.mxnet as _hvd

handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_hvd)

_shim.fill(globals(), {
    "MPI_MXNET_LIB_CTYPES dll_path": "it is Horovod's compiled MXNet library; hora's MXNet ops are Python",
})
