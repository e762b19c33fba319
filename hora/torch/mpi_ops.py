"""The collectives on torch tensors: ``horovod.torch``'s op functions over hora's NumPy core.

Each function converts its tensors and makes one core call. A contiguous CPU tensor becomes a NumPy
view of the same memory (no copy); bfloat16 is viewed as int16 and then as ``ml_dtypes.bfloat16``. The
core copies a non-contiguous input (and, for in-place ops, copies the result back). A CUDA tensor stays on
its GPU (hora.torch.cuda: NCCL or the staged path, docs/gpu.md); a tensor on another device is staged
through host memory and copied back at ``synchronize``.

``*_async`` functions return the core's int handle; ``synchronize`` returns what the synchronous form
returns, as tensors (``_post`` maps a handle to the conversion). As with Horovod, an input must not be
modified until its handle is synchronized: the engine reads it when the collective runs.
"""

from __future__ import annotations


import numpy as np
import torch

import hora.kit.frontend as _fe
from hora.kit.frontend import init, shutdown
import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.core.ops import Adasum, Average, Max, Min, Product, Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.torch.compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "init", "shutdown", "allreduce", "allreduce_async",
           "allreduce_", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_async", "grouped_allreduce_",
           "grouped_allreduce_async_", "sparse_allreduce_async", "allgather", "allgather_async",
           "grouped_allgather", "grouped_allgather_async", "broadcast", "broadcast_async", "broadcast_",
           "broadcast_async_", "alltoall", "alltoall_async", "reducescatter", "reducescatter_async",
           "grouped_reducescatter", "grouped_reducescatter_async", "poll", "synchronize", "join", "barrier"]

_posts = _fe.posts  # handle -> function turning the core's result into what synchronize returns






# -- tensors <-> arrays --------------------------------------------------------------------------
def _array(tensor: torch.Tensor, what: str, name: str | None = None,
           process_set: ProcessSet = global_process_set) -> tuple[np.ndarray, torch.Tensor | None]:
    """A NumPy view of ``tensor``'s memory, and the host copy when the tensor lives on another device; a
    refused input tells the peers (:func:`hora.kit.frontend.viewed`), except for a grouped op (``what``
    starts with ``grouped_``), where :func:`_grouped_arrays` tells them."""
    if what.startswith("grouped_"):
        return _view(tensor, what)
    return _fe.viewed(_view, tensor, what, name, process_set)


def _view(tensor, what: str, host: bool = False) -> tuple[np.ndarray, torch.Tensor | None]:
    """``host``: a NumPy array even for a CUDA tensor (staged), for the core's host-only rules."""
    if not isinstance(tensor, torch.Tensor):
        raise HoraValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout != torch.strided:
        raise HoraValueError(f"{what}: {tensor.layout} tensors are not supported; use sparse_allreduce_async "
                             "for sparse tensors, or .to_dense()")
    t = tensor.detach()
    host = None
    if t.device.type == "cuda" and not host:
        from hora.torch import cuda
        return cuda.device_array(t)
    if t.device.type != "cpu":
        host = t = t.cpu()  # staged: a GPU transport would reduce on the device instead
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16), host
    try:
        return t.numpy(), host
    except TypeError:
        raise HoraValueError(f"{what}: tensor type {tensor.dtype} is not supported; use uint8, int8, int16, "
                             "int32, int64, float16, bfloat16, float32, float64 or bool") from None


