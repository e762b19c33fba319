"""What every framework binding shares, written once on NumPy: the rest of a binding is conversion.

A binding (``hora.torch``, ``hora.tensorflow``, ``hora.keras``, ``hora.jax``, ``hora.mxnet``) turns its
framework's tensors into NumPy arrays, calls :mod:`hora.core.ops`, and turns the results back. Everything
that is not conversion lives here, so that the bindings cannot drift apart:

* :func:`init` / :func:`shutdown`: the core's, also forgetting the handles' post-processing;
* :func:`resolve_op`: Horovod's deprecated ``average=`` against ``op=``;
* :func:`viewed` / :func:`grouped_viewed`: convert an input, and when it is refused tell the peers (who
  would otherwise wait for this rank until the stall shutdown);
* :class:`Posts`: what ``synchronize(handle)`` does to the core's result (make a tensor, fill an in-place
  tensor, decompress), one table for every binding;
* the gradient rules of the collectives (Horovod's, on NumPy: a binding's autograd calls them);
* :func:`predivide`, :func:`split_groups`, :func:`check_optimizer_args`: the optimizer wrappers' arguments;
* :func:`cast_compressors`: ``Compression.none/fp16/bf16`` for a framework, from its cast function;
* :func:`pack_sparse` / :func:`unpack_sparse`: a sparse gradient's indices and values in one allgather.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np

import hora.core.basics as _basics
import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.core.ops import Average, Sum, check_op
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["init", "shutdown", "resolve_op", "viewed", "grouped_viewed", "Posts", "posts", "allreduce_grad",
           "allgather_grad", "broadcast_grad", "alltoall_grad", "reducescatter_grad", "predivide", "split_groups",
           "check_optimizer_args", "cast_compressors", "pack_sparse", "unpack_sparse"]


# -- arguments --------------------------------------------------------------------------------------
def resolve_op(op, average, what: str, name=None, process_set: ProcessSet = global_process_set,
               n: int = 0, stacklevel: int = 3) -> int:
    """Horovod's deprecated ``average=``: True/False mean Average/Sum; giving it with ``op`` is an error,
    which the peers are told of (under ``name``; as a group of ``n`` when ``n``), as in :func:`viewed`."""
    if average is not None:
        if op is not None:
            e = HoraValueError(f"The op parameter supersedes average; {what}() was given both, pass only op=")
            if n:
                _core.refused_group("allreduce", e, n, name, process_set)
            else:
                _core.refused("allreduce", e, name, process_set)
            raise e
        warnings.warn(f"{what}(average=...) is deprecated; use op=hvd.Average or op=hvd.Sum", DeprecationWarning,
                      stacklevel=stacklevel)
        return Average if average else Sum
    return Average if op is None else op


def viewed(view: Callable, tensor, what: str, name=None, process_set: ProcessSet = global_process_set):
    """``view(tensor, what)``; when it raises HoraValueError the peers are told (:func:`hora.core.ops.refused`,
    under the name and set the collective would have had) before it propagates: they raise a MismatchError
    naming this rank at once, and this rank's automatic names stay in step with theirs. ``what`` is the
    collective (``allreduce``, ``broadcast_``, ...)."""
    try:
        return view(tensor, what)
    except HoraValueError as e:
        _core.refused(what.rstrip("_"), e, name, process_set)
        raise


def grouped_viewed(view: Callable, tensors, what: str, name=None,
                   process_set: ProcessSet = global_process_set) -> list:
    """:func:`viewed` for a grouped op (``what`` = ``grouped_allreduce`` ...): ``[view(t) for t in tensors]``;
    a refusal tells the peers under every member's name and the group's id."""
    tensors = list(tensors)
    try:
        return [view(t, what) for t in tensors]
    except HoraValueError as e:
        _core.refused_group(what.removeprefix("grouped_").rstrip("_"), e, len(tensors), name, process_set)
        raise


# -- initialisation ---------------------------------------------------------------------------------
def init(comm=None, process_sets=None) -> None:
    """:func:`hora.init` for a binding; a new initialisation also forgets the handles of the last one (their
    ids restart), so a post-processing left from it cannot be applied to a new handle."""
    if not _basics.is_initialized():
        posts.clear()
    _basics.init(comm, process_sets)


def shutdown() -> None:
    """:func:`hora.shutdown` for a binding; pending handles' post-processing is forgotten."""
    posts.clear()
    _basics.shutdown()


