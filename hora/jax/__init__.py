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
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax.compression import Compression
from hora.jax.functions import allgather_object, broadcast_object, broadcast_parameters
from hora.jax.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allgather_async, allreduce,
                              allreduce_async, alltoall, alltoall_async, barrier, broadcast, broadcast_async,
                              grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_async,
                              grouped_reducescatter, grouped_reducescatter_async, init, join, poll, reducescatter,
                              reducescatter_async, shutdown, synchronize)
from hora.jax.optimizer import DistributedOptimizer
from hora.jax import elastic

# every public name imported above, alphabetically (tests/test_api_jax.py holds them against hora.torch's)
__all__ = [
    "Adasum", "add_process_set", "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_async",
    "alltoall", "alltoall_async", "Average", "barrier", "broadcast", "broadcast_async", "broadcast_object",
    "broadcast_parameters", "ccl_built", "Compression", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "DistributedOptimizer", "elastic", "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "HoraError", "HorovodInternalError", "HostsUpdatedInterrupt", "init",
    "InternalError", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "Max", "Min",
    "MismatchError", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "NotInitializedError",
    "PeerLostError", "poll", "ProcessSet", "Product", "rank", "reducescatter", "reducescatter_async",
    "remove_process_set", "rocm_built", "shutdown", "ShutdownError", "size", "StallError", "start_timeline",
    "statistics", "stop_timeline", "Sum", "synchronize"
]
