"""The collectives on NumPy arrays: the core API every framework binding calls.

Shaped like Horovod's torch API. Every collective has an asynchronous form that returns a handle
(an int) at once; the synchronous form is ``synchronize(<op>_async(...))``. Out-of-place forms
return a new array owned by the caller and never touch their input; in-place forms (``allreduce_``,
``broadcast_``) write into the array they are given, which is undefined if the collective fails.
"""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from hora.base.errors import HoraValueError, NotSupportedError
from hora.collectives.reduce import OP_NAMES, Adasum, Average, Max, Min, Product, Sum, check_dtype
from hora.core import messages as m
from hora.core.basics import state
from hora.core.execute import Pending
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_", "allreduce_async",
           "allreduce_async_", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
           "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
           "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_",
           "alltoall", "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter",
           "grouped_reducescatter_async", "barrier", "join", "poll", "synchronize", "broadcast_object",
           "allgather_object"]

_groups = itertools.count()
_name_lock = threading.Lock()


def _auto_name(name: str | None, ps: int = 0) -> str:
    """Unnamed ops are numbered in submission order within their process set, so the ranks of a
    set match them by that order (an unnamed op on a subset does not shift the global numbering)."""
    if name is not None:
        return str(name)
    with _name_lock:  # the counters live in the initialisation: every rank starts from 0 at init()
        counter = state().names.setdefault(ps, itertools.count())
        return f"noname.{next(counter)}"


def check_op(op: int, what: str) -> int:
    """``op`` if hora can reduce with it; the one place that refuses Adasum (bindings call it too)."""
    if op == Adasum:
        raise NotSupportedError(f"{what}: op=Adasum is not implemented in hora yet; use op=Average (the default) "
                                "or Sum")
    if op not in OP_NAMES:
        raise HoraValueError(f"{what}: unknown op {op!r}; use one of "
                             + ", ".join(f"hora.{n} ({v})" for v, n in OP_NAMES.items() if v != Adasum))
    return op


def _ps_id(process_set: ProcessSet, st, what: str) -> int:
    pid = process_set.process_set_id
    ranks = st.engine.process_sets.get(pid) if pid is not None else None
    if ranks is None:
        raise HoraValueError(f"{what}: {process_set} is not registered on this rank; add it with "
                             "hora.add_process_set() or hora.init(process_sets=[...])")
    if st.topo.rank not in ranks:
        raise HoraValueError(f"{what}: rank {st.topo.rank} is not in process set {pid} (ranks {list(ranks)}); "
                             "only its members may run collectives on it")
    return pid


def _submit(kind: str, array, name, process_set, inplace=False, flush=False, finish=None, **fields) -> int:
    st = state()
    pend = _prepare(st, kind, array, name, process_set, inplace, flush, finish, **fields)
    st.engine.submit(pend)
    return pend.handle.id


def _prepare(st, kind: str, array, name, process_set, inplace=False, flush=False, finish=None,
             **fields) -> Pending:
    ps = _ps_id(process_set, st, kind)
    a = None
    if array is not None:
        a = array if type(array) is np.ndarray else np.asarray(array)
        dtype = check_dtype(a.dtype, kind)
        if kind in (m.ALLGATHER, m.ALLTOALL, m.REDUCESCATTER) and a.ndim == 0:
            raise HoraValueError(f"{kind}: a scalar has no first dimension; reshape it to (1,)")
        if inplace and not a.flags.writeable:
            raise HoraValueError(f"{kind}_: the array is read-only; use the out-of-place {kind}()")
        if not a.flags.c_contiguous:
            user = a
            a = np.ascontiguousarray(a)
            if inplace:
                finish = _copy_back(user, finish)
        fields.setdefault("dtype", dtype)
        fields.setdefault("shape", a.shape)
    full = _auto_name(name, ps)
    req = (m.SetRequest if kind in (m.ADD_PS, m.REMOVE_PS) else m.Request)(full, kind, ps=ps, **fields)
    handle = st.engine.handles.new(f"{kind}.{full}", finish)
    return Pending(req, handle, a, inplace, flush)


def _copy_back(user: np.ndarray, finish):
    def done(result):
        user[...] = result
        return finish(user) if finish else user
    return done


