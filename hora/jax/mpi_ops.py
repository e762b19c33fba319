"""The collectives on jax arrays: hora.torch's op functions, for ``jax.Array``s and pytrees of them.

Every synchronous op works eagerly and inside ``jax.jit``: it is one host call (:mod:`hora.jax.bridge`) for
the whole pytree, a grouped collective when the pytree has several leaves (negotiated and fused as one
unit). Each is differentiable through ``jax.custom_vjp``, with the gradient rules hora.torch uses
(:mod:`hora.kit.frontend`), themselves one host call per pytree.

Inside ``jit`` a result's shape is fixed at trace time: ``allgather`` then expects every rank's first
dimension to be the same, and ``alltoall`` takes no ``splits`` (both are unrestricted outside ``jit``).
An error in a host call under ``jit`` reaches the caller as JAX's ``JaxRuntimeError`` whose text carries
hora's (``MismatchError: ...``); outside ``jit`` hora's own exception is raised.

The ``*_async`` forms return the core's int handle and run outside ``jit`` only (a handle cannot leave a
traced function); ``synchronize`` returns jax arrays. JAX arrays are immutable, so there are no in-place
forms (``allreduce_``, ``broadcast_``): use the value returned.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import hora.kit.frontend as _fe
import hora.core.ops as _core
from hora.base.errors import HoraValueError, NotSupportedError
from hora.collectives.reduce import check_dtype
from hora.kit.frontend import init, shutdown
from hora.core.ops import Adasum, Average, Max, Min, Product, Sum
from hora.core.process_sets import ProcessSet, global_process_set
from hora.jax import device as _device
from hora.jax.bridge import host_call, settle
from hora.jax.compression import Compression

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "init", "shutdown", "allreduce", "allreduce_async",
           "grouped_allreduce", "grouped_allreduce_async", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_async", "alltoall", "alltoall_async",
           "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
           "poll", "synchronize", "join", "barrier"]

_posts = _fe.posts
_ROWS = ("allgather", "alltoall", "reducescatter")  # the collectives that split or join the first dimension


# -- inputs --------------------------------------------------------------------------------------
def _view(x, what: str):
    """``x`` as a jax array or tracer the core can take (a NumPy array or a number is made a jax array). A
    refusal first lets the queued host calls run (``settle``): the caller then tells the peers under the next
    automatic name, which a jitted collective still queued must take first."""
    try:
        return _checked(x, what)
    except HoraValueError:
        settle()
        raise


def _checked(x, what: str):
    kind = what.removeprefix("grouped_").removesuffix("_async")
    if isinstance(x, (np.ndarray, np.generic, int, float, bool)) and not isinstance(x, jax.core.Tracer):
        x = jnp.asarray(x)
    if not isinstance(x, (jax.Array, jax.core.Tracer)):
        raise HoraValueError(f"{what}: expected a jax.Array (or a pytree of them), got {type(x).__name__}")
    check_dtype(np.dtype(x.dtype), kind)
    if kind in _ROWS and x.ndim == 0:
        raise HoraValueError(f"{kind}: a scalar has no first dimension; reshape it to (1,)")
    return x


def _eager_view(x, what: str):
    if isinstance(x, jax.core.Tracer):
        raise HoraValueError(f"{what}_async: the async forms run outside jax.jit (a handle cannot leave a traced "
                             f"function); inside jit call {what}(), which XLA orders")
    return _view(x, what)


def _leaves(tree, what: str, name, process_set, group: bool) -> tuple[list, Callable, bool]:
    """(the checked leaves, a function rebuilding the pytree from results, whether it is one collective
    rather than a group); a refused leaf tells the peers, under the group's names when it is one."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    single = not group and jax.tree_util.treedef_is_leaf(treedef)
    if single or tree is None:
        arrays = [_fe.viewed(_view, tree, what, name, process_set)]
    else:
        arrays = _fe.grouped_viewed(_view, leaves, f"grouped_{what.removeprefix('grouped_')}", name, process_set)
    return arrays, lambda out: jax.tree_util.tree_unflatten(treedef, list(out)), single


