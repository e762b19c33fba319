"""hora for PyTorch: ``import hora.torch as hvd`` in place of ``import horovod.torch as hvd``.

The names, signatures and defaults are ``horovod.torch``'s (0.28.1); docs/migrating_from_horovod.md lists
every difference. Tensors go to hora's NumPy core as zero-copy views.
"""

from hora.core.basics import (cross_rank, cross_size, is_homogeneous, is_initialized, local_rank, local_size,
                                rank, size, start_timeline, statistics, stop_timeline)
from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                                MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch import elastic, hooks
from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                               mpi_threads_supported, nccl_built, rocm_built)
from hora.torch.compression import Compression
from hora.torch.functions import (allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters,
                                  log_straggler)
from hora.torch.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                                allreduce_, allreduce_async, allreduce_async_, alltoall, alltoall_async, barrier,
                                broadcast, broadcast_, broadcast_async, broadcast_async_, grouped_allgather,
                                grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                                grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                                grouped_reducescatter_async, init, join, poll, reducescatter, reducescatter_async,
                                shared_empty, shutdown, sparse_allreduce_async, synchronize)
from hora.torch.optimizer import DistributedOptimizer
from hora.torch.sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
    "is_homogeneous", "start_timeline", "stop_timeline", "statistics",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_async", "allreduce_", "allreduce_async_", "grouped_allreduce",
    "grouped_allreduce_async", "grouped_allreduce_", "grouped_allreduce_async_", "sparse_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "broadcast_", "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier", "shared_empty",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object", "log_straggler",
    "Compression", "DistributedOptimizer", "SyncBatchNorm", "hooks", "elastic",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HoraError", "InternalError", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError",
]
