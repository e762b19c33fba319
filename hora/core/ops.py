"""The collectives on NumPy arrays: the core API every framework binding calls.

Shaped like Horovod's torch API. Every collective has an asynchronous form that returns a handle
(an int) at once; the synchronous form is ``synchronize(<op>_async(...))``. Out-of-place forms
return a new array owned by the caller and never touch their input; in-place forms (``allreduce_``,
``broadcast_``) write into the array they are given, which is undefined if the collective fails.
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from hora.base.device import DeviceArray, as_device_array
from hora.base.errors import HoraValueError, NotSupportedError
from hora.collectives.adasum import check_dtype as adasum_dtype
from hora.collectives.reduce import Adasum, Average, Max, Min, Product, Sum, check_dtype
from hora.core.inputs import DATA_KINDS as _DATA_KINDS
from hora.core.inputs import as_array as _as_array
from hora.core.inputs import check_copy as _check_copy
from hora.core.inputs import check_op  # noqa: F401 - the bindings' check, with the core's API
from hora.core.inputs import copy_back as _copy_back
from hora.core.inputs import factor as _factor
from hora.core.inputs import ps_id as _ps_id
from hora.core.inputs import root as _root
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core.records import FAILED as _FAILED
from hora.core.records import OK as _OK
from hora.core.records import describe as _describe
from hora.core.records import failure as _failure
from hora.core.records import part as _part
from hora.core.records import pickled as _pickle
from hora.core.records import record as _record
from hora.core.records import records as _records
from hora.core.refusal import refused, refused_group  # noqa: F401 - the bindings call them as the core's
from hora.core.refusal import refusing as _refusing
from hora.core.session import state
from hora.engine import callsite, names
from hora.engine import messages as m
from hora.engine.execute import Pending, dtype_of

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "broadcast_object",
           "allgather_object"]

_groups = itertools.count()
_NAMED = object()  # _prepare's site for a named op
_PLAIN_OPS = frozenset({Average, Sum, Min, Max, Product})  # ops check_op passes for every collective


def _auto_name(name: str | None, ps: int = 0, prefix: str = names.UNNAMED) -> str:
    """``name``, or the next automatic one (:func:`hora.engine.names.take`, counted in the session)."""
    return names.take(state().names, name, ps, prefix)


def _group_id(name, ps: int, n: int) -> tuple:
    """A grouped op's id: its name, or the next automatic one, and the number of its members."""
    return names.group_id(state().names, name, ps, n)


_group_name = names.member  # member i's name in a group of n


def _submit(kind: str, array, name, process_set, inplace=False, flush=False, finish=None, **fields) -> int:
    st = state()
    pend = _prepare(st, kind, array, name, process_set, inplace, flush, finish, **fields)
    try:
        _submit_or_discard(st, pend)
    except HoraValueError as e:
        e.hora_named = True  # refused after its name was taken (a duplicate): no peer is told (see _refusing)
        raise
    return pend.handle.id


def _submit_or_discard(st, *pends: Pending) -> None:
    """Queue ``pends``; when the queue refuses them (a duplicate name, hora shut down or failed) their
    handles, which the caller never gets, leave the handle table."""
    try:
        st.engine.submit(*pends)
    except BaseException:
        st.engine.handles.discard(*(p.handle.id for p in pends))
        raise