def _root(root_rank, process_set, what) -> int:
    st = state()
    ranks = st.engine.process_sets.get(process_set.process_set_id, ())
    if not isinstance(root_rank, (int, np.integer)) or int(root_rank) not in ranks:
        raise HoraValueError(f"{what}: root_rank {root_rank!r} is not a rank of the process set (ranks "
                             f"{list(ranks)}); root_rank is a global rank")
    return int(root_rank)


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
    if handle in st.groups:
        members = st.groups.pop(handle)
        return [st.engine.handles.synchronize(h) for h in members]
    return st.engine.handles.synchronize(handle)


def _group(handles: list[int]) -> int:
    st = state()
    gid = -1 - next(_groups)  # negative: never collides with a single handle
    st.groups[gid] = handles
    return gid


def _group_name(name, i, n):
    return None if name is None else f"{name}.{i}" if n > 1 else str(name)


# -- allreduce -----------------------------------------------------------------------------------
def allreduce_async(array, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    name: str | None = None, process_set: ProcessSet = global_process_set, *,
                    _flush: bool = False) -> int:
    """Start an allreduce of ``array``; ``synchronize`` returns a new array."""
    check_op(op, "allreduce")
    return _submit(m.ALLREDUCE, array, name, process_set, flush=_flush, op=op, pre=float(prescale_factor),
                   post=float(postscale_factor))


