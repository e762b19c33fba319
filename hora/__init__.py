"""hora: data-parallel distributed training, a drop-in for Horovod in pure Python.

``import hora`` loads NumPy and hora's core only; frameworks load with their bindings
(``hora.torch``, ...) and the launcher API (``hora.run``) loads on first use.
"""

from hora.core.basics import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank,
                                local_size, rank, shutdown, size, start_timeline, statistics, stop_timeline)
from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                                MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.core.ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allgather_object,
                             allreduce, allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async,
                             barrier, broadcast, broadcast_, broadcast_async, broadcast_async_, broadcast_object,
                             grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                             grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                             grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
                             synchronize)
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.transport.arena import empty as shared_empty

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
    "cross_rank", "is_homogeneous", "statistics", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
    "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter",
    "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async", "barrier", "join",
    "poll", "synchronize", "broadcast_object", "allgather_object",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "shared_empty",
    "HoraError", "InternalError", "HorovodInternalError", "HostsUpdatedInterrupt", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError", "__version__",
]


def __getattr__(name: str):
    if name == "run":  # lazily: the launcher API pulls in the runner
        from hora.runner import run

        return run
    raise AttributeError(f"module 'hora' has no attribute {name!r}")
