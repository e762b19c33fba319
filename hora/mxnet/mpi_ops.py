"""The collectives on MXNet NDArrays: ``horovod.mxnet``'s op functions over hora's NumPy core.

Conversion, and nothing else, lives here. MXNet's engine is asynchronous: an NDArray's memory holds its value
only once the operations writing it have run, so every input is waited for (``wait_to_read``; for an in-place
op ``WaitToWrite``, which also waits for pending readers) before the core sees it. A CPU NDArray then becomes
a NumPy view of its own memory (``MXNDArrayGetData``, about 7 µs against ``asnumpy``'s 181 µs per 4 MB), so an
in-place op writes its result straight into the NDArray; an out-of-place result travels back with
``nd.from_numpy(zero_copy=True)`` (22 µs, no copy). A GPU NDArray goes to the core as its device memory
through MXNet's DLPack export (which waits the same way) and its result comes back with ``nd.from_dlpack``,
no host copy (docs/gpu.md); gradients and the trainer's reductions still stage GPU NDArrays through the host.

Horovod's MXNet ops hand their work to MXNet's engine and return at once; hora's return when the collective is
done (the result is ready to read). Unlike Horovod's, the out-of-place ``allreduce``, ``grouped_allreduce``,
``allgather``, ``broadcast`` and ``reducescatter`` are differentiable under ``autograd.record()`` (Horovod's
gradient rules, as in hora.torch); the in-place forms and ``alltoall`` are not. ``priority`` is accepted for
Horovod's signature and has no effect: hora's engine runs collectives in the order the ranks agree on.
Errors are raised as hora's classes made to also be ``mxnet.base.MXNetError`` (what Horovod's MXNet ops
raise), so both ``except`` clauses catch them.
"""

from __future__ import annotations

import ctypes
import functools
import math

import mxnet as mx
import numpy as np
from mxnet.base import _LIB, MXNetError, check_call

import hora.kit.frontend as _fe
from hora.kit.frontend import init, shutdown
import hora.core.ops as _core
from hora.base.device import DeviceArray, from_dlpack
from hora.kit.device import exported
from hora.base.errors import HoraError, HoraValueError
from hora.core.ops import Adasum, Average, Max, Min, Product, Sum
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "init", "shutdown", "allreduce", "allreduce_",
           "grouped_allreduce", "grouped_allreduce_", "allgather", "grouped_allgather", "broadcast", "broadcast_",
           "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier"]

_MX_DTYPES = frozenset({"uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool"})
_MX_DTYPE_NAMES = "uint8, int8, int32, int64, float16, float32, float64 or bool"
# the dtypes nd.from_numpy(zero_copy=True) takes (DLPack's, as MXNet 1.9 maps them; its bool is broken)
_ZERO_COPY = frozenset({"uint8", "int32", "int64", "float16", "float32", "float64"})






# -- errors ----------------------------------------------------------------------------------------
@functools.cache
def _mxnet_class(cls: type) -> type:
    """``cls`` made to also be an MXNetError (one subclass per hora class, made once)."""
    return type(cls.__name__, (cls, MXNetError), {"__module__": cls.__module__, "__qualname__": cls.__qualname__})


def mxnet_errors(fn):
    """Decorate a public function: a hora error leaves it as the same class, also an ``MXNetError``."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except HoraError as e:
            if isinstance(e, MXNetError):
                raise
            new = _mxnet_class(type(e)).__new__(_mxnet_class(type(e)))
            new.__dict__.update(e.__dict__)
            new.args = e.args
            raise new.with_traceback(e.__traceback__) from e.__cause__
    return wrapper


# -- NDArrays <-> arrays -----------------------------------------------------------------------------
def _view(tensor, what: str, write: bool = False, device: bool = False) -> tuple[np.ndarray, mx.nd.NDArray | None]:
    """A NumPy view of ``tensor``'s memory once MXNet has finished writing it (and, with ``write``, reading
    it), and the host copy when the NDArray lives on another device. ``device`` (the public collectives,
    which hand the array straight to the core): a GPU NDArray goes as its device memory instead, through
    MXNet's DLPack export, which waits the same way (``to_dlpack_for_read``/``_for_write``)."""
    if not isinstance(tensor, mx.nd.NDArray):
        raise HoraValueError(f"{what}: expected an mxnet.nd.NDArray, got {type(tensor).__name__}")
    if tensor.stype != "default":
        raise HoraValueError(f"{what}: {tensor.stype} NDArrays are not supported; convert with .tostype('default')")
    try:
        dtype = np.dtype(tensor.dtype)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name not in _MX_DTYPES:
        raise HoraValueError(f"{what}: NDArray type {tensor.dtype} is not supported; use {_MX_DTYPE_NAMES}")
    host = None
    if device and tensor.context.device_type == "gpu":
        got = exported(lambda t: from_dlpack(t.to_dlpack_for_write() if write else t.to_dlpack_for_read(), what),
                       [tensor], "hora.mxnet")
        if got is not None:
            return got[0], None
    if tensor.context.device_type != "cpu":
        host = tensor = tensor.as_in_context(mx.cpu())  # staged: a GPU transport would reduce on the device
    if write and host is None:
        check_call(_LIB.MXNDArrayWaitToWrite(tensor.handle))
    else:
        tensor.wait_to_read()
    return _memory(tensor, dtype), host


