"""``horovod.mxnet`` is ``hora.mxnet``."""

from hora.mxnet import *  # noqa: F401,F403
from hora.mxnet import __all__  # noqa: F401
from hora.mxnet.mpi_ops import *  # noqa: F401,F403
from horovod.common.util import check_extension, split_list  # noqa: F401