def _op(op, average, what: str, name, process_set, n: int) -> int:
    """The op (``average=`` resolved), checked now so that a bad one raises at trace time; the peers told."""
    if average is not None and op is not None:
        settle()  # resolve_op refuses: the queued host calls take their automatic names first
    op = _fe.resolve_op(op, average, what, name, process_set, n, stacklevel=5)
    try:
        return _core.check_op(op, what)
    except (HoraValueError, NotSupportedError) as e:
        settle()
        kind = "reducescatter" if "reducescatter" in what else "allreduce"
        if n:
            _core.refused_group(kind, e, n, name, process_set)
        else:
            _core.refused(kind, e, name, process_set)
        raise


def _like(arrays) -> list:
    return [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]


def _member(name, i: int, n: int):
    return None if name is None else f"{name}.{i}" if n > 1 else str(name)


# -- differentiation -----------------------------------------------------------------------------
def _differentiable(forward: Callable, rule: Callable, arrays: list, what: str) -> list:
    """``forward(arrays) -> list`` with a ``custom_vjp`` whose backward is ``rule(cotangents, floats)`` run on
    the host in one call: ``floats`` are the indices of the floating-point inputs (the others get no
    gradient) and the rule returns one NumPy gradient per such input."""
    floats = [i for i, a in enumerate(arrays) if jnp.issubdtype(a.dtype, jnp.inexact)]
    if not floats:
        return forward(arrays)
    ins = _like(arrays)

    @jax.custom_vjp
    def f(xs):
        return forward(xs)

    def fwd(xs):
        return forward(xs), None

    def bwd(_, cts):
        grads = host_call(lambda *gs: rule(list(gs), floats), [cts[i] for i in floats], [ins[i] for i in floats],
                          f"the gradient of {what}")
        out = [np.zeros(s.shape, jax.dtypes.float0) for s in ins]
        for i, g in zip(floats, grads):
            out[i] = g
        return (out,)
    f.defvjp(fwd, bwd)
    return f(list(arrays))


def _compressed(arrays: list, compression) -> tuple[list, Callable]:
    pairs = [compression.compress(a) for a in arrays]
    return [c for c, _ in pairs], lambda out: [compression.decompress(o, ctx) for o, (_, ctx) in zip(out, pairs)]


# -- handles -------------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished; never blocks."""
    return _core.poll(handle)


def synchronize(handle: int):
    """Wait for ``handle``; returns a jax array (a list for grouped ops, ``(out, received_splits)`` for
    alltoall). Failures raise ``HorovodInternalError``."""
    return _posts.synchronize(handle)


def join(device: int = -1) -> int:
    """This rank has no more data; returns the last rank to join. ``device`` is accepted for Horovod."""
    settle()
    return _core.join(device)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier() (outside jit)."""
    settle()
    _core.barrier(process_set)


def _start(tensor, what: str, name, process_set):
    """An async form's input on the host: checked (the peers told of a refusal), queued work done."""
    settle()  # first: a refusal takes the next automatic name, which a queued jitted call must take first
    return _host_or_device(_fe.viewed(_eager_view, tensor, what, name, process_set), what)


def _start_group(tensors, what: str, name, process_set) -> list:
    settle()
    xs = _fe.grouped_viewed(_eager_view, list(tensors), what, name, process_set)
    arrays = _device.device_arrays(xs, what) if _device.on_gpu(xs) else None
    return arrays if arrays is not None else [np.asarray(x) for x in xs]


def _host_or_device(x, what: str):
    """An async input: device memory for an array on a CUDA device (:mod:`hora.jax.device`), else NumPy."""
    arrays = _device.device_arrays([x], what) if _device.on_gpu([x]) else None
    return arrays[0] if arrays is not None else np.asarray(x)


