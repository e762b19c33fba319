"""What every ``horovod.torch`` submodule shares: hora.torch's names, the build answers and the helpers."""

from hora.core.build import *  # noqa: F401,F403
from hora.torch import *  # noqa: F401,F403
from hora.torch.mpi_ops import *  # noqa: F401,F403
from horovod.common.util import (check_installed_version, get_average_backwards_compatibility_fun,  # noqa: F401
                                 gpu_available, num_rank_is_power_2, split_list)
import hora.torch as _hvd

handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_hvd)

INTERNAL = {
    "HorovodAllreduce HorovodGroupedAllreduce HorovodAllgather HorovodGroupedAllgather HorovodBroadcast "
    "HorovodAlltoall HorovodReducescatter HorovodGroupedReducescatter":
        "Horovod's autograd Function classes are internal; hora's hvd.allreduce, allgather, broadcast, alltoall "
        "and reducescatter are differentiable themselves",
    "mpi_lib": "it is Horovod's compiled torch extension; hora has none",
}