def _memory(tensor: mx.nd.NDArray, dtype: np.dtype) -> np.ndarray:
    """The NDArray's memory as a NumPy array (no copy; the array keeps the NDArray alive)."""
    shape = tuple(tensor.shape)
    n = math.prod(shape) * dtype.itemsize
    if n == 0:
        return np.empty(shape, dtype)
    ptr = ctypes.c_void_p()
    check_call(_LIB.MXNDArrayGetData(tensor.handle, ctypes.byref(ptr)))
    buf = (ctypes.c_char * n).from_address(ptr.value)
    buf.owner = tensor  # the view must not outlive the NDArray's memory
    return np.frombuffer(buf, dtype).reshape(shape)


def _nd(a: np.ndarray, like: mx.nd.NDArray) -> mx.nd.NDArray:
    """An NDArray holding ``a`` (the core's result, owned by nobody else) on ``like``'s device, without a copy
    where MXNet allows (a C-contiguous array of a type DLPack knows)."""
    if isinstance(a, DeviceArray):  # a GPU result: MXNet's NDArray over hora's memory, no copy
        return mx.nd.from_dlpack(a.__dlpack__())
    a = np.asarray(a)
    if a.size and a.flags.c_contiguous and a.dtype.name in _ZERO_COPY:
        out = mx.nd.from_numpy(a, zero_copy=True)
    else:
        out = mx.nd.array(a, dtype=a.dtype, ctx=mx.cpu()) if a.size else mx.nd.zeros(a.shape, dtype=a.dtype)
    return out if like.context.device_type == "cpu" else out.as_in_context(like.context)


def _fill(tensor: mx.nd.NDArray, host: mx.nd.NDArray | None) -> mx.nd.NDArray:
    """An in-place result: ``tensor`` itself (copied back from host staging)."""
    if host is not None:
        host.copyto(tensor)
    return tensor


def _array(tensor, what: str, name=None, process_set: ProcessSet = global_process_set, write: bool = False):
    """:func:`_view`; a refused input tells the peers (:func:`hora.kit.frontend.viewed`)."""
    return _fe.viewed(lambda t, w: _view(t, w, write, device=True), tensor, what, name, process_set)


def _arrays(tensors, what: str, name=None, process_set: ProcessSet = global_process_set, write: bool = False):
    """:func:`_view` of each of a grouped op's tensors; a refusal tells the peers under every member's name."""
    pairs = _fe.grouped_viewed(lambda t, w: _view(t, w, write, device=True), tensors, what, name, process_set)
    return [a for a, _ in pairs], [h for _, h in pairs]


def _op(op, average, what: str, name=None, process_set=global_process_set, n: int = 0, stacklevel: int = 5) -> int:
    """``stacklevel``: the deprecation warning points at the caller of the public function."""
    return _fe.resolve_op(op, average, what, name, process_set, n, stacklevel=stacklevel)


def _listed(tensors, what: str, name=None, process_set: ProcessSet = global_process_set) -> list:
    """A grouped op's tensors as a list. Anything else (a bare NDArray, which MXNet would iterate row by row)
    is refused, and the peers told as of a group of one member: this rank cannot know how many its peers
    pass, and one is what a rank passing a lone NDArray meant (the peers' ``[x]``)."""
    if tensors is None or isinstance(tensors, mx.nd.NDArray) or not hasattr(tensors, "__iter__"):
        e = HoraValueError(f"{what}: expected a list of NDArrays, got {type(tensors).__name__}; wrap one NDArray "
                           "in a list")
        _core.refused_group(what.removeprefix("grouped_").rstrip("_"), e, 1, name, process_set)
        raise e
    return list(tensors)


