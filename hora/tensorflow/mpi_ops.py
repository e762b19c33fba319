"""The collectives on tf.Tensor / tf.Variable: ``horovod.tensorflow``'s allreduce, allgather and broadcast
families over hora's NumPy core (alltoall, reducescatter, join and barrier are in :mod:`ops_more`).

Each op is one host call (:mod:`hora.tensorflow.bridge`): run at once in eager mode, a stateful
``tf.numpy_function`` inside ``tf.function`` and in v1 graphs. Each is differentiable through
``tf.custom_gradient`` with Horovod's gradient rules, which are :mod:`hora.kit.frontend`'s on NumPy. Inputs
are checked when the op is built (traced), and a refused one tells the peers (:func:`frontend.viewed`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

import hora.kit.frontend as _fe
import hora.core.ops as _core
from hora.base.errors import HoraValueError, NotSupportedError
from hora.core.ops import Adasum, Average, Max, Min, Product, Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.bridge import host_call, op_name, traced
from hora.tensorflow.compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "grouped_allreduce", "allgather",
           "grouped_allgather", "broadcast", "broadcast_"]

_DTYPES = (tf.uint8, tf.int8, tf.int16, tf.int32, tf.int64, tf.float16, tf.bfloat16, tf.float32, tf.float64,
           tf.bool)
# uint16 is moved (allgather, broadcast, alltoall: Horovod's dtypes for them), never reduced; the core moves
# it bit for bit as int16 (:func:`movable`, :func:`restored`)
_MOVE_ONLY = (tf.uint16,)
_MOVERS = ("allgather", "grouped_allgather", "broadcast", "broadcast_", "alltoall")
_MOVED_AS = {"uint16": np.dtype(np.int16)}  # by dtype name: a DeviceArray's dtype is a name


def movable(array: np.ndarray) -> np.ndarray:
    """``array`` as the core moves it: a uint16 array viewed as int16 (the same bytes; a DeviceArray too)."""
    as_ = _MOVED_AS.get(getattr(array.dtype, "name", str(array.dtype)))
    return array if as_ is None else array.view(as_)


def restored(out, like: np.ndarray):
    """The core's result for input ``like`` in ``like``'s dtype again (see :func:`movable`)."""
    return out.view(like.dtype) if getattr(like.dtype, "name", str(like.dtype)) in _MOVED_AS else out


# -- inputs ---------------------------------------------------------------------------------------
def _view(tensor, what: str) -> tf.Tensor:
    """``tensor`` as a tf.Tensor of a dtype hora moves; HoraValueError otherwise."""
    if isinstance(tensor, tf.IndexedSlices):
        raise HoraValueError(f"{what}: tf.IndexedSlices are supported by allreduce only; use "
                             "tf.convert_to_tensor() to make the tensor dense")
    try:
        t = tf.convert_to_tensor(tensor)
    except (TypeError, ValueError) as e:
        raise HoraValueError(f"{what}: expected a tf.Tensor or tf.Variable, got {type(tensor).__name__} ({e})") \
            from None
    if t.dtype not in _DTYPES and not (t.dtype in _MOVE_ONLY and what in _MOVERS):
        moved = ", and uint16 for allgather, broadcast and alltoall" if what not in _MOVERS else " or uint16"
        raise HoraValueError(f"{what}: tensor type {t.dtype.name} is not supported; use uint8, int8, int16, int32, "
                             f"int64, float16, bfloat16, float32, float64 or bool{moved}")
    return t


def _input(tensor, what: str, kind: str, name, ignore_name_scope: bool, process_set: ProcessSet):
    """(checked tensor, negotiation name); a refused input tells the peers under that name."""
    name = op_name(kind, tensor, name, ignore_name_scope)
    return _fe.viewed(_view, tensor, what, name, process_set), name


def _inputs(tensors, what: str, kind: str, name, ignore_name_scope: bool, process_set: ProcessSet):
    """The grouped form of :func:`_input` (the group's name is taken from its first and last tensors)."""
    tensors = list(tensors)
    name = op_name(kind, tensors[0], name, ignore_name_scope, last=tensors[-1])
    return _fe.grouped_viewed(_view, tensors, what, name, process_set), name


def _dims0(shape: tf.TensorShape) -> tf.TensorShape:
    """``shape`` with its first dimension unknown (gathered, scattered: it depends on the other ranks)."""
    if shape.rank is None or shape.rank == 0:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


# -- differentiable host calls --------------------------------------------------------------------
def differentiable(run, inputs: list, touts: list, shapes: list | None, grad) -> list:
    """``host_call(run, inputs, touts, shapes)`` with ``grad(dys, xs, ys) -> input gradients`` as its
    gradient (``dys``: one per output, zeros where TensorFlow gives none)."""
    @tf.custom_gradient
    def op(*xs):
        ys = host_call(run, list(xs), touts, shapes, device=True)

        def back(*dys):
            dys = [tf.zeros_like(y) if d is None else d for d, y in zip(dys, ys)]
            return grad(dys, list(xs), ys)
        return ys, back
    return list(op(*inputs))


def rule_call(rule, grads: list, like: list, extra: list = ()) -> list:
    """A gradient rule of :mod:`hora.kit.frontend` (``rule(arrays, *extra_arrays) -> arrays``) in one host
    call on ``grads``; results shaped as ``like`` (the op's inputs)."""
    n = len(grads)
    return host_call(lambda *a: rule(list(a[:n]), *a[n:]), list(grads) + list(extra), [g.dtype for g in grads],
                     [x.shape for x in like])


def pick(grouped: bool, many, one):
    """The host function of a grouped op (``many(arrays) -> arrays``) or of a single one (``one(array)``)."""
    return (lambda *arrays: many(list(arrays))) if grouped else (lambda array: [one(array)])


# -- allreduce ------------------------------------------------------------------------------------
def _allreduce(tensors: list, op: int, pre: float, post: float, name, process_set: ProcessSet,
               grouped: bool) -> list:
    run = pick(grouped, lambda arrays: _core.grouped_allreduce(arrays, op, pre, post, name, process_set),
               lambda array: _core.allreduce(array, op, pre, post, name, process_set))

    def grad(dys, xs, ys):
        return rule_call(lambda gs: _fe.allreduce_grad(gs, op, pre, post, process_set), dys, xs)
    return differentiable(run, tensors, [t.dtype for t in tensors], None, grad)


def _sparse_allreduce(slices: tf.IndexedSlices, op: int, pre: float, post: float, name, process_set,
                      ignore_name_scope: bool) -> tf.IndexedSlices:
    """Horovod's allreduce of IndexedSlices: every rank's indices and values gathered (one allgather, rows
    packed by :func:`frontend.pack_sparse`), the values divided by the set's size for Average (integer
    values then become floats, as TensorFlow's division and Horovod's make them)."""
    name = op_name("Allgather", slices.values, name, ignore_name_scope)
    try:
        if op not in (Average, Sum):
            raise NotSupportedError("allreduce: only Sum and Average ops are supported with tf.IndexedSlices")
        if pre != 1.0 or post != 1.0:
            raise NotSupportedError("allreduce: prescale_factor/postscale_factor are not supported with "
                                    "tf.IndexedSlices")
        values = _view(slices.values, "allreduce")
    except (HoraValueError, NotSupportedError) as e:
        _core.refused("allgather", e, name, process_set)
        raise
    indices = tf.convert_to_tensor(slices.indices)

    # Average divides as TensorFlow's ``/`` does (Horovod's ``values / size``): integer values become floats
    # (float32 up to 16 bits, float64 beyond), not rows truncated one by one
    out_dtype = values.dtype if op != Average or values.dtype.is_floating else \
        (tf.float32 if values.dtype.size <= 2 else tf.float64)

    def run(v, i):
        rows, cols = _fe.pack_sparse(i, v)
        idx, vals = _fe.unpack_sparse(_core.allgather(rows, name, process_set), cols, tuple(v.shape[1:]))
        if op == Average:
            vals = (vals / process_set.size()).astype(out_dtype.as_numpy_dtype)
        return [vals, idx.reshape(-1).astype(i.dtype)]
    vals, idx = host_call(run, [values, indices], [out_dtype, indices.dtype],
                          [_dims0(values.shape), tf.TensorShape([None])])
    return tf.IndexedSlices(vals, idx, dense_shape=slices.dense_shape)


@traced
def allreduce(tensor, average=None, device_dense='', device_sparse='', compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, name=None, process_set=global_process_set,
              ignore_name_scope=False):
    """Reduce ``tensor`` over the ranks (Average unless ``op`` says otherwise); a new tensor of its shape.
    A ``tf.IndexedSlices`` is gathered (indices and values) instead, as Horovod does. Differentiable.
    ``device_dense``/``device_sparse``: accepted, no effect (hora reduces on the host)."""
    if isinstance(tensor, tf.IndexedSlices):
        op = _fe.resolve_op(op, average, "allreduce", name, process_set, stacklevel=4)
        return _sparse_allreduce(tensor, op, prescale_factor, postscale_factor, name, process_set, ignore_name_scope)
    t, name = _input(tensor, "allreduce", "Allreduce", name, ignore_name_scope, process_set)
    op = _fe.resolve_op(op, average, "allreduce", name, process_set, stacklevel=4)
    _core.check_op(op, "allreduce")
    c, ctx = compression.compress(t)
    return compression.decompress(_allreduce([c], op, prescale_factor, postscale_factor, name, process_set,
                                             False)[0], ctx)


@traced
def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='', compression=Compression.none,
                      op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set,
                      ignore_name_scope=False, name=None):
    """Allreduce a list of tensors as one unit (negotiated and fused together, one host call);
    ``tf.IndexedSlices`` members are gathered as in :func:`allreduce`. Differentiable."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    dense = [t for t in tensors if not isinstance(t, tf.IndexedSlices)]
    out = list(tensors)
    op = _fe.resolve_op(op, average, "grouped_allreduce", name, process_set, len(dense), stacklevel=4)
    for k, i in enumerate(sparse):
        out[i] = _sparse_allreduce(tensors[i], op, prescale_factor, postscale_factor,
                                   None if name is None else f"{name}.sparse.{k}", process_set, ignore_name_scope)
    if dense:
        ts, gname = _inputs(dense, "grouped_allreduce", "GroupedAllreduce", name, ignore_name_scope, process_set)
        _core.check_op(op, "grouped_allreduce")
        pairs = [compression.compress(t) for t in ts]
        reduced = _allreduce([c for c, _ in pairs], op, prescale_factor, postscale_factor, gname, process_set, True)
        done = iter(compression.decompress(r, ctx) for r, (_, ctx) in zip(reduced, pairs))
        out = [next(done) if not isinstance(t, tf.IndexedSlices) else o for t, o in zip(tensors, out)]
    return out


# -- allgather ------------------------------------------------------------------------------------
def _allgather(tensors: list, name, process_set: ProcessSet, grouped: bool) -> list:
    run = pick(grouped, lambda arrays: [restored(o, a) for o, a in zip(
        _core.grouped_allgather([movable(a) for a in arrays], name, process_set), arrays)],
        lambda array: restored(_core.allgather(movable(array), name, process_set), array))

    def grad(dys, xs, ys):
        rows = tf.stack([tf.shape(x, out_type=tf.int64)[0] for x in xs])
        return rule_call(lambda gs, r: _fe.allgather_grad(gs, [int(v) for v in r], process_set), dys, xs, [rows])
    return differentiable(run, tensors, [t.dtype for t in tensors], [_dims0(t.shape) for t in tensors], grad)


@traced
def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dimension 0 (whose size may differ per rank). Differentiable:
    the gradient is the averaged gradient's rows that came from this rank."""
    t, name = _input(tensor, "allgather", "Allgather", name, ignore_name_scope, process_set)
    return _allgather([t], name, process_set, False)[0]


