"""hora for JAX: ``import hora.jax as hvd``. Horovod never had JAX; the names are hora.torch's where the
concept is the same.

The collectives take ``jax.Array``s or pytrees of them (one grouped collective, in one host call, per
pytree), run eagerly or inside ``jax.jit`` (ordered host callbacks), and are differentiable;
``DistributedOptimizer`` wraps an optax transformation. docs/jax.md says how to use it and what differs.
"""

from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                              MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.core.basics import (cross_rank, cross_size, is_homogeneous, is_initialized, local_rank, local_size,
                              rank, size, start_timeline, statistics, stop_timeline)
from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rocm_built)
from hora.core.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from hora.jax.compression import Compression
from hora.jax.functions import allgather_object, broadcast_object, broadcast_parameters
from hora.jax.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                              allreduce_async, alltoall, alltoall_async, barrier, broadcast, broadcast_async,
                              grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                              grouped_reducescatter, grouped_reducescatter_async, init, join, poll, reducescatter,
                              reducescatter_async, shutdown, synchronize)
from hora.jax.optimizer import DistributedOptimizer

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
    "is_homogeneous", "start_timeline", "stop_timeline", "statistics",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "allreduce_async", "grouped_allreduce", "grouped_allreduce_async",
    "allgather", "allgather_async", "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async",
    "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
    "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier",
    "broadcast_parameters", "broadcast_object", "allgather_object",
    "Compression", "DistributedOptimizer",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HoraError", "InternalError", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError",
]