def shared_empty(*size, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialised CPU tensor in shared memory (``torch.empty``'s arguments): in place, np=2 on one
    host, an allreduce of such tensors on both ranks reads the peer's where it is, one pass over the
    data instead of two (:mod:`hora.transport.arena`). Elsewhere an ordinary tensor."""
    from hora.transport import arena

    shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)) else size
    dtype = dtype or torch.get_default_dtype()
    if dtype == torch.bfloat16:
        return torch.from_numpy(arena.empty(shape, np.int16)).view(torch.bfloat16)
    try:
        np_dtype = torch.empty(0, dtype=dtype).numpy().dtype
    except TypeError:
        raise HoraValueError(f"shared_empty: tensor type {dtype} is not supported; use uint8, int8, int16, "
                             "int32, int64, float16, bfloat16, float32, float64 or bool") from None
    return torch.from_numpy(arena.empty(shape, np_dtype))


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    if device.type == "cuda" and not isinstance(a, np.ndarray):  # a DeviceArray: the result on the GPU
        from hora.torch import cuda
        return cuda.tensor(a)
    if a.dtype.name == "bfloat16":
        t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(a)
    return t if device.type == "cpu" else t.to(device)


def _new(like: torch.Tensor):
    """Post-processing for an out-of-place result: a new tensor on ``like``'s device."""
    return lambda a: _tensor(a, like.device)


def _filled(tensor: torch.Tensor, host: torch.Tensor | None):
    """Post-processing for an in-place result: ``tensor`` itself (copied back from host staging)."""
    def done(_):
        if host is not None:
            with torch.no_grad():
                tensor.copy_(host)
        return tensor
    return done


_keep, then, _each = _posts.keep, _posts.then, _fe.each


def _op(op, average, what: str, name=None, process_set=global_process_set, n: int = 0) -> int:
    return _fe.resolve_op(op, average, what, name, process_set, n, stacklevel=4)


# -- handles -------------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished; never blocks."""
    return _core.poll(handle)


def synchronize(handle: int):
    """Wait for ``handle``; returns a tensor (a list for grouped ops, ``(out, received_splits)`` for
    alltoall), the very tensor given for in-place ops. Failures raise ``HorovodInternalError``."""
    return _posts.synchronize(handle)


def join(device: int = -1) -> int:
    """This rank has no more data; returns the last rank to join. ``device`` is accepted for Horovod."""
    return _core.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    _core.barrier(process_set)


# -- allreduce -----------------------------------------------------------------------------------
def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start an allreduce; ``synchronize`` returns a new tensor. The input must stay unmodified until then."""
    a, _ = _array(tensor, "allreduce", name, process_set)
    op = _op(op, average, "allreduce_async", name, process_set)
    h = _core.allreduce_async(a, op, prescale_factor, postscale_factor, name, process_set)
    return _keep(h, _new(tensor))


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> int:
    """Start an in-place allreduce; ``synchronize`` returns ``tensor``, reduced."""
    a, host = _array(tensor, "allreduce_", name, process_set)
    op = _op(op, average, "allreduce_async_", name, process_set)
    h = _core.allreduce_async_(a, op, prescale_factor, postscale_factor, name, process_set)
    return _keep(h, _filled(tensor, host))


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """In-place allreduce (not autograd-aware); returns ``tensor``."""
    a, host = _array(tensor, "allreduce_", name, process_set)
    op = _op(op, average, "allreduce_", name, process_set)
    _core.allreduce_(a, op, prescale_factor, postscale_factor, name, process_set)
    return _filled(tensor, host)(None)


class _Allreduce(torch.autograd.Function):
    """The gradient of an allreduce is the same allreduce of the gradient (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, op, name, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        a, _ = _array(tensor, "allreduce", name, process_set)
        return _tensor(_core.allreduce(a, op, prescale_factor, postscale_factor, name, process_set), tensor.device)

    @staticmethod
    def backward(ctx, grad):
        return _grads(_fe.allreduce_grad, [grad], *ctx.args)[0], *[None] * 5


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks (Average unless ``op`` says otherwise); returns a new tensor.
    Autograd-aware.

    >>> hvd.allreduce(torch.tensor([float(hvd.rank())]), op=hvd.Sum)   # at np=3
    tensor([3.])
    """
    op = _op(op, average, "allreduce", name, process_set)
    if not isinstance(tensor, torch.Tensor):  # refused (and the peers told) before a compressor trips on it
        _array(tensor, "allreduce", name, process_set)
    c, ctx = compression.compress(tensor)
    return compression.decompress(_Allreduce.apply(c, op, name, prescale_factor, postscale_factor, process_set),
                                  ctx)


def _grouped_arrays(tensors, what, name=None, process_set=global_process_set):
    """The tensors as a list, their NumPy views and host copies; a refusal tells the peers (as
    :func:`_array` does) under every member's name and the group's id."""
    tensors = list(tensors)
    pairs = _fe.grouped_viewed(_view, tensors, what, name, process_set)
    return tensors, [a for a, _ in pairs], [h for _, h in pairs]


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Allreduce several tensors as one unit; ``synchronize`` returns a list of new tensors."""
    tensors, arrays, _ = _grouped_arrays(tensors, "grouped_allreduce", name, process_set)
    op = _op(op, average, "grouped_allreduce_async", name, process_set, len(tensors))
    h = _core.grouped_allreduce_async(arrays, op, prescale_factor, postscale_factor, name, process_set)
    return _keep(h, _each([_new(t) for t in tensors]))


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0, process_set=global_process_set) -> int:
    """In-place grouped allreduce; ``synchronize`` returns the list of given tensors, reduced."""
    tensors, arrays, hosts = _grouped_arrays(tensors, "grouped_allreduce_", name, process_set)
    op = _op(op, average, "grouped_allreduce_async_", name, process_set, len(tensors))
    h = _core.grouped_allreduce_async_(arrays, op, prescale_factor, postscale_factor, name, process_set)
    return _keep(h, _each([_filled(t, host) for t, host in zip(tensors, hosts)]))


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> list:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


class _GroupedReduction(torch.autograd.Function):
    """A grouped allreduce or reducescatter (``kind``), differentiable by Horovod's rule for it."""

    @staticmethod
    def forward(ctx, kind, op, name, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.kind, ctx.args = kind, (op, prescale_factor, postscale_factor, process_set)
        _, arrays, _ = _grouped_arrays(tensors, f"grouped_{kind}", name, process_set)
        if kind == "allreduce":
            out = _core.grouped_allreduce(arrays, op, prescale_factor, postscale_factor, name, process_set)
        else:
            out = _core.grouped_reducescatter(arrays, op, name, process_set, prescale_factor, postscale_factor)
        return tuple(_tensor(a, t.device) for a, t in zip(out, tensors))

    @staticmethod
    def backward(ctx, *grads):
        rule = _fe.allreduce_grad if ctx.kind == "allreduce" else _fe.reducescatter_grad
        return (None,) * 6 + tuple(_grads(rule, grads, *ctx.args))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set) -> list:
    """Allreduce a list of tensors as one unit (negotiated and fused together); autograd-aware."""
    tensors = list(tensors)
    op = _op(op, average, "grouped_allreduce", name, process_set, len(tensors))
    pairs = _compressed(tensors, compression, "grouped_allreduce", name, process_set)
    out = _GroupedReduction.apply("allreduce", op, name, prescale_factor, postscale_factor, process_set,
                                  *[c for c, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, pairs)]


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    """Reduce a sparse COO tensor without densifying it; returns a function that waits and returns the
    result, a coalesced sparse tensor of ``tensor``'s size (duplicate indices summed, then the values
    divided by the set's size for Average).

    Every rank's indices and values travel in one allgather named ``name``, each row being one nonzero's
    index (its int64 bytes read as the values' dtype) followed by its values. One collective rather than
    Horovod's two (``name.indices``, ``name.values``) means a rank that reduces this gradient dense instead
    (it had no gradient to give) meets a mismatch error on the same name rather than waiting forever for
    names it never submits; the allgather also checks that the ranks agree on dtype and row width.
    """
    try:
        _check_sparse(tensor, op)
        t = tensor.detach()
        values = t._values()
        shape = values.shape[1:]
        # on the host: the views (and the packing's dtype check) may refuse too, before anything is submitted
        rows, index_cols = _fe.pack_sparse(t._indices().t().cpu().numpy(), _view(values, "sparse_allreduce", True)[0])
    except HoraValueError as e:  # the peers wait on the allgather under ``name``: they are told, as in _array
        _core.refused("allgather", e, name, process_set)
        raise
    handle = allgather_async(_tensor(rows, t.device), name, process_set)

    def wait():
        idx, vals = _fe.unpack_sparse(_view(synchronize(handle), "sparse_allreduce", True)[0], index_cols, tuple(shape))
        out = torch.sparse_coo_tensor(torch.from_numpy(idx).t().to(t.device), _tensor(vals, t.device), t.size(),
                                      check_invariants=True).coalesce()
        if op == Average:  # the indices of a coalesced tensor: checking them again would only cost (and warn)
            out = torch.sparse_coo_tensor(out.indices(), out.values() / process_set.size(), t.size(),
                                          is_coalesced=True, check_invariants=False)
        return out
    return wait


def _check_sparse(tensor, op) -> None:
    """Every check of sparse_allreduce_async's input, in one place so that one ``except`` tells the peers."""
    if op not in (Average, Sum):
        raise HoraValueError(f"sparse_allreduce_async: op {op!r} is not supported; use hvd.Average or hvd.Sum")
    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.sparse_coo:
        got = tensor.layout if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise HoraValueError(f"sparse_allreduce_async: expected a sparse COO tensor, got {got}; use allreduce "
                             "for dense tensors")
    if 8 % tensor._values().element_size():
        raise HoraValueError(f"sparse_allreduce_async: values of type {tensor.dtype} are not supported")


def _compressed(tensors, compression, what: str, name, process_set) -> list:
    """``compression.compress`` of each tensor, once every one is known to be a tensor: a compressor
    would fail on anything else with an AttributeError that tells neither the caller nor the peers
    (who would wait until the stall shutdown); so a non-tensor is refused first, the peers told."""
    tensors = list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        _grouped_arrays(tensors, what, name, process_set)  # raises the HoraValueError, after telling them
    return [compression.compress(t) for t in tensors]


# -- allgather -----------------------------------------------------------------------------------
def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    a, _ = _array(tensor, "allgather", name, process_set)
    return _keep(_core.allgather_async(a, name, process_set), _new(tensor))


def _grads(rule, grads, *args) -> list:
    """``rule`` (a gradient rule of :mod:`hora.kit.frontend`) applied to torch gradients."""
    out = rule([_view(g.contiguous(), "gradient", True)[0] for g in grads], *args)
    return [_tensor(a, g.device) for a, g in zip(out, grads)]


class _Allgather(torch.autograd.Function):
    """Gradient: the averaged gradient's rows that came from this rank (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        a, _ = _array(tensor, "allgather", name, process_set)
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return _tensor(_core.allgather(a, name, process_set), tensor.device)

    @staticmethod
    def backward(ctx, grad):
        return _grads(_fe.allgather_grad, [grad], [ctx.rows], ctx.process_set)[0], None, None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Concatenate every rank's ``tensor`` along dim 0 (which may differ per rank); autograd-aware."""
    return _Allgather.apply(tensor, name, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    tensors, arrays, _ = _grouped_arrays(tensors, "grouped_allgather", name, process_set)
    return _keep(_core.grouped_allgather_async(arrays, name, process_set), _each([_new(t) for t in tensors]))


class _GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        _, arrays, _ = _grouped_arrays(tensors, "grouped_allgather", name, process_set)
        return tuple(_tensor(a, t.device) for a, t in zip(_core.grouped_allgather(arrays, name, process_set),
                                                           tensors))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None) + tuple(_grads(_fe.allgather_grad, grads, ctx.rows, ctx.process_set))


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> list:
    return list(_GroupedAllgather.apply(name, process_set, *tensors))


# -- broadcast -----------------------------------------------------------------------------------
def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    a, _ = _array(tensor, "broadcast", name, process_set)
    return _keep(_core.broadcast_async(a, root_rank, name, process_set), _new(tensor))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    a, host = _array(tensor, "broadcast_", name, process_set)
    return _keep(_core.broadcast_async_(a, root_rank, name, process_set), _filled(tensor, host))


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """In-place broadcast from global rank ``root_rank`` (not autograd-aware); returns ``tensor``."""
    a, host = _array(tensor, "broadcast_", name, process_set)
    _core.broadcast_(a, root_rank, name, process_set)
    return _filled(tensor, host)(None)


class _Broadcast(torch.autograd.Function):
    """Gradient: the averaged gradient on the root, zeros elsewhere (Horovod's rule)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        a, _ = _array(tensor, "broadcast", name, process_set)
        return _tensor(_core.broadcast(a, root_rank, name, process_set), tensor.device)

    @staticmethod
    def backward(ctx, grad):
        rule = lambda gs, root, ps: [_fe.broadcast_grad(gs[0], root, ps)]  # noqa: E731
        return _grads(rule, [grad], ctx.root_rank, ctx.process_set)[0], None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """Return global rank ``root_rank``'s ``tensor`` on every rank; autograd-aware."""
    return _Broadcast.apply(tensor, root_rank, name, process_set)


# -- alltoall ------------------------------------------------------------------------------------
def _splits(tensor, splits, process_set):
    """Explicit splits, so the core always returns ``(out, received_splits)`` (Horovod's synchronize does)."""
    if isinstance(splits, torch.Tensor):
        return splits.detach().cpu().numpy()
    if splits is None and tensor.dim() > 0:
        n = process_set.size()
        if tensor.shape[0] % n == 0:
            return [tensor.shape[0] // n] * n
    return splits  # the core explains what is wrong with it


def _pair(like):
    return lambda r: (_tensor(r[0], like.device), torch.from_numpy(r[1]))


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall; ``synchronize`` returns ``(out, received_splits)``."""
    a, _ = _array(tensor, "alltoall", name, process_set)
    return _keep(_core.alltoall_async(a, _splits(tensor, splits, process_set), name, process_set), _pair(tensor))


class _Alltoall(torch.autograd.Function):
    """Gradient: the gradient sent back along the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        a, _ = _array(tensor, "alltoall", name, process_set)
        out, received = _pair(tensor)(_core.alltoall(a, _splits(tensor, splits, process_set), name, process_set))
        ctx.received, ctx.process_set = received, process_set
        if splits is None:
            return out
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, *_):
        rule = lambda gs, splits, ps: [_fe.alltoall_grad(gs[0], splits, ps)]  # noqa: E731
        return _grads(rule, [grad], ctx.received.numpy(), ctx.process_set)[0], None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts without ``splits``). Returns the rows
    received, in rank order, and with ``splits`` also the received splits (int32). Autograd-aware."""
    return _Alltoall.apply(tensor, splits, name, process_set)


# -- reducescatter -------------------------------------------------------------------------------
def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    a, _ = _array(tensor, "reducescatter", name, process_set)
    return _keep(_core.reducescatter_async(a, op, name, process_set, prescale_factor, postscale_factor),
                 _new(tensor))


class _Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        a, _ = _array(tensor, "reducescatter", name, process_set)
        return _tensor(_core.reducescatter(a, op, name, process_set, prescale_factor, postscale_factor),
                       tensor.device)

    @staticmethod
    def backward(ctx, grad):
        return _grads(_fe.reducescatter_grad, [grad], *ctx.args)[0], *[None] * 5


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0) -> torch.Tensor:
    """Reduce ``tensor`` over all ranks and return this rank's rows of the result (the lowest ranks get
    one extra row when dim 0 does not divide evenly). Autograd-aware."""
    if not isinstance(tensor, torch.Tensor):  # as in allreduce()
        _array(tensor, "reducescatter", name, process_set)
    c, ctx = compression.compress(tensor)
    return compression.decompress(_Reducescatter.apply(c, name, op, process_set, prescale_factor,
                                                       postscale_factor), ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    tensors, arrays, _ = _grouped_arrays(tensors, "grouped_reducescatter", name, process_set)
    h = _core.grouped_reducescatter_async(arrays, op, name, process_set, prescale_factor, postscale_factor)
    return _keep(h, _each([_new(t) for t in tensors]))


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0) -> list:
    pairs = _compressed(tensors, compression, "grouped_reducescatter", name, process_set)
    out = _GroupedReduction.apply("reducescatter", op, name, prescale_factor, postscale_factor, process_set,
                                  *[c for c, _ in pairs])
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(out, pairs)]
