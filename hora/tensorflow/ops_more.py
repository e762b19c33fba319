"""The rest of ``horovod.tensorflow``'s collectives: alltoall, reducescatter, join, and (hora's) barrier.

Built as in :mod:`hora.tensorflow.mpi_ops`: one host call each, differentiable with Horovod's rules.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import hora.kit.frontend as _fe
import hora.core.ops as _core
from hora.core.ops import Average
from hora.core.process_sets import global_process_set
from hora.tensorflow.bridge import host_call, in_graph, traced
from hora.tensorflow.compression import Compression
from hora.tensorflow.mpi_ops import _dims0, _input, _inputs, differentiable, movable, pick, restored, rule_call

__all__ = ["alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier"]


# -- alltoall -------------------------------------------------------------------------------------
def _equal_splits(array: np.ndarray, n: int):
    """Equal parts when dimension 0 divides by ``n``; else None, and the core explains what is wrong."""
    if array.ndim and array.shape[0] % n == 0:
        return [array.shape[0] // n] * n
    return None


@traced
def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i of the set (equal parts without ``splits``) and return
    the rows received, in rank order; with ``splits``, ``(rows, received_splits)`` (int32), as Horovod.
    Differentiable: the gradient goes back along the received splits."""
    t, name = _input(tensor, "alltoall", "Alltoall", name, ignore_name_scope, process_set)
    given = splits is not None
    s = tf.convert_to_tensor(splits) if given else tf.zeros([0], tf.int32)

    def run(array, sp):
        out, received = _core.alltoall(movable(array), sp if given else _equal_splits(array, process_set.size()),
                                       name, process_set)
        return [restored(out, array), np.asarray(received, np.int32)]

    def grad(dys, xs, ys):
        back = rule_call(lambda gs, r: [_fe.alltoall_grad(gs[0], r, process_set)], dys[:1], xs[:1], [ys[1]])
        return [back[0], None]
    out, received = differentiable(run, [t, s], [t.dtype, tf.int32], [_dims0(t.shape), tf.TensorShape([None])],
                                   grad)
    return (out, received) if given else out


# -- reducescatter --------------------------------------------------------------------------------
def _reducescatter(tensors: list, op: int, pre: float, post: float, name, process_set, grouped: bool) -> list:
    run = pick(grouped, lambda arrays: _core.grouped_reducescatter(arrays, op, name, process_set, pre, post),
               lambda array: _core.reducescatter(array, op, name, process_set, pre, post))

    def grad(dys, xs, ys):
        return rule_call(lambda gs: _fe.reducescatter_grad(gs, op, pre, post, process_set), dys, xs)
    return differentiable(run, tensors, [t.dtype for t in tensors], [_dims0(t.shape) for t in tensors], grad)


@traced
def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """Reduce ``tensor`` over the ranks and return this rank's rows of the result (the lowest ranks get one
    extra row when dimension 0 does not divide evenly). Differentiable (Horovod's rule: the allgather of the
    gradient, times the set's size for Sum)."""
    t, name = _input(tensor, "reducescatter", "Reducescatter", name, ignore_name_scope, process_set)
    _core.check_op(op, "reducescatter")
    c, ctx = compression.compress(t)
    return compression.decompress(_reducescatter([c], op, prescale_factor, postscale_factor, name, process_set,
                                                 False)[0], ctx)


@traced
def grouped_reducescatter(tensors, device_dense='', compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0, name=None,
                          ignore_name_scope=False):
    """Reducescatter a list of tensors as one unit (one host call)."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    ts, name = _inputs(tensors, "grouped_reducescatter", "GroupedReducescatter", name, ignore_name_scope,
                       process_set)
    _core.check_op(op, "grouped_reducescatter")
    pairs = [compression.compress(t) for t in ts]
    out = _reducescatter([c for c, _ in pairs], op, prescale_factor, postscale_factor, name, process_set, True)
    return [compression.decompress(r, ctx) for r, (_, ctx) in zip(out, pairs)]


# -- join, barrier --------------------------------------------------------------------------------
@traced
def join():
    """This rank has no more data: it takes part in the others' allreduces with zeros until every rank has
    joined. Returns the last rank to join (an int32 scalar tensor, read when the op runs in a graph)."""
    return host_call(lambda: [np.int32(_core.join())], [], [tf.int32], [()])[0]


@traced
def barrier(process_set=global_process_set):
    """Return once every rank of the set has called barrier() (hora's addition; Horovod's TensorFlow API has
    none). In a graph, a tensor (0) to run or depend on; in eager mode, None."""
    def run():
        _core.barrier(process_set)
        return [np.int32(0)]
    out = host_call(run, [], [tf.int32], [()])[0]
    return out if in_graph() else None