# -- handles ----------------------------------------------------------------------------------------
class Posts:
    """handle -> the function turning the core's result into what the binding's ``synchronize`` returns.

    One table for all bindings (handles are unique within one initialisation); :func:`hora.core.basics.init`
    restarts the ids, so a binding's ``init``/``shutdown`` calls :meth:`clear`."""

    def __init__(self) -> None:
        self._post: dict[int, Callable] = {}

    def keep(self, handle: int, post: Callable | None) -> int:
        if post is not None:
            self._post[handle] = post
        return handle

    def then(self, handle: int, fn: Callable) -> int:
        """Run ``fn`` on what ``synchronize(handle)`` would return, and return ``fn``'s result instead."""
        prev = self._post.get(handle)
        self._post[handle] = (lambda r: fn(prev(r))) if prev is not None else fn
        return handle

    def synchronize(self, handle: int):
        post = self._post.pop(handle, None)
        result = _core.synchronize(handle)
        return post(result) if post is not None else result

    def clear(self) -> None:
        self._post.clear()


posts = Posts()


def each(fns: Sequence[Callable]) -> Callable:
    """A post-processing for a grouped result: ``fns[i]`` applied to member ``i``."""
    return lambda results: [f(r) for f, r in zip(fns, results)]


# -- gradient rules (Horovod's), on NumPy -------------------------------------------------------------
def allreduce_grad(grads: list, op: int, prescale_factor: float, postscale_factor: float,
                   process_set: ProcessSet) -> list:
    """The gradient of an allreduce: the same allreduce (op and scales) of the gradients."""
    return _core.grouped_allreduce(list(grads), op, prescale_factor, postscale_factor, process_set=process_set)


def allgather_grad(grads: list, rows: Sequence[int], process_set: ProcessSet) -> list:
    """The gradient of an allgather: the averaged gradient's rows that came from this rank. ``rows``: this
    rank's dim-0 size of each gathered tensor (the ranks' may differ, so they are allgathered)."""
    reduced = _core.grouped_allreduce(list(grads), Average, process_set=process_set)
    counts = _core.allgather(np.asarray([list(rows)], np.int64), process_set=process_set)
    starts = counts[:process_set.rank()].sum(0)
    return [r[int(s):int(s) + int(n)] for r, s, n in zip(reduced, starts, rows)]


def broadcast_grad(grad: np.ndarray, root_rank: int, process_set: ProcessSet) -> np.ndarray:
    """The gradient of a broadcast: the averaged gradient on the root, zeros elsewhere."""
    reduced = _core.allreduce(grad, Average, process_set=process_set)
    return reduced if _basics.rank() == root_rank else np.zeros_like(reduced)


def alltoall_grad(grad: np.ndarray, received_splits, process_set: ProcessSet) -> np.ndarray:
    """The gradient of an alltoall: the gradient sent back along the splits this rank received."""
    return _core.alltoall(grad, np.asarray(received_splits), process_set=process_set)[0]


def reducescatter_grad(grads: list, op: int, prescale_factor: float, postscale_factor: float,
                       process_set: ProcessSet) -> list:
    """The gradient of a reducescatter, by Horovod's rule: the allgather of the incoming gradients times the
    set's size for Sum (nothing for Average) and times the prescale and postscale factors.

    This is not the Jacobian's transpose (that would be ``pre * post`` for Sum and also divide by the size
    for Average); it is what Horovod computes, and scripts and tests written for Horovod depend on it:
    with gradient ones at np=2, Sum gives 2 and Average gives 1.
    """
    if op not in (Average, Sum):
        raise NotImplementedError(f"reducescatter: no gradient for op {op!r}; only Average and Sum have one")
    scale = (process_set.size() if op == Sum else 1) * prescale_factor * postscale_factor
    out = _core.grouped_allgather(list(grads), process_set=process_set)
    return [g * np.asarray(scale, g.dtype) if scale != 1.0 else g for g in out]


# -- optimizer wrappers -----------------------------------------------------------------------------
def predivide(op: int, gradient_predivide_factor: float) -> tuple[float, float]:
    """(prescale, postscale) of a wrapper's allreduce: Average with a predivide factor f divides by f
    before the sum and by size/f after it (the core's Average divides by size)."""
    if op == Average and gradient_predivide_factor != 1.0:
        return 1.0 / gradient_predivide_factor, gradient_predivide_factor
    return 1.0, 1.0


