"""Putting every rank on the same parameters: ``broadcast_parameters``, and the object collectives."""

from __future__ import annotations

import functools
import types

import mxnet as mx

import hora.core.basics as _basics
import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit.gradients import start_then_wait
from hora.core.process_sets import global_process_set
from hora.mxnet import mpi_ops

__all__ = ["broadcast_parameters", "broadcast_object", "allgather_object"]


@mpi_ops.mxnet_errors
def broadcast_parameters(params, root_rank: int = 0, prefix: str | None = None) -> None:
    """Overwrite ``params`` in place with rank ``root_rank``'s values.

    ``params``: a dict of NDArrays or of gluon Parameters, or a ``ParameterDict`` (``block.collect_params()``),
    sent in key order under the names ``prefix + key``. Every broadcast is started before any is waited for,
    so the parameters travel in one negotiation. A Parameter whose initialisation is deferred (its shape is
    known only after the first forward pass) is broadcast when it is initialised, as in Horovod.
    """
    if _basics.size() == 1:
        return
    if prefix is not None and not isinstance(prefix, str):
        raise HoraValueError(f"broadcast_parameters: prefix must be a str or None, not {type(prefix).__name__}")
    prefix = prefix or ""
    if not isinstance(params, (dict, mx.gluon.ParameterDict)):
        raise HoraValueError(f"broadcast_parameters: params must be a dict or a ParameterDict, not "
                             f"{type(params).__name__}")
    tensors = []
    for key, p in sorted(params.items()):
        name = prefix + str(key)
        if not isinstance(p, mx.gluon.Parameter):
            tensors.append((name, p, []))
            continue
        try:
            data = p.list_data()
        except mx.gluon.parameter.DeferredInitializationError:
            p._init_impl = types.MethodType(_broadcast_after(p._init_impl, root_rank, name), p)
            continue
        tensors.append((name, data[0], data[1:]))
    try:  # every entry checked before any is submitted: a refusal tells the peers under every name they use
        views = [mpi_ops._view(t, "broadcast_", write=True) for _, t, _ in tensors]
    except HoraValueError as e:
        for name, _, _ in tensors:
            _core.refused("broadcast", e, name)
        raise
    # all in flight together, and all waited for even after one fails
    start_then_wait([functools.partial(_core.broadcast_async_, a, root_rank, name)
                     for (name, _, _), (a, _) in zip(tensors, views)])
    for (_, t, copies), (_, host) in zip(tensors, views):
        mpi_ops._fill(t, host)
        for c in copies:  # the same parameter on this rank's other devices
            t.copyto(c)


def _broadcast_after(init_impl, root_rank: int, name: str):
    """``Parameter._init_impl`` followed by the broadcast of the new data (deferred initialisation)."""
    def wrapped(self, *args, **kwargs):
        init_impl(*args, **kwargs)
        data = self.list_data()
        mpi_ops.broadcast_(data[0], root_rank, name=name)
        for c in data[1:]:
            data[0].copyto(c)
    return wrapped


@mpi_ops.mxnet_errors
def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=global_process_set):
    """Return ``root_rank``'s ``obj`` (anything cloudpickle can serialise) on every rank (``process_set``: hora)."""
    return _core.broadcast_object(obj, root_rank, name, process_set)


@mpi_ops.mxnet_errors
def allgather_object(obj, name: str | None = None, process_set=global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order (``process_set``: hora)."""
    return _core.allgather_object(obj, name, process_set)