def _new(a) -> jax.Array:
    return _device.array(a)


def _each(results) -> list:
    return [_device.array(a) for a in results]


# -- allreduce -----------------------------------------------------------------------------------
def _allreduce(tree, average, name, compression, op, pre, post, process_set, group: bool):
    arrays, rebuild, single = _leaves(tree, "allreduce", name, process_set, group)
    op = _op(op, average, "grouped_allreduce" if group else "allreduce", name, process_set,
             0 if single else len(arrays))
    if not arrays:
        return rebuild([])

    def forward(xs):
        def run(*a):
            if single:
                return [_core.allreduce(a[0], op, pre, post, name, process_set)]
            return _core.grouped_allreduce(list(a), op, pre, post, name, process_set)
        return host_call(run, xs, _like(xs), "allreduce", device=True)

    wire, restore = _compressed(arrays, compression)
    rule = lambda gs, _: _fe.allreduce_grad(gs, op, pre, post, process_set)  # noqa: E731
    return rebuild(restore(_differentiable(forward, rule, wire, "allreduce")))


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set):
    """Reduce ``tensor`` (an array, or a pytree: one grouped collective) over all ranks, Average unless
    ``op`` says otherwise; eager or inside ``jit``; differentiable.

    >>> hvd.allreduce(jnp.array([float(hvd.rank())]), op=hvd.Sum)   # at np=3
    Array([3.], dtype=float32)
    """
    return _allreduce(tensor, average, name, compression, op, prescale_factor, postscale_factor, process_set,
                      False)


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set):
    """Allreduce a list (or pytree) of arrays as one unit, in one host call; returns the same structure."""
    return _allreduce(tensors, average, name, compression, op, prescale_factor, postscale_factor, process_set,
                      True)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> int:
    """Start an allreduce (outside jit); ``synchronize`` returns a new array."""
    a = _start(tensor, "allreduce", name, process_set)
    op = _op(op, average, "allreduce_async", name, process_set, 0)
    return _posts.keep(_core.allreduce_async(a, op, prescale_factor, postscale_factor, name, process_set), _new)


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> int:
    """Start a grouped allreduce (outside jit); ``synchronize`` returns a list of new arrays."""
    arrays = _start_group(tensors, "grouped_allreduce", name, process_set)
    op = _op(op, average, "grouped_allreduce_async", name, process_set, len(arrays))
    h = _core.grouped_allreduce_async(arrays, op, prescale_factor, postscale_factor, name, process_set)
    return _posts.keep(h, _each)


# -- allgather -----------------------------------------------------------------------------------
def _allgather(tree, name, process_set, group: bool):
    arrays, rebuild, single = _leaves(tree, "allgather", name, process_set, group)
    if not arrays:
        return rebuild([])
    rows = [a.shape[0] for a in arrays]
    n = process_set.size()
    shapes = [jax.ShapeDtypeStruct((n * a.shape[0], *a.shape[1:]), a.dtype) for a in arrays]

    def forward(xs):
        def run(*a):
            if single:
                return [_core.allgather(a[0], name, process_set)]
            return _core.grouped_allgather(list(a), name, process_set)
        return host_call(run, xs, shapes, "allgather", device=True)

    rule = lambda gs, fl: _fe.allgather_grad(gs, [rows[i] for i in fl], process_set)  # noqa: E731
    return rebuild(_differentiable(forward, rule, arrays, "allgather"))


def allgather(tensor, name=None, process_set=global_process_set):
    """Concatenate every rank's ``tensor`` along dim 0; differentiable. Outside ``jit`` the ranks' first
    dimensions may differ; inside, they must be equal (the result's shape is fixed at trace time)."""
    return _allgather(tensor, name, process_set, False)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """Allgather a list (or pytree) of arrays as one unit; returns the same structure."""
    return _allgather(tensors, name, process_set, True)


