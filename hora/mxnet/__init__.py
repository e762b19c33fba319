"""hora for MXNet: ``import hora.mxnet as hvd`` in place of ``import horovod.mxnet as hvd``.

The names, signatures and defaults are ``horovod.mxnet``'s (0.28.1); the ops are synchronous (the result is
ready when they return), ``priority`` is accepted with no effect, and ``join``/``barrier`` are hora's
additions. NDArrays go to hora's NumPy core as views of their own memory (see :mod:`hora.mxnet.mpi_ops`).
"""

try:
    import mxnet as _mxnet  # noqa: F401
except ImportError as e:  # say how to get it: MXNet 1.9 needs NumPy < 1.24, so usually its own virtualenv
    raise ImportError(f"hora.mxnet needs MXNet ({e}); install it with pip install 'hora[mxnet]' (mxnet 1.9.1 "
                      "needs numpy<1.24, so give it its own virtualenv: make setup-mxnet)") from e

from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                              MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.core.basics import (cross_rank, cross_size, is_homogeneous, is_initialized, local_rank, local_size,
                              rank, size, start_timeline, statistics, stop_timeline)
from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rocm_built)
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.mxnet.compression import Compression
from hora.mxnet.functions import allgather_object, broadcast_object, broadcast_parameters
from hora.mxnet.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, allreduce_,
                                alltoall, barrier, broadcast, broadcast_, grouped_allgather, grouped_allreduce,
                                grouped_allreduce_, grouped_reducescatter, init, join, reducescatter, shutdown)
from hora.mxnet.optimizer import DistributedOptimizer, DistributedTrainer

__all__ = [  # sorted
    "Adasum", "add_process_set", "allgather", "allgather_object", "allreduce", "allreduce_", "alltoall", "Average",
    "barrier", "broadcast", "broadcast_", "broadcast_object", "broadcast_parameters", "ccl_built", "Compression",
    "cross_rank", "cross_size", "cuda_built", "ddl_built", "DistributedOptimizer", "DistributedTrainer",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather", "grouped_allreduce",
    "grouped_allreduce_", "grouped_reducescatter", "HoraError", "HorovodInternalError", "HostsUpdatedInterrupt",
    "init", "InternalError", "is_homogeneous", "is_initialized", "join", "local_rank", "local_size", "Max", "Min",
    "MismatchError", "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "NotInitializedError",
    "PeerLostError", "ProcessSet", "Product", "rank", "reducescatter", "remove_process_set", "rocm_built", "shutdown",
    "ShutdownError", "size", "StallError", "start_timeline", "statistics", "stop_timeline", "Sum",
]
