"""The collectives on NumPy arrays: the core API every framework binding calls.

Shaped like Horovod's torch API. Out-of-place forms return a new array owned by the caller and
never touch their input; in-place forms (``allreduce_``, ``broadcast_``) write into the array they
are given, which is undefined if the collective fails (the error says so).
"""

from __future__ import annotations

import numpy as np

from hora.collectives import exchange, ring
from hora.collectives.reduce import (OP_NAMES, Adasum, Average, Max, Min, Product, Sum, check_dtype,
                                     reducer, scale, MOVABLE)
from hora.common.basics import state
from hora.common.errors import HoraError, HoraValueError, InternalError, PeerLostError

__all__ = ["Average", "Sum", "Adasum", "Min", "Max", "Product", "allreduce", "allreduce_", "allgather",
           "broadcast", "broadcast_", "alltoall", "reducescatter", "barrier", "broadcast_object",
           "allgather_object"]

_MAX_DIMS = 14
_DTYPE_INDEX = {name: i for i, name in enumerate(MOVABLE)}
_scratch = ring.Scratch()


def _check_op(op: int, what: str) -> int:
    if op == Adasum:
        raise NotImplementedError(f"{what}: op=Adasum is not implemented yet; use Average or Sum")
    if op not in OP_NAMES:
        raise HoraValueError(f"{what}: unknown op {op!r}; use one of "
                             + ", ".join(f"hora.{n} ({v})" for v, n in OP_NAMES.items() if v != Adasum))
    return op