def check_optimizer_args(where: str, op: int, gradient_predivide_factor: float = 1.0,
                         backward_passes_per_step: int = 1) -> None:
    """The checks every ``DistributedOptimizer`` / ``DistributedGradientTape`` makes of its arguments."""
    check_op(op, where)
    if gradient_predivide_factor != 1.0 and op != Average:
        raise HoraValueError(f"{where}: gradient_predivide_factor={gradient_predivide_factor} only works with "
                             "op=hvd.Average (it splits the averaging before and after the sum)")
    if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
            or backward_passes_per_step < 1:
        raise HoraValueError(f"{where}: backward_passes_per_step={backward_passes_per_step!r} must be an "
                             "integer of at least 1")


def split_groups(n: int, groups: int) -> list[range]:
    """``num_groups``/``groups=k``: indices ``0..n-1`` in at most ``k`` contiguous, nearly equal groups."""
    if isinstance(groups, bool) or not isinstance(groups, int) or groups < 0:
        raise HoraValueError(f"groups={groups!r}: give a non-negative number of groups or lists of parameters")
    k = min(groups, n) or 1
    bounds = [i * n // k for i in range(k + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


# -- compression ------------------------------------------------------------------------------------
class Compressor:
    """The interface (Horovod's): ``compress(tensor) -> (tensor, ctx)``, ``decompress(tensor, ctx)``; the
    identity."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class NoneCompressor(Compressor):
    """No compression."""


def cast_compressors(module: str, is_float: Callable, dtype_of: Callable, cast: Callable, fp16, bf16):
    """The casting compressors of one framework: ``(FP16Compressor, BF16Compressor, Compression)``.

    ``is_float(tensor)``: a floating-point tensor; ``dtype_of(tensor)``: its dtype; ``cast(tensor, dtype)``;
    ``fp16``/``bf16``: the framework's dtypes. Floating-point tensors of another width travel cast (fp16 keeps
    more mantissa bits, bf16 float32's range); other dtypes are left alone."""
    def make(name: str, wire, doc: str) -> type:
        def compress(tensor):
            if is_float(tensor) and dtype_of(tensor) != wire:
                return cast(tensor, wire), dtype_of(tensor)
            return tensor, None

        def decompress(tensor, ctx):
            return tensor if ctx is None else cast(tensor, ctx)

        return type(name, (Compressor,), {"__doc__": doc, "__module__": module,
                                          "compress": staticmethod(compress), "decompress": staticmethod(decompress)})

    fp16c = make("FP16Compressor", fp16, "Floating-point tensors travel as float16.")
    bf16c = make("BF16Compressor", bf16, "Floating-point tensors travel as bfloat16 (hora only).")
    compression = type("Compression", (), {
        "__doc__": "The compressors by name: ``Compression.none``, ``Compression.fp16``, ``Compression.bf16``.",
        "__module__": module, "none": NoneCompressor, "fp16": fp16c, "bf16": bf16c})
    return fp16c, bf16c, compression


# -- sparse gradients -------------------------------------------------------------------------------
def pack_sparse(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, int]:
    """One array of rows, each a nonzero's int64 index (``indices``: shape (nnz, k)) read as the values'
    dtype followed by its values, and the number of index columns; so a sparse gradient travels in one
    allgather, which also checks that the ranks agree on dtype and row width. One collective rather than
    Horovod's two means a rank that reduces this gradient dense instead meets a mismatch error on the same
    name rather than waiting forever for names it never submits."""
    values = np.ascontiguousarray(values)
    if 8 % values.itemsize:
        raise HoraValueError(f"sparse gradients of type {values.dtype} are not supported")
    idx = np.ascontiguousarray(indices, np.int64)
    idx = idx.reshape(-1, 1) if idx.ndim == 1 else idx
    cols = idx.shape[1] * 8 // values.itemsize
    flat = values.reshape(len(values), math.prod(values.shape[1:]))
    rows = np.concatenate([idx.view(values.dtype).reshape(len(values), cols), flat], axis=1)
    return rows, cols


def unpack_sparse(rows: np.ndarray, cols: int, value_shape: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of :func:`pack_sparse` on gathered rows: ``(indices (n, k) int64, values (n, *value_shape))``."""
    idx = np.ascontiguousarray(rows[:, :cols]).view(np.int64)
    return idx, np.ascontiguousarray(rows[:, cols:]).reshape(len(rows), *value_shape)
