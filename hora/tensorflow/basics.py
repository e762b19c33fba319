"""``horovod.tensorflow``'s basics: the core's, plus the graph-time queries (``rank_op`` ...).

The ``*_op`` functions return int32 scalar tensors whose value is read when the graph runs, not when it is
built (Horovod's point: a graph built in one environment can run in another); in eager mode they are
constants.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import hora.core.basics as _basics
from hora.core.basics import (cross_rank, cross_size, is_homogeneous, is_initialized, local_rank, local_size,
                              rank, size, start_timeline, statistics, stop_timeline)
from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, gloo_enabled, mpi_built, mpi_enabled,
                             mpi_threads_supported, nccl_built, rocm_built)
from hora.core.sets import add_process_set, remove_process_set
from hora.core.process_sets import ProcessSet, global_process_set
from hora.kit.frontend import init, shutdown
from hora.tensorflow.bridge import host_call

__all__ = ["init", "shutdown", "is_initialized", "size", "local_size", "cross_size", "rank", "local_rank",
           "cross_rank", "is_homogeneous", "start_timeline", "stop_timeline", "statistics", "mpi_threads_supported",
           "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built", "nccl_built", "ddl_built", "ccl_built",
           "cuda_built", "rocm_built", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "rank_op", "local_rank_op", "size_op", "local_size_op", "process_set_included_op",
           "PROCESS_SET_ERROR_INIT", "PROCESS_SET_ERROR_UNKNOWN_SET"]

# process_set_included_op's error values (Horovod returns negative codes rather than raising)
PROCESS_SET_ERROR_INIT = -1
PROCESS_SET_ERROR_UNKNOWN_SET = -3






def _scalar(query, name) -> tf.Tensor:
    """An int32 scalar read from ``query()`` when the op runs."""
    return host_call(lambda: [np.int32(query())], [], [tf.int32], [()], name=name, chain=False)[0]


def rank_op(name=None) -> tf.Tensor:
    """This process's rank, read when the graph runs."""
    return _scalar(rank, name)


def local_rank_op(name=None) -> tf.Tensor:
    """This process's rank on its host, read when the graph runs."""
    return _scalar(local_rank, name)


def local_size_op(name=None) -> tf.Tensor:
    """The number of processes on this host, read when the graph runs."""
    return _scalar(local_size, name)


def _ranks_of(process_set_id: int):
    return _basics.state().engine.process_sets.get(int(process_set_id))


def size_op(process_set_id=0, name=None) -> tf.Tensor:
    """The number of processes in the process set (0: all of them), read when the graph runs."""
    def query():
        ranks = _ranks_of(process_set_id)
        if ranks is None:
            raise ValueError(f"size_op: process set {process_set_id} is not registered")
        return len(ranks)
    return _scalar(query, name)


def process_set_included_op(process_set_id=0, name=None) -> tf.Tensor:
    """1 if this process belongs to the process set, 0 if not; ``PROCESS_SET_ERROR_INIT`` (-1) before
    ``init()`` and ``PROCESS_SET_ERROR_UNKNOWN_SET`` (-3) for an unregistered id, as Horovod's codes."""
    def query():
        if not _basics.is_initialized():
            return PROCESS_SET_ERROR_INIT
        ranks = _ranks_of(process_set_id)
        if ranks is None:
            return PROCESS_SET_ERROR_UNKNOWN_SET
        return int(_basics.rank() in ranks)
    return _scalar(query, name)