def _prepare(st, kind: str, array, name, process_set, inplace=False, flush=False, finish=None, site=_NAMED,
             **fields) -> Pending:
    """The pending collective for one submission. Every check of the caller's input is made here, on
    the rank that made it and before the name is taken, so bad input raises at once in the caller and
    never reaches the engine (only a notice that it was refused does, see :func:`_refusing`). ``site``: an
    unnamed group's call site, for its members (a :class:`hora.engine.callsite.Site`, None for no frame)."""
    ps = _ps_id(process_set, st, kind)
    a = None
    if kind in _DATA_KINDS and type(array) is not np.ndarray and (dev := as_device_array(array, what=kind)):
        a = _device_input(st, dev, kind, fields)  # a GPU tensor: a DeviceArray, or any DLPack CUDA producer
    elif kind in _DATA_KINDS:
        a = array if type(array) is np.ndarray else _as_array(array, kind, inplace)
        dtype = check_dtype(a.dtype, kind)
        if fields.get("op") == Adasum:
            adasum_dtype(dtype, kind)
        if kind in (m.ALLGATHER, m.ALLTOALL, m.REDUCESCATTER) and a.ndim == 0:
            raise HoraValueError(f"{kind}: a scalar has no first dimension; reshape it to (1,)")
        if inplace and not a.flags.writeable:
            raise HoraValueError(f"{kind}_: the array is read-only; use the out-of-place {kind}()")
        if not a.flags.c_contiguous:
            _check_copy(a, kind)
            user = a
            a = np.ascontiguousarray(a)
            if inplace:
                finish = _copy_back(user, finish)
        fields.setdefault("dtype", dtype)
        fields.setdefault("shape", a.shape)
    if name is None and kind in _DATA_KINDS:
        site = callsite.here()
    if site is not _NAMED:  # an unnamed op: matched by its order, cached by its call site (hora.engine.unnamed)
        fields["site"] = "" if site is None else site.text
    else:
        site = None
    full = names.take(st.names, name, ps)  # (_auto_name, without asking for the state again)
    if site is None and name is not None:  # named: no call site looked for now (hangs explained find it
        calls = callsite.named             # when they need it), its calls counted by name instead
        n = calls.get(full)
        if n is None and len(calls) > callsite.LIMIT:
            calls.clear()  # (names made per step)
        calls[full] = 1 if n is None else n + 1
    req = (m.SetRequest if kind in (m.ADD_PS, m.REMOVE_PS) else m.Request)(full, kind, ps=ps, **fields)
    handle = st.engine.handles.new(f"{kind}.{full}", finish)
    return Pending(req, handle, a, inplace, flush, site)


def _device_input(st, a: DeviceArray, kind: str, fields: dict) -> DeviceArray:
    """A GPU tensor's checks and request fields; its submission is marked on the framework's stream."""
    dtype = check_dtype(dtype_of(a.dtype), kind)
    if fields.get("op") == Adasum:
        adasum_dtype(dtype, kind)
    if kind in (m.ALLGATHER, m.ALLTOALL, m.REDUCESCATTER) and a.ndim == 0:
        raise HoraValueError(f"{kind}: a scalar has no first dimension; reshape it to (1,)")
    fields.update(dtype=dtype, shape=tuple(a.shape), device=True)
    st.engine.executor.gpu.submitted(a)
    return a


# -- handles -------------------------------------------------------------------------------------
def poll(handle: int) -> bool:
    """True once the collective behind ``handle`` has finished (never blocks)."""
    st = state()
    if handle in st.groups:
        done = all(st.engine.handles.poll(h) for h in st.groups[handle])
    else:
        done = st.engine.handles.poll(handle)
    if not done:
        # `while not poll(h): pass` is common: hand the GIL to the engine thread, which needs it to
        # make the progress this loop waits for (otherwise it gets it once per switch interval)
        time.sleep(0)
    return done


def synchronize(handle: int):
    """Wait for ``handle`` and return what the synchronous form returns; the handle is then spent."""
    st = state()
    members = st.groups.pop(handle, None)  # taken at once: a second thread gets "unknown handle"
    if members is not None:
        return _synchronize_group(st, handle, members)
    return st.engine.handles.synchronize(handle)