def allreduce_async_(array: np.ndarray, op: int = Average, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0, name: str | None = None,
                     process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    """Start an in-place allreduce; ``synchronize`` returns ``array``, reduced."""
    check_op(op, "allreduce_")
    return _submit(m.ALLREDUCE, array, name, process_set, inplace=True, flush=_flush, op=op,
                   pre=float(prescale_factor), post=float(postscale_factor))


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


def _grouped(kind: str, arrays, name, flush, process_set, inplace=False, **fields) -> int:
    """Submit several tensors as one unit: negotiated together (in one message), released together
    and fused together. A named group keeps the same id every step, so it hits the response cache."""
    st = state()
    arrays = list(arrays)
    pid = process_set.process_set_id
    gid = (str(name) if name is not None else f"group.{_auto_name(None, pid)}", len(arrays))
    pends = [_prepare(st, kind, a, _group_name(name, i, len(arrays)), process_set, inplace, flush, group=gid,
                      **fields) for i, a in enumerate(arrays)]
    st.engine.submit(*pends)
    return _group([p.handle.id for p in pends])


def grouped_allreduce_async(arrays, op: int = Average, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, name: str | None = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """Allreduce several arrays as one unit (negotiated together, fused together)."""
    return _grouped(m.ALLREDUCE, arrays, name, False, process_set, **_reduce_fields(op, prescale_factor,
                                                                                   postscale_factor, "allreduce"))


def _reduce_fields(op, pre, post, what) -> dict:
    return {"op": check_op(op, what), "pre": float(pre), "post": float(post)}


def grouped_allreduce_async_(arrays, op: int = Average, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, name: str | None = None,
                             process_set: ProcessSet = global_process_set) -> int:
    return _grouped(m.ALLREDUCE, arrays, name, False, process_set, inplace=True,
                    **_reduce_fields(op, prescale_factor, postscale_factor, "allreduce_"))


def grouped_allreduce(arrays, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(_grouped(m.ALLREDUCE, arrays, name, True, process_set,
                                **_reduce_fields(op, prescale_factor, postscale_factor, "allreduce")))


def grouped_allreduce_(arrays, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    return synchronize(_grouped(m.ALLREDUCE, arrays, name, True, process_set, inplace=True,
                                **_reduce_fields(op, prescale_factor, postscale_factor, "allreduce_")))


# -- allgather -----------------------------------------------------------------------------------
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
def broadcast_async(array, root_rank: int, name: str | None = None,
                    process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    return _submit(m.BROADCAST, array, name, process_set, flush=_flush,
                   root=_root(root_rank, process_set, "broadcast"))


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
def alltoall_async(array, splits=None, name: str | None = None,
                   process_set: ProcessSet = global_process_set, *, _flush: bool = False) -> int:
    a = np.asarray(array)
    n = len(state().engine.process_sets.get(process_set.process_set_id, ())) or 1
    if a.ndim == 0:
        raise HoraValueError("alltoall: a scalar cannot be split; give an array with a first dimension")
    if splits is None:
        if a.shape[0] % n:
            raise HoraValueError(f"alltoall: the first dimension {a.shape[0]} does not divide evenly among {n} "
                                 "ranks; pass splits=")
        rows = (a.shape[0] // n,) * n
        finish = _first
    else:
        rows = tuple(int(x) for x in np.asarray(splits).reshape(-1))
        if len(rows) != n or min(rows, default=0) < 0 or sum(rows) != a.shape[0]:
            raise HoraValueError(f"alltoall: splits {list(rows)} must have one non-negative entry per rank ({n}) "
                                 f"summing to the first dimension {a.shape[0]}")
        finish = None
    return _submit(m.ALLTOALL, a, name, process_set, flush=_flush, finish=finish, splits=rows)


def _first(result):
    return result[0]


def alltoall(array, splits=None, name: str | None = None, process_set: ProcessSet = global_process_set):
    """Send ``splits[p]`` rows of ``array`` to rank ``p`` (equal parts without ``splits``); returns the rows
    received, concatenated in rank order, plus the received splits when ``splits`` is given."""
    return synchronize(alltoall_async(array, splits, name, process_set, _flush=True))


# -- reducescatter -------------------------------------------------------------------------------
def reducescatter_async(array, op: int = Average, name: str | None = None,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0, *, _flush: bool = False) -> int:
    check_op(op, "reducescatter")
    return _submit(m.REDUCESCATTER, array, name, process_set, flush=_flush, op=op, pre=float(prescale_factor),
                   post=float(postscale_factor))


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
                    **_reduce_fields(op, prescale_factor, postscale_factor, "reducescatter"))


def grouped_reducescatter(arrays, op: int = Average, name: str | None = None,
                          process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                          postscale_factor: float = 1.0) -> list:
    return synchronize(_grouped(m.REDUCESCATTER, arrays, name, True, process_set,
                                **_reduce_fields(op, prescale_factor, postscale_factor, "reducescatter")))


# -- barrier, join ---------------------------------------------------------------------------------
def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank of the process set has called barrier()."""
    st = state()
    n = st.barriers[process_set.process_set_id] = st.barriers.get(process_set.process_set_id, 0) + 1
    synchronize(_submit(m.BARRIER, None, f"barrier.{n}", process_set, flush=True))


def join(device: int = -1) -> int:
    """Declare that this rank has no more data: until every rank has joined, it takes part in other
    ranks' allreduces with zeros. Returns the last rank to join, the same on every rank."""
    return synchronize(_submit(m.JOIN, None, "join", global_process_set, flush=True))


# -- objects -------------------------------------------------------------------------------------
# An object travels as a record: a status byte, its length (8 bytes) and the pickled bytes, or, when
# pickling failed, the error's text. Every rank takes part in every collective below whatever happened
# on it, so a rank that cannot pickle or unpickle raises its own exception, its peers raise an
# InternalError naming it and its cause, and the next collective finds every rank in step.
_OK, _FAILED = 0, 1
_HEADER = 9
_ERROR_TEXT = 500  # characters of a failing rank's error sent to its peers


def _record(status: int, body: bytes) -> np.ndarray:
    return np.frombuffer(bytes([status]) + len(body).to_bytes(8, "little") + body, np.uint8)


def _records(data: np.ndarray) -> list[tuple[int, memoryview]]:
    """The records of an allgather of records, in rank order (views into ``data``, not copies)."""
    raw, out, i = memoryview(data), [], 0
    while i < len(raw):
        n = int.from_bytes(raw[i + 1:i + _HEADER], "little")
        out.append((raw[i], raw[i + _HEADER:i + _HEADER + n]))
        i += _HEADER + n
    return out


def _describe(doing: str, e: BaseException) -> bytes:
    return f"{doing}: {type(e).__name__}: {e}"[:_ERROR_TEXT].encode("utf-8", "replace")


def _pickle(obj) -> tuple[bytes, Exception | None]:
    """(the pickled bytes, None), or (the error's text, the error) when ``obj`` cannot be pickled."""
    import cloudpickle

    try:
        return cloudpickle.dumps(obj), None
    except Exception as e:  # whatever __reduce__ or a member's pickling raised; BaseException goes by
        return _describe("pickle its object", e), e


def _part(name: str | None, part: str) -> str | None:
    return None if name is None else f"{name}.{part}"


def _failure(what: str, failed: dict):
    """The error for a rank whose peers ``failed`` (global rank -> what went wrong there)."""
    from hora.base.errors import InternalError

    named = "; ".join(f"rank {r} could not {bytes(t).decode('utf-8', 'replace')}" for r, t in failed.items())
    return InternalError(f"{what}: {named} (that rank raised the error itself; hora is still usable)")


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
