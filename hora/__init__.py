"""hora: data-parallel distributed training, a drop-in for Horovod in pure Python.

``import hora`` loads NumPy and hora's core only; frameworks load with their bindings
(``hora.torch``, ...) and the launcher API (``hora.run``) loads on first use.
"""

from hora.common.basics import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                                local_size, rank, shutdown, size)
from hora.common.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                                MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.common.ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_object, allreduce,
                             allreduce_, alltoall, barrier, broadcast, broadcast_, broadcast_object,
                             reducescatter)

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce",
    "allreduce_", "allgather", "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier",
    "broadcast_object", "allgather_object", "HoraError", "InternalError", "HorovodInternalError",
    "HostsUpdatedInterrupt", "MismatchError", "NotInitializedError", "PeerLostError", "ShutdownError",
    "StallError", "__version__",
]