@traced
def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Allgather a list of tensors as one unit (one host call)."""
    tensors = list(tensors)
    if not tensors:
        return tensors
    ts, name = _inputs(tensors, "grouped_allgather", "GroupedAllgather", name, ignore_name_scope, process_set)
    return _allgather(ts, name, process_set, True)


# -- broadcast ------------------------------------------------------------------------------------
@traced
def broadcast(tensor, root_rank, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Global rank ``root_rank``'s ``tensor`` on every rank. Differentiable: the gradient is the averaged
    gradient on the root and zeros elsewhere."""
    t, name = _input(tensor, "broadcast", "Broadcast", name, ignore_name_scope, process_set)

    def run(array):
        return [restored(_core.broadcast(movable(array), root_rank, name, process_set), array)]

    def grad(dys, xs, ys):
        return rule_call(lambda gs: [_fe.broadcast_grad(gs[0], root_rank, process_set)], dys, xs)
    return differentiable(run, [t], [t.dtype], None, grad)[0]


@traced
def broadcast_(variables, root_rank, name=None, process_set=global_process_set):
    """Overwrite ``variables`` (a list of tf.Variable or Keras 3 variables, or one) in place with rank
    ``root_rank``'s values, all in one host call; returns their new values (a list, or one tensor for one)."""
    single = _is_variable(variables)
    vs = [variables] if single else list(variables)
    names = [op_name("BroadcastInplace", v, None if name is None else f"{name}.{i}") for i, v in enumerate(vs)]
    for v in vs:
        try:
            if not _is_variable(v):
                raise HoraValueError(f"broadcast_: expected variables (tf.Variable or keras.Variable), got "
                                     f"{type(v).__name__}; use broadcast() for tensors")
            _view(tf.convert_to_tensor(v), "broadcast_")
        except HoraValueError as e:
            for m in names:  # the peers wait on every member: each is refused
                _core.refused("broadcast", e, m, process_set)
            raise

    def run(*arrays):
        handles = [_core.broadcast_async(movable(a), root_rank, n, process_set) for a, n in zip(arrays, names)]
        return [restored(_core.synchronize(h), a) for h, a in zip(handles, arrays)]
    current = [tf.convert_to_tensor(v) for v in vs]
    values = host_call(run, current, [t.dtype for t in current], [t.shape for t in current], chain=False)
    with tf.control_dependencies([v.assign(x) for v, x in zip(vs, values)]):
        out = [tf.identity(tf.convert_to_tensor(v)) for v in vs]
    return out[0] if single else out


def _is_variable(v) -> bool:
    """A tf.Variable, or a Keras 3 variable (``keras.Variable``: on the TensorFlow backend it holds a
    tf.Variable and assigns through it), which TF 2.16+ scripts mostly have."""
    return isinstance(v, tf.Variable) or (hasattr(v, "assign") and hasattr(v, "dtype") and hasattr(v, "shape"))
