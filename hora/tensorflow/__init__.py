"""hora for TensorFlow: ``import hora.tensorflow as hvd`` in place of ``import horovod.tensorflow as hvd``.

The names, signatures and defaults are ``horovod.tensorflow``'s (0.28.1). Every op works on tf.Tensor /
tf.Variable in eager mode, inside ``tf.function`` (not under XLA: ``jit_compile=True`` is refused with a
clear error) and in v1 graphs run by a ``tf.compat.v1.Session``; every op is differentiable with Horovod's
gradient rules. Tensors reach hora's NumPy core through one host call per op (:mod:`.bridge`).
"""

from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                              MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.tensorflow.basics import (ProcessSet, add_process_set, ccl_built, cross_rank, cross_size, cuda_built,
                                    ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_homogeneous,
                                    is_initialized, local_rank, local_rank_op, local_size, local_size_op, mpi_built,
                                    mpi_enabled, mpi_threads_supported, nccl_built, process_set_included_op, rank,
                                    rank_op, remove_process_set, rocm_built, shutdown, size, size_op, start_timeline,
                                    statistics, stop_timeline)
from hora.tensorflow.compression import Compression
from hora.tensorflow.mpi_ops import (Adasum, Average, Max, Min, Product, Sum, allgather, allreduce, broadcast,
                                     broadcast_, grouped_allgather, grouped_allreduce)
from hora.tensorflow.objects import allgather_object, broadcast_object, broadcast_object_fn
from hora.tensorflow.ops_more import alltoall, barrier, grouped_reducescatter, join, reducescatter
# the training wrappers (branch tf-train)
from hora.tensorflow.functions import broadcast_variables
from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelper, LocalGradientAggregationHelperEager
from hora.tensorflow.gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from hora.tensorflow.optimizer import DistributedOptimizer
from hora.tensorflow.sync_batch_norm import SyncBatchNormalization
from hora.tensorflow.v1 import BroadcastGlobalVariablesHook, broadcast_global_variables
from hora.tensorflow import elastic


def _executing_eagerly() -> bool:
    """True when TensorFlow runs eagerly here (not tracing a ``tf.function``, not in a v1 graph): Horovod's
    private helper, which its tests and some scripts call."""
    import tensorflow as tf

    return tf.executing_eagerly()

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
    "is_homogeneous", "start_timeline", "stop_timeline", "statistics",
    "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product",
    "allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall",
    "reducescatter", "grouped_reducescatter", "join", "barrier",
    "broadcast_object", "broadcast_object_fn", "allgather_object", "Compression",
    "broadcast_variables", "broadcast_global_variables", "BroadcastGlobalVariablesHook", "DistributedOptimizer",
    "DistributedGradientTape", "PartialDistributedGradientTape", "SyncBatchNormalization", "elastic",
    "LocalGradientAggregationHelper", "LocalGradientAggregationHelperEager",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HoraError", "InternalError", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError",
]
