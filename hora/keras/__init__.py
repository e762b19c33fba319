"""hora for Keras 3: ``import hora.keras as hvd`` in place of ``horovod.keras`` / ``horovod.tensorflow.keras``.

Keras 3 runs on TensorFlow, JAX or torch (``KERAS_BACKEND``); :func:`DistributedOptimizer` sends each step's
gradients to the binding of the backend in use, so ``model.fit`` trains distributed on all three (Horovod
0.28.1 has no Keras 3 support at all: its issue #4290). ``hora.tensorflow.keras`` is this module under its
Horovod name. The names, signatures and defaults are Horovod's; docs/migrating_from_horovod.md lists every
difference.
"""

from hora.base.errors import (HoraError, HorovodInternalError, HostsUpdatedInterrupt, InternalError,
                                MismatchError, NotInitializedError, PeerLostError, ShutdownError, StallError)
from hora.core.basics import (cross_rank, cross_size, init, is_homogeneous, is_initialized, local_rank, local_size,
                                rank, shutdown, size, start_timeline, stop_timeline)
from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                               mpi_threads_supported, nccl_built, rocm_built)
from hora.core.ops import Adasum, Average, Sum
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.keras import callbacks
from hora.keras.compression import Compression
from hora.keras.functions import (allgather, allreduce, broadcast, broadcast_global_variables, broadcast_variables,
                                  load_model, reducescatter)
from hora.keras.optimizer import DistributedOptimizer, PartialDistributedOptimizer
from hora.keras import elastic

__all__ = [
    "init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank", "cross_rank",
    "is_homogeneous", "start_timeline", "stop_timeline",
    "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built",
    "ccl_built", "cuda_built", "rocm_built",
    "Average", "Sum", "Adasum", "Compression",
    "DistributedOptimizer", "PartialDistributedOptimizer",
    "allreduce", "allgather", "broadcast", "reducescatter", "broadcast_global_variables", "broadcast_variables",
    "load_model", "callbacks", "elastic",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "HorovodInternalError", "HostsUpdatedInterrupt", "HoraError", "InternalError", "MismatchError",
    "NotInitializedError", "PeerLostError", "ShutdownError", "StallError",
]