def allgather_async(tensor, name=None, process_set=global_process_set) -> int:
    a = _start(tensor, "allgather", name, process_set)
    return _posts.keep(_core.allgather_async(a, name, process_set), _new)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> int:
    arrays = _start_group(tensors, "grouped_allgather", name, process_set)
    return _posts.keep(_core.grouped_allgather_async(arrays, name, process_set), _each)


# -- broadcast -----------------------------------------------------------------------------------
def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Return global rank ``root_rank``'s ``tensor`` (an array or a pytree, in one host call) on every rank;
    differentiable (the gradient is the averaged gradient on the root, zeros elsewhere)."""
    arrays, rebuild = _broadcast_leaves(tensor, name, process_set)
    if not arrays:
        return rebuild([])
    _check_root(root_rank, process_set, name, len(arrays))

    def forward(xs):
        def run(*a):
            hs = [_core.broadcast_async(x, root_rank, _member(name, i, len(a)), process_set)
                  for i, x in enumerate(a)]
            return [_core.synchronize(h) for h in hs]
        return host_call(run, xs, _like(xs), "broadcast", device=True)

    rule = lambda gs, _: [_fe.broadcast_grad(g, root_rank, process_set) for g in gs]  # noqa: E731
    return rebuild(_differentiable(forward, rule, arrays, "broadcast"))


def _broadcast_leaves(tree, name, process_set) -> tuple[list, Callable]:
    """:func:`_leaves` for a broadcast: a pytree's broadcasts are separate collectives, one per leaf (``name.0``,
    ``name.1``, ... or the next automatic names), so a refused leaf is refused under every leaf's name, as
    the peers will submit them (a group refusal would take a group's name and id, which they never use)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    leaves = [tree] if tree is None else leaves
    try:
        arrays = [_view(x, "broadcast") for x in leaves]
    except HoraValueError as e:
        _refuse_each("broadcast", e, name, process_set, len(leaves))
        raise
    return arrays, lambda out: jax.tree_util.tree_unflatten(treedef, list(out))


def _refuse_each(kind: str, e: Exception, name, process_set, n: int) -> None:
    """Tell the peers of ``n`` separate collectives this rank refuses, once the queued host calls have run
    (a refusal takes the next automatic name, which a queued call must take first)."""
    settle()
    for i in range(n):
        _core.refused(kind, e, _member(name, i, n), process_set)


def _check_root(root_rank, process_set, name, n: int) -> None:
    """Refuse a root outside the set now, before the host call, telling the peers about every member (a
    pytree's broadcasts are separate collectives, ``name.0``, ``name.1``, ...): the core would refuse only
    the first and leave the peers waiting on the others."""
    process_set.size()  # checks that the set is registered (and fills in the global set's ranks)
    ranks = process_set.ranks
    if isinstance(root_rank, (bool, np.bool_)) or not isinstance(root_rank, (int, np.integer)) \
            or int(root_rank) not in ranks:
        e = HoraValueError(f"broadcast: root_rank {root_rank!r} is not a rank of the process set (ranks "
                           f"{list(ranks)}); root_rank is a global rank")
        _refuse_each("broadcast", e, name, process_set, n)
        raise e


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> int:
    a = _start(tensor, "broadcast", name, process_set)
    return _posts.keep(_core.broadcast_async(a, root_rank, name, process_set), _new)


# -- alltoall ------------------------------------------------------------------------------------
def _splits(shape, splits, n: int):
    """Explicit splits, so that the core returns ``(out, received_splits)`` every time."""
    if splits is not None:
        return np.asarray(splits)
    return [shape[0] // n] * n if shape[0] % n == 0 else None  # None: the core says what is wrong


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to rank i (equal parts without ``splits``); returns the rows
    received, in rank order, and with ``splits`` also the received splits (int32). Differentiable. Inside
    ``jit`` only equal parts (no ``splits``): the received rows are known only when it runs."""
    x = _fe.viewed(_view, tensor, "alltoall", name, process_set)
    n = process_set.size()
    # with splits, how many rows arrive is known only when it runs: no result shape, so not inside jit (the
    # same program on every rank refuses it alike, at trace time, so no peer waits)
    shapes = None if splits is not None else [jax.ShapeDtypeStruct(x.shape, x.dtype),
                                              jax.ShapeDtypeStruct((n,), jnp.int32)]

    def forward(a):
        def run(v):
            out, received = _core.alltoall(v, _splits(v.shape, splits, n), name, process_set)
            return [out, np.asarray(received, np.int32)]
        return host_call(run, [a], shapes, "alltoall with splits=" if splits is not None else "alltoall",
                         device=True)

    if jnp.issubdtype(x.dtype, jnp.inexact):
        @jax.custom_vjp
        def f(a):
            return tuple(forward(a))

        def fwd(a):
            out, received = forward(a)
            return (out, received), received

        def bwd(received, cts):
            run = lambda g, r: [_fe.alltoall_grad(g, r, process_set)]  # noqa: E731
            return (host_call(run, [cts[0], received], [jax.ShapeDtypeStruct(x.shape, x.dtype)],
                              "the gradient of alltoall")[0],)
        f.defvjp(fwd, bwd)
        out, received = f(x)
    else:
        out, received = forward(x)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> int:
    """Start an alltoall (outside jit); ``synchronize`` returns ``(out, received_splits)``."""
    a = _start(tensor, "alltoall", name, process_set)
    h = _core.alltoall_async(a, _splits(a.shape, splits, process_set.size()) if a.ndim else splits, name,
                             process_set)
    return _posts.keep(h, lambda r: (_device.array(r[0]), jnp.asarray(r[1])))


# -- reducescatter -------------------------------------------------------------------------------
def _reducescatter(tree, name, compression, op, process_set, pre, post, group: bool):
    arrays, rebuild, single = _leaves(tree, "reducescatter", name, process_set, group)
    op = _op(op, None, "grouped_reducescatter" if group else "reducescatter", name, process_set,
             0 if single else len(arrays))
    if not arrays:
        return rebuild([])
    n, r = process_set.size(), process_set.rank()

    def mine(a):  # this rank's rows: the lowest ranks get one more when dim 0 does not divide evenly
        return jax.ShapeDtypeStruct((a.shape[0] // n + (r < a.shape[0] % n), *a.shape[1:]), a.dtype)

    def forward(xs):
        def run(*a):
            if single:
                return [_core.reducescatter(a[0], op, name, process_set, pre, post)]
            return _core.grouped_reducescatter(list(a), op, name, process_set, pre, post)
        return host_call(run, xs, [mine(a) for a in xs], "reducescatter", device=True)

    wire, restore = _compressed(arrays, compression)
    rule = lambda gs, _: _fe.reducescatter_grad(gs, op, pre, post, process_set)  # noqa: E731
    return rebuild(restore(_differentiable(forward, rule, wire, "reducescatter")))


def reducescatter(tensor, name=None, compression=Compression.none, op=Average, process_set=global_process_set,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Reduce ``tensor`` over all ranks and return this rank's rows of the result (the lowest ranks get one
    extra row when dim 0 does not divide evenly); a pytree is one grouped collective. Differentiable."""
    return _reducescatter(tensor, name, compression, op, process_set, prescale_factor, postscale_factor, False)


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0):
    return _reducescatter(tensors, name, compression, op, process_set, prescale_factor, postscale_factor, True)


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0) -> int:
    a = _start(tensor, "reducescatter", name, process_set)
    h = _core.reducescatter_async(a, op, name, process_set, prescale_factor, postscale_factor)
    return _posts.keep(h, _new)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set,
                                prescale_factor=1.0, postscale_factor=1.0) -> int:
    arrays = _start_group(tensors, "grouped_reducescatter", name, process_set)
    h = _core.grouped_reducescatter_async(arrays, op, name, process_set, prescale_factor, postscale_factor)
    return _posts.keep(h, _each)