def _array(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    check_dtype(a.dtype, what)
    return a


class _Collective:
    """Runs one collective on the communicator, holding the lock, and turns a failure into the
    error every rank sees: the note in the store tells peers which rank failed first."""

    def __init__(self, what: str, inplace: bool = False):
        self.what, self.inplace = what, inplace

    def __enter__(self):
        self.st = state()
        self.st.lock.acquire()
        broken = getattr(self.st.comm, "broken", None)
        if broken is not None:
            self.st.lock.release()
            raise broken
        return self.st.comm

    def __exit__(self, typ, exc, tb):
        self.st.lock.release()
        if exc is None or not isinstance(exc, (InternalError, OSError)):
            return False
        if isinstance(exc, PeerLostError) and self.st.store is not None:
            self._leave_note(exc)
        abort = getattr(self.st.comm, "abort", None)
        if abort is not None:
            abort(exc)
        if self.inplace:
            exc.args = (f"{exc.args[0] if exc.args else exc}; the in-place buffer of {self.what} is undefined",)
        return False

    def _leave_note(self, exc: PeerLostError) -> None:
        key = f"{self.st.prefix}/abort"
        try:
            if not self.st.store.check(key):
                self.st.store.set(key, f"{exc.rank}|rank {exc.rank} was lost (first noticed by rank "
                                       f"{self.st.topo.rank})".encode())
        except HoraError:
            pass


def _allreduce_flat(comm, flat: np.ndarray, op: int, prescale: float, postscale: float) -> None:
    if op == Average:
        postscale = postscale * (1.0 / comm.size)  # Horovod folds the average into the postscale
    scale(flat, prescale)
    ring.allreduce(comm, flat, reducer(op), finish=lambda seg: scale(seg, postscale), scratch=_scratch)


def allreduce(array, op: int = Average, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
              name: str | None = None) -> np.ndarray:
    """Reduce ``array`` over all ranks; returns a new array, the same bits on every rank.

    >>> hora.allreduce(np.full(4, hora.rank(), np.float32), op=hora.Sum)   # at np=3
    array([3., 3., 3., 3.], dtype=float32)
    """
    a = _array(array, "allreduce")
    _check_op(op, "allreduce")
    out = np.array(a, order="C", copy=True)
    with _Collective("allreduce") as comm:
        _allreduce_flat(comm, out.reshape(-1), op, prescale_factor, postscale_factor)
    return out


def allreduce_(array: np.ndarray, op: int = Average, prescale_factor: float = 1.0,
               postscale_factor: float = 1.0, name: str | None = None) -> np.ndarray:
    """In-place :func:`allreduce`; returns ``array``."""
    a = _array(array, "allreduce_")
    _check_op(op, "allreduce_")
    if not a.flags.writeable:
        raise HoraValueError("allreduce_: the array is read-only; use allreduce()")
    work = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    with _Collective("allreduce_", inplace=True) as comm:
        _allreduce_flat(comm, work.reshape(-1), op, prescale_factor, postscale_factor)
    if work is not a:
        a[...] = work
    return a


def _headers(comm, a: np.ndarray, what: str) -> np.ndarray:
    """Allgather ``[ndim, dtype, shape...]`` of every rank (a ``size x 16`` int64 table)."""
    if a.ndim > _MAX_DIMS:
        raise HoraValueError(f"{what}: at most {_MAX_DIMS} dimensions are supported, got {a.ndim}")
    mine = np.full(_MAX_DIMS + 2, -1, np.int64)
    mine[0], mine[1], mine[2:2 + a.ndim] = a.ndim, _DTYPE_INDEX[a.dtype.name], a.shape
    table = np.empty((comm.size, mine.size), np.int64)
    exchange.allgather_blocks(comm, mine, table.reshape(-1), [i * mine.size for i in range(comm.size + 1)])
    return table


def _describe(row: np.ndarray) -> tuple[tuple[int, ...], str]:
    return tuple(int(d) for d in row[2:2 + int(row[0])]), str(MOVABLE[int(row[1])])


def _check_trailing(table: np.ndarray, rank: int, what: str) -> None:
    """Every rank's dtype and all dims but the first must equal ours; name the first rank that differs."""
    mine = table[rank]
    for p, row in enumerate(table):
        if row[0] != mine[0] or row[1] != mine[1] or (row[3:] != mine[3:]).any():
            (s1, d1), (s0, d0) = _describe(row), _describe(mine)
            raise HoraValueError(f"{what}: rank {p} sent shape {s1} {d1}, rank {rank} sent {s0} {d0}; "
                                 "all dimensions but the first and the dtype must match on every rank")


def allgather(array, name: str | None = None) -> np.ndarray:
    """Concatenate every rank's ``array`` along the first dimension (which may differ per rank)."""
    a = _array(array, "allgather")
    if a.ndim == 0:
        raise HoraValueError("allgather: a scalar has no first dimension to concatenate; reshape it to (1,)")
    a = np.ascontiguousarray(a)
    with _Collective("allgather") as comm:
        table = _headers(comm, a, "allgather")
        _check_trailing(table, comm.rank, "allgather")
        rows = table[:, 2]
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        out = np.empty((int(rows.sum()),) + a.shape[1:], a.dtype)
        bounds = [0] + list(np.cumsum(rows * row))
        exchange.allgather_blocks(comm, a.reshape(-1), out.reshape(-1), [int(b) for b in bounds])
    return out


def _check_root(root_rank: int, size: int, what: str) -> int:
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < size:
        raise HoraValueError(f"{what}: root_rank {root_rank!r} is not a rank of this job (size {size})")
    return int(root_rank)


def broadcast(array, root_rank: int, name: str | None = None) -> np.ndarray:
    """Return a new array holding ``root_rank``'s ``array`` on every rank."""
    a = _array(array, "broadcast")
    out = np.array(a, order="C", copy=True)
    with _Collective("broadcast") as comm:
        exchange.broadcast(comm, out.reshape(-1), _check_root(root_rank, comm.size, "broadcast"))
    return out


def broadcast_(array: np.ndarray, root_rank: int, name: str | None = None) -> np.ndarray:
    """In-place :func:`broadcast`; returns ``array``."""
    a = _array(array, "broadcast_")
    if not a.flags.writeable:
        raise HoraValueError("broadcast_: the array is read-only; use broadcast()")
    work = a if a.flags.c_contiguous else np.ascontiguousarray(a)
    with _Collective("broadcast_", inplace=True) as comm:
        exchange.broadcast(comm, work.reshape(-1), _check_root(root_rank, comm.size, "broadcast_"))
    if work is not a:
        a[...] = work
    return a


def alltoall(array, splits=None, name: str | None = None):
    """Send ``splits[p]`` rows of ``array`` to rank ``p`` (equal parts without ``splits``); returns the
    rows received, concatenated in rank order, plus the received splits when ``splits`` is given."""
    a = _array(array, "alltoall")
    if a.ndim == 0:
        raise HoraValueError("alltoall: a scalar cannot be split; give an array with a first dimension")
    a = np.ascontiguousarray(a)
    st = state()
    n = st.topo.size
    if splits is None:
        if a.shape[0] % n:
            raise HoraValueError(f"alltoall: the first dimension {a.shape[0]} does not divide evenly "
                                 f"among {n} ranks; pass splits=")
        send_rows = np.full(n, a.shape[0] // n, np.int64)
    else:
        send_rows = np.asarray(splits, dtype=np.int64).reshape(-1)
        if send_rows.size != n or (send_rows < 0).any() or send_rows.sum() != a.shape[0]:
            raise HoraValueError(f"alltoall: splits {send_rows.tolist()} must have one non-negative entry per "
                                 f"rank ({n}) summing to the first dimension {a.shape[0]}")
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    with _Collective("alltoall") as comm:
        table = _headers(comm, a, "alltoall")
        _check_trailing(table, comm.rank, "alltoall")
        recv_rows = np.empty(n, np.int64)
        exchange.alltoall_blocks(comm, send_rows, list(range(n + 1)), recv_rows, list(range(n + 1)))
        out = np.empty((int(recv_rows.sum()),) + a.shape[1:], a.dtype)
        sb = [0] + [int(x) for x in np.cumsum(send_rows * row)]
        rb = [0] + [int(x) for x in np.cumsum(recv_rows * row)]
        exchange.alltoall_blocks(comm, a.reshape(-1), sb, out.reshape(-1), rb)
    return out if splits is None else (out, recv_rows.astype(np.int32))


def reducescatter(array, op: int = Average, name: str | None = None, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> np.ndarray:
    """Reduce ``array`` over all ranks and return this rank's rows of the result (the first dimension
    is split so that the lowest ranks get one extra row when it does not divide evenly)."""
    a = _array(array, "reducescatter")
    _check_op(op, "reducescatter")
    if a.ndim == 0:
        raise HoraValueError("reducescatter: a scalar cannot be scattered; give an array with a first dimension")
    buf = np.array(a, order="C", copy=True).reshape(-1)
    with _Collective("reducescatter") as comm:
        n, r = comm.size, comm.rank
        rows = ring.even_bounds(a.shape[0], n)
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        bounds = [b * row for b in rows]
        scale(buf, prescale_factor)
        ring.reduce_scatter(comm, buf, bounds, reducer(op), _scratch)
    mine = buf[bounds[r]:bounds[r + 1]].copy()
    scale(mine, postscale_factor * (1.0 / n if op == Average else 1.0))
    return mine.reshape((rows[r + 1] - rows[r],) + a.shape[1:])


def barrier() -> None:
    """Return once every rank has called barrier()."""
    with _Collective("barrier") as comm:
        exchange.barrier(comm)


def broadcast_object(obj=None, root_rank: int = 0, name: str | None = None):
    """Return ``root_rank``'s ``obj`` (any cloudpickle-able object) on every rank."""
    import cloudpickle

    st = state()
    root = _check_root(root_rank, st.topo.size, "broadcast_object")
    payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8) if st.topo.rank == root else None
    length = broadcast(np.array([0 if payload is None else payload.size], np.int64), root)
    data = payload if payload is not None else np.empty(int(length[0]), np.uint8)
    data = broadcast(data, root)
    return obj if st.topo.rank == root else cloudpickle.loads(data.tobytes())


def allgather_object(obj, name: str | None = None) -> list:
    """Return the list of every rank's ``obj``, in rank order."""
    import cloudpickle

    payload = np.frombuffer(cloudpickle.dumps(obj), np.uint8)
    lengths = allgather(np.array([payload.size], np.int64))
    data = allgather(payload)
    offsets = [0] + [int(x) for x in np.cumsum(lengths)]
    return [cloudpickle.loads(data[offsets[i]:offsets[i + 1]].tobytes()) for i in range(len(lengths))]