class _Autograd(mx.autograd.Function):
    """A collective recorded by MXNet's autograd: ``run`` (NDArrays -> NDArray or tuple) forward, and backward
    ``rule`` (one of :mod:`hora.kit.frontend`'s gradient rules, Horovod's) on the output gradients as NumPy."""

    def __init__(self, run, rule):
        super().__init__()
        self._run, self._rule, self._inputs = run, rule, ()

    def forward(self, *inputs):
        self._inputs = inputs
        return self._run(*inputs)

    def backward(self, *grads):
        out = [_nd(a, t) for a, t in zip(self._rule([_view(g, "gradient")[0] for g in grads]), self._inputs)]
        return out[0] if len(out) == 1 else tuple(out)


def _recorded(run, rule, tensors: list):
    """``run(*tensors)``, through :class:`_Autograd` while autograd records (so gradients flow through the
    collective); a list that is not all NDArrays goes straight to ``run``, which refuses it."""
    if mx.autograd.is_recording() and all(isinstance(t, mx.nd.NDArray) for t in tensors):
        return _Autograd(run, rule)(*tensors)
    return run(*tensors)


def _one(what: str, tensor, name, process_set, collective, rule):
    """An out-of-place op on one NDArray: ``collective(array)`` forward, recorded with gradient ``rule``."""
    def run(t):
        a, _ = _array(t, what, name, process_set)
        return _nd(collective(a), t)
    return _recorded(run, rule, [tensor])


# -- allreduce -----------------------------------------------------------------------------------
@mxnet_errors
def allreduce(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
              process_set=global_process_set, op=None) -> mx.nd.NDArray:
    """Reduce ``tensor`` over the ranks (Average unless ``op`` says otherwise); returns a new NDArray.

    >>> hvd.allreduce(mx.nd.array([hvd.rank()]), op=hvd.Sum)   # at np=3: [3.]
    """
    op = _op(op, average, "allreduce", name, process_set)
    return _one("allreduce", tensor, name, process_set,
                lambda a: _core.allreduce(a, op, prescale_factor, postscale_factor, name, process_set),
                lambda gs: _fe.allreduce_grad(gs, op, prescale_factor, postscale_factor, process_set))


@mxnet_errors
def allreduce_(tensor, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set, op=None) -> mx.nd.NDArray:
    """In-place :func:`allreduce`: the result is written into ``tensor``'s memory; returns ``tensor``."""
    op = _op(op, average, "allreduce_", name, process_set)
    a, host = _array(tensor, "allreduce_", name, process_set, write=True)
    _core.allreduce_(a, op, prescale_factor, postscale_factor, name, process_set)
    return _fill(tensor, host)


def _grouped_allreduce(what: str, tensors, average, name, prescale_factor, postscale_factor, process_set, op,
                       inplace: bool) -> list:
    tensors = _listed(tensors, what, name, process_set)
    if not tensors:
        return tensors
    op = _op(op, average, what, name, process_set, len(tensors), stacklevel=6)
    if inplace:
        arrays, hosts = _arrays(tensors, what, name, process_set, write=True)
        _core.grouped_allreduce_(arrays, op, prescale_factor, postscale_factor, name, process_set)
        return [_fill(t, h) for t, h in zip(tensors, hosts)]

    def run(*ts):
        arrays, _ = _arrays(ts, what, name, process_set)
        out = _core.grouped_allreduce(arrays, op, prescale_factor, postscale_factor, name, process_set)
        return tuple(_nd(a, t) for a, t in zip(out, ts))
    out = _recorded(run, lambda gs: _fe.allreduce_grad(gs, op, prescale_factor, postscale_factor, process_set),
                    tensors)
    return list(out) if isinstance(out, (tuple, list)) else [out]


@mxnet_errors
def grouped_allreduce(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                      process_set=global_process_set, op=None) -> list:
    """Allreduce a list of NDArrays as one unit (negotiated and fused together); returns new NDArrays."""
    return _grouped_allreduce("grouped_allreduce", tensors, average, name, prescale_factor, postscale_factor,
                              process_set, op, inplace=False)