def _synchronize_group(st, handle: int, members: list[int]) -> list:
    """The results of group ``handle``, already taken out of the table. When a member fails (a group
    refused on a peer fails whole), the members after it are forgotten too, since nobody can reach
    them any more; an interrupt (Ctrl-C) before any member's result puts the group back, to be waited
    on again."""
    out = []
    try:
        for h in members:
            out.append(st.engine.handles.synchronize(h))
    except BaseException as e:
        if not out and not isinstance(e, Exception):
            st.groups[handle] = members
        else:
            st.engine.handles.discard(*members[len(out):])
        raise
    return out


def _group(handles: list[int]) -> int:
    st = state()
    gid = -1 - next(_groups)  # negative: never collides with a single handle
    st.groups[gid] = handles
    return gid


# -- allreduce -----------------------------------------------------------------------------------
@_refusing(m.ALLREDUCE)
def allreduce_async(array, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    name: str | None = None, process_set: ProcessSet = global_process_set, *,
                    _flush: bool = False) -> int:
    """Start an allreduce of ``array``; ``synchronize`` returns a new array."""
    return _submit(m.ALLREDUCE, array, name, process_set, flush=_flush,
                   **_reduce_fields(op, prescale_factor, postscale_factor, "allreduce"))


@_refusing(m.ALLREDUCE)
def allreduce_async_(array: np.ndarray, op: int = Average, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    """Start an in-place allreduce; ``synchronize`` returns ``array``, reduced."""
    return _submit(m.ALLREDUCE, array, name, process_set, inplace=True, flush=_flush,
                   **_reduce_fields(op, prescale_factor, postscale_factor, "allreduce_"))


def allreduce(array, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Reduce ``array`` over all ranks; returns a new array, the same bits on every rank.

    >>> hora.allreduce(np.full(4, hora.rank(), np.float32), op=hora.Sum)   # at np=3
    array([3., 3., 3., 3.], dtype=float32)
    """
    return synchronize(allreduce_async(array, op, prescale_factor, postscale_factor, name, process_set,
                                       _flush=True))


def allreduce_(array: np.ndarray, op: int = Average, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place :func:`allreduce`; returns ``array``."""
    return synchronize(allreduce_async_(array, op, prescale_factor, postscale_factor, name, process_set,
                                        _flush=True))


def _grouped(kind: str, arrays, name, flush, process_set, inplace=False, reduce: tuple | None = None,
             **fields) -> int:
    """Submit several tensors as one unit: negotiated together (in one message), released together
    and fused together. A named group keeps the same id every step, so it hits the response cache.
    ``reduce``: the arguments of :func:`_reduce_fields`, checked here so that a refused op or scale
    factor tells the peers, as a refused member does."""
    st = state()
    if arrays is None or isinstance(arrays, (np.ndarray, str, bytes)) or not hasattr(arrays, "__iter__"):
        e = HoraValueError(f"grouped_{kind}: expected a list of arrays, got {type(arrays).__name__}; use "
                           f"{kind}() for one array, or wrap it in a list")
        # the peers are told as of a group of one: how many members theirs has, this rank cannot know
        refused_group(kind, e, 1, name, process_set)
        raise e
    arrays = list(arrays)
    pid = _ps_id(process_set, st, f"grouped_{kind}")
    gid = _group_id(name, pid, len(arrays))
    site = callsite.here() if name is None else _NAMED
    pends: list[Pending] = []
    try:
        if reduce is not None:
            fields.update(_reduce_fields(*reduce))
        for i, a in enumerate(arrays):
            pends.append(_prepare(st, kind, a, _group_name(gid[0], i, len(arrays)), process_set, inplace, flush,
                                  site=site, group=gid, **fields))
    except BaseException as e:  # the members made so far never reach the caller: their handles go
        st.engine.handles.discard(*(p.handle.id for p in pends))
        if isinstance(e, (HoraValueError, NotSupportedError)):
            refused_group(kind, e, len(arrays), name, process_set, gid=gid,
                          taken=tuple(p.req.name for p in pends))
        raise
    _submit_or_discard(st, *pends)
    return _group([p.handle.id for p in pends])


def grouped_allreduce_async(arrays, op: int = Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, name: str | None = None,
                            process_set: ProcessSet = global_process_set, *, layout: int = 0) -> int:
    """Allreduce several arrays as one unit (negotiated together, fused together); ``layout`` as in
    :func:`grouped_allreduce`."""
    return _grouped(m.ALLREDUCE, arrays, name, False, process_set,
                    reduce=(op, prescale_factor, postscale_factor, "allreduce"),
                    **({"layout": int(layout)} if layout else {}))


def _reduce_fields(op, pre, post, what) -> dict:
    if type(pre) is float and type(post) is float and pre == post == 1.0 and op in _PLAIN_OPS:
        return {"op": op, "pre": 1.0, "post": 1.0}  # the usual call, with nothing to check (a hot path)
    return {"op": check_op(op, what), "pre": _factor(pre, "prescale_factor", what),
            "post": _factor(post, "postscale_factor", what)}


def grouped_allreduce_async_(arrays, op: int = Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, name: str | None = None,
                             process_set: ProcessSet = global_process_set) -> int:
    return _grouped(m.ALLREDUCE, arrays, name, False, process_set, inplace=True,
                    reduce=(op, prescale_factor, postscale_factor, "allreduce_"))


def grouped_allreduce(arrays, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set, *,
                      layout: int = 0) -> list:
    """``layout``: the digest of what a binding packed into these buffers (:attr:`hora.kit.packing.Packing.
    layout`), compared across ranks as a shape is, so that ranks whose packed tensors differ get a
    MismatchError rather than reduce unrelated numbers together."""
    return synchronize(_grouped(m.ALLREDUCE, arrays, name, True, process_set,
                                reduce=(op, prescale_factor, postscale_factor, "allreduce"),
                                **({"layout": int(layout)} if layout else {})))


def grouped_allreduce_(arrays, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(_grouped(m.ALLREDUCE, arrays, name, True, process_set, inplace=True,
                                reduce=(op, prescale_factor, postscale_factor, "allreduce_")))


# -- allgather -----------------------------------------------------------------------------------
@_refusing(m.ALLGATHER)
def allgather_async(array, name: str | None = None, process_set: ProcessSet = global_process_set, *,
                    _flush: bool = False) -> int:
    """Start an allgather; ``synchronize`` returns every rank's rows concatenated in rank order."""
    return _submit(m.ALLGATHER, array, name, process_set, flush=_flush)


def allgather(array, name: str | None = None, process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Concatenate every rank's ``array`` along the first dimension (which may differ per rank)."""
    return synchronize(allgather_async(array, name, process_set, _flush=True))


def grouped_allgather_async(arrays, name: str | None = None, process_set: ProcessSet = global_process_set) -> int:
    return _grouped(m.ALLGATHER, arrays, name, False, process_set)


def grouped_allgather(arrays, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(_grouped(m.ALLGATHER, arrays, name, True, process_set))


# -- broadcast -----------------------------------------------------------------------------------
@_refusing(m.BROADCAST)
def broadcast_async(array, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    return _submit(m.BROADCAST, array, name, process_set, flush=_flush,
                   root=_root(root_rank, process_set, "broadcast"))


@_refusing(m.BROADCAST)
def broadcast_async_(array: np.ndarray, root_rank: int, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    return _submit(m.BROADCAST, array, name, process_set, inplace=True, flush=_flush,
                   root=_root(root_rank, process_set, "broadcast_"))


def broadcast(array, root_rank: int, name: str | None = None,
              process_set: ProcessSet = global_process_set) -> np.ndarray:
    """Return a new array holding ``root_rank``'s ``array`` on every rank."""
    return synchronize(broadcast_async(array, root_rank, name, process_set, _flush=True))


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None,
               process_set: ProcessSet = global_process_set) -> np.ndarray:
    """In-place :func:`broadcast`; returns ``array``."""
    return synchronize(broadcast_async_(array, root_rank, name, process_set, _flush=True))


# -- alltoall ------------------------------------------------------------------------------------
@_refusing(m.ALLTOALL)
def alltoall_async(array, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    st = state()
    n = len(st.engine.process_sets[_ps_id(process_set, st, m.ALLTOALL)])
    a = array if type(array) in (np.ndarray, DeviceArray) else (as_device_array(array, what=m.ALLTOALL)
                                                                 or _as_array(array, m.ALLTOALL, False))
    if a.ndim == 0:
        raise HoraValueError("alltoall: a scalar cannot be split; give an array with a first dimension")
    if splits is None:
        if a.shape[0] % n:
            raise HoraValueError(f"alltoall: the first dimension {a.shape[0]} does not divide evenly among {n} "
                                 "ranks; pass splits=")
        rows = (a.shape[0] // n,) * n
        finish = _first
    else:
        rows = _splits(splits, n)
        if len(rows) != n or min(rows, default=0) < 0 or sum(rows) != a.shape[0]:
            raise HoraValueError(f"alltoall: splits {list(rows)} must have one non-negative entry per rank ({n}) "
                                 f"summing to the first dimension {a.shape[0]}")
        finish = None
    return _submit(m.ALLTOALL, a, name, process_set, flush=_flush, finish=finish, splits=rows)


def _splits(splits, n: int) -> tuple[int, ...]:
    """``splits`` as a tuple of ints: a 1-D sequence of whole numbers (floats that are not whole are
    refused, not truncated: a truncated split would send rows to the wrong rank)."""
    try:
        s = np.asarray(splits)
    except Exception as e:  # noqa: BLE001
        raise HoraValueError(f"alltoall: splits {splits!r} is not a sequence of integers: {e}") from e
    if s.ndim != 1 or s.dtype.kind not in "iuf":
        raise HoraValueError(f"alltoall: splits must be a 1-D sequence of integers, one per rank ({n}); "
                             f"got {splits!r}")
    if s.dtype.kind == "f" and not (np.isfinite(s).all() and (s == np.floor(s)).all()):
        raise HoraValueError(f"alltoall: splits {s.tolist()} are not whole numbers; pass integers (hora does not "
                             "round them)")
    return tuple(int(x) for x in s)


def _first(result):
    return result[0]


def alltoall(array, splits=None, name: str | None = None, process_set: ProcessSet = global_process_set):
    """Send ``splits[p]`` rows of ``array`` to rank ``p`` (equal parts without ``splits``); returns the rows
    received, concatenated in rank order, plus the received splits when ``splits`` is given."""
    return synchronize(alltoall_async(array, splits, name, process_set, _flush=True))


# -- reducescatter -------------------------------------------------------------------------------
@_refusing(m.REDUCESCATTER)
def reducescatter_async(array, op: int = Average, name: str | None = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, _flush: bool = False) -> int:
    return _submit(m.REDUCESCATTER, array, name, process_set, flush=_flush,
                   **_reduce_fields(op, prescale_factor, postscale_factor, "reducescatter"))


def reducescatter(array, op: int = Average, name: str | None = None, process_set: ProcessSet = global_process_set,
                  prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``array`` over all ranks and return this rank's rows of the result (the first dimension
    is split so that the lowest ranks get one extra row when it does not divide evenly)."""
    return synchronize(reducescatter_async(array, op, name, process_set, prescale_factor, postscale_factor,
                                           _flush=True))


def grouped_reducescatter_async(arrays, op: int = Average, name: str | None = None,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    return _grouped(m.REDUCESCATTER, arrays, name, False, process_set,
                    reduce=(op, prescale_factor, postscale_factor, "reducescatter"))


def grouped_reducescatter(arrays, op: int = Average, name: str | None = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    return synchronize(_grouped(m.REDUCESCATTER, arrays, name, True, process_set,
                                reduce=(op, prescale_factor, postscale_factor, "reducescatter")))


# -- barrier, join ---------------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    ps = _ps_id(process_set, state(), "barrier")
    synchronize(_submit(m.BARRIER, None, _auto_name(None, ps, "barrier"), process_set, flush=True))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data: until every rank has joined, it takes part in other
    ranks' allreduces with the op's neutral element (zeros for Sum and Average, as in Horovod; for Min,
    Max and Product the result is then the reduction over the ranks that did not join). Returns the
    last rank to join, the same on every rank."""
    last = synchronize(_submit(m.JOIN, None, "join", global_process_set, flush=True))
    names.new_epoch(state().names)
    return last


# -- objects -------------------------------------------------------------------------------------
def _agree(what: str, err: Exception | None, text: bytes, name: str | None, process_set: ProcessSet,
           ranks: tuple[int, ...]) -> None:
    """After unpickling: raise on every rank if it failed on any (``err``, described by ``text``, is this
    rank's failure). The common case costs one small allreduce of a flag (rank 0 reduces it inline); the
    error texts travel only when a flag is set."""
    flag = allreduce(np.array([err is not None], np.int32), op=Sum, name=_part(name, "status"),
                     process_set=process_set)
    if not flag[0]:
        return
    texts = allgather(_record(_FAILED if err is not None else _OK, text), _part(name, "errors"), process_set)
    if err is not None:
        raise err
    raise _failure(what, {r: t for r, (s, t) in zip(ranks, _records(texts)) if s == _FAILED})


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None,
                     process_set: ProcessSet = global_process_set):
    """Return ``root_rank``'s ``obj`` (anything cloudpickle can serialise) on every rank.

    If the root cannot pickle ``obj`` it raises that error and every other rank raises an
    :class:`InternalError` naming the root and the error; if a rank cannot unpickle it, that rank
    raises its error and the others an InternalError naming it. hora stays usable either way."""
    import cloudpickle

    st = state()
    root_rank = _root(root_rank, process_set, "broadcast_object")
    is_root = st.topo.rank == root_rank
    body, err = _pickle(obj) if is_root else (b"", None)
    header = np.array([err is not None, len(body)], np.int64)
    header = broadcast(header, root_rank, _part(name, "len"), process_set)
    data = np.frombuffer(body, np.uint8) if is_root else np.empty(int(header[1]), np.uint8)
    data = broadcast(data, root_rank, _part(name, "data"), process_set)
    if header[0]:
        if is_root:
            raise err
        raise _failure("broadcast_object", {root_rank: data})
    result, err, text = obj, None, b""
    if not is_root:
        try:
            result = cloudpickle.loads(data.tobytes())
        except Exception as e:
            err, text = e, _describe(f"unpickle the object from rank {root_rank}", e)
    _agree("broadcast_object", err, text, name, process_set, st.engine.process_sets[process_set.process_set_id])
    return result


def allgather_object(obj, name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Return the list of every rank's ``obj``, in rank order.

    A rank that cannot pickle its ``obj`` (or unpickle another's) raises that error; the others raise
    an :class:`InternalError` naming it and the error. hora stays usable either way."""
    import cloudpickle

    body, err = _pickle(obj)
    data = allgather(_record(_FAILED if err is not None else _OK, body), _part(name, "data"), process_set)
    records = _records(data)
    ranks = state().engine.process_sets[process_set.process_set_id]
    failed = {r: b for r, (s, b) in zip(ranks, records) if s == _FAILED}
    if failed:
        if err is not None:
            raise err
        raise _failure("allgather_object", failed)
    out, err, text = [], None, b""
    for r, (_, b) in zip(ranks, records):
        try:
            out.append(cloudpickle.loads(b))
        except Exception as e:
            err, text = e, _describe(f"unpickle the object from rank {r}", e)
            break
    _agree("allgather_object", err, text, name, process_set, ranks)
    return out