@mxnet_errors
def grouped_allreduce_(tensors, average=None, name=None, priority=0, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set, op=None) -> list:
    """In-place :func:`grouped_allreduce`; returns ``tensors``."""
    return _grouped_allreduce("grouped_allreduce_", tensors, average, name, prescale_factor, postscale_factor,
                              process_set, op, inplace=True)


# -- allgather, broadcast --------------------------------------------------------------------------
@mxnet_errors
def allgather(tensor, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ per rank)."""
    return _one("allgather", tensor, name, process_set, lambda a: _core.allgather(a, name, process_set),
                lambda gs: _fe.allgather_grad(gs, [tensor.shape[0]], process_set))


@mxnet_errors
def grouped_allgather(tensors, name=None, priority=0, process_set=global_process_set) -> list:
    """:func:`allgather` of several NDArrays as one unit."""
    tensors = _listed(tensors, "grouped_allgather", name, process_set)
    arrays, _ = _arrays(tensors, "grouped_allgather", name, process_set)
    return [_nd(a, t) for a, t in zip(_core.grouped_allgather(arrays, name, process_set), tensors)]


@mxnet_errors
def broadcast(tensor, root_rank, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """Return global rank ``root_rank``'s ``tensor`` on every rank, as a new NDArray."""
    return _one("broadcast", tensor, name, process_set, lambda a: _core.broadcast(a, root_rank, name, process_set),
                lambda gs: [_fe.broadcast_grad(gs[0], root_rank, process_set)])


@mxnet_errors
def broadcast_(tensor, root_rank, name=None, priority=0, process_set=global_process_set) -> mx.nd.NDArray:
    """In-place :func:`broadcast`; returns ``tensor``."""
    a, host = _array(tensor, "broadcast_", name, process_set, write=True)
    _core.broadcast_(a, root_rank, name, process_set)
    return _fill(tensor, host)


# -- alltoall, reducescatter ---------------------------------------------------------------------
def _splits(splits):
    """Splits as the core takes them: an NDArray's values, or what was given (the core explains what is wrong)."""
    if isinstance(splits, mx.nd.NDArray):
        values = splits.asnumpy()
        if not np.issubdtype(values.dtype, np.integer):  # Horovod requires 32-bit integers here, and raises
            raise HoraValueError(f"alltoall: splits must hold integers (int32), got an NDArray of {values.dtype}; "
                                 "pass e.g. mx.nd.array(splits, dtype='int32')")
        return values
    return splits


@mxnet_errors
def alltoall(tensor, splits=None, name=None, priority=0, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts without ``splits``). Returns the rows
    received, in rank order, and with ``splits`` also the received splits (an int32 NDArray on the CPU)."""
    a, _ = _array(tensor, "alltoall", name, process_set)
    result = _core.alltoall(a, _splits(splits), name, process_set)
    if splits is None:
        return _nd(result, tensor)
    out, received = result
    return _nd(out, tensor), mx.nd.array(np.asarray(received, np.int32), dtype="int32")


@mxnet_errors
def reducescatter(tensor, op=Average, name=None, priority=0, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0) -> mx.nd.NDArray:
    """Reduce ``tensor`` over the ranks and return this rank's rows of the result (the lowest ranks get one
    extra row when dim 0 does not divide evenly)."""
    return _one("reducescatter", tensor, name, process_set,
                lambda a: _core.reducescatter(a, op, name, process_set, prescale_factor, postscale_factor),
                lambda gs: _fe.reducescatter_grad(gs, op, prescale_factor, postscale_factor, process_set))


@mxnet_errors
def grouped_reducescatter(tensors, op=Average, name=None, priority=0, process_set=global_process_set,
                          prescale_factor=1.0, postscale_factor=1.0) -> list:
    """:func:`reducescatter` of several NDArrays as one unit."""
    tensors = _listed(tensors, "grouped_reducescatter", name, process_set)
    arrays, _ = _arrays(tensors, "grouped_reducescatter", name, process_set)
    out = _core.grouped_reducescatter(arrays, op, name, process_set, prescale_factor, postscale_factor)
    return [_nd(a, t) for a, t in zip(out, tensors)]


# -- join, barrier (hora: horovod.mxnet has neither) ---------------------------------------------------
@mxnet_errors
def join(device: int = -1) -> int:
    """This rank has no more data; returns the last rank to join (see :func:`hora.join`)."""
    return _core.join(device)


@mxnet_errors
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    _core.barrier(process_set)
