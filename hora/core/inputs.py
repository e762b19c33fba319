"""What the core accepts: every check of a caller's input, made on the rank that made the call, before its
collective takes a name (:func:`hora.core.ops._prepare`), so bad input raises at once in the caller and the
peers hear only that it was refused (:mod:`hora.core.refusal`).
"""

from __future__ import annotations

import math

import numpy as np

from hora.base.errors import HoraValueError, NotSupportedError
from hora.collectives.reduce import OP_NAMES, Adasum
from hora.core.process_sets import ProcessSet
from hora.core.session import state
from hora.engine import messages as m


def check_op(op: int, what: str) -> int:
    """``op`` if hora can reduce with it for ``what`` (bindings call it too). Adasum combines whole
    vectors, so a reducescatter (each rank keeping a slice) cannot use it, as in Horovod."""
    if op not in OP_NAMES:
        raise HoraValueError(f"{what}: unknown op {op!r}; use one of "
                             + ", ".join(f"hora.{n} ({v})" for v, n in OP_NAMES.items()))
    if op == Adasum and "reducescatter" in what.lower():
        raise NotSupportedError(f"{what}: op=Adasum is not supported by reducescatter (Adasum combines whole "
                                "vectors); use op=Sum or Average, or allreduce(op=Adasum)")
    return op


def ps_id(process_set: ProcessSet, st, what: str) -> int:
    if not isinstance(process_set, ProcessSet):
        raise HoraValueError(f"{what}: process_set must be a hora.ProcessSet, got {type(process_set).__name__}; "
                             "register one with hora.add_process_set([...]) and pass what it returns")
    pid = process_set.process_set_id
    ranks = st.engine.process_sets.get(pid) if pid is not None else None
    if ranks is None:
        raise HoraValueError(f"{what}: {process_set} is not registered on this rank; add it with "
                             "hora.add_process_set() or hora.init(process_sets=[...])")
    if st.topo.rank not in ranks:
        raise HoraValueError(f"{what}: rank {st.topo.rank} is not in process set {pid} (ranks {list(ranks)}); "
                             "only its members may run collectives on it")
    return pid


DATA_KINDS = frozenset({m.ALLREDUCE, m.ALLGATHER, m.BROADCAST, m.ALLTOALL, m.REDUCESCATTER})
# A view with a zero stride (np.broadcast_to, torch's expand) is copied to contiguous memory before
# it is sent. Up to this size that copy is harmless; past it a few bytes of data would turn into a
# huge allocation (a 16 GiB copy of a 4-byte array), so such views are refused with the way out.
EXPAND_LIMIT = 256 << 20


def as_array(array, kind: str, inplace: bool) -> np.ndarray:
    """``array`` as a NumPy array, or a HoraValueError that says what to pass instead."""
    if array is None:
        raise HoraValueError(f"{kind}: got None; pass a NumPy array (or a number or list NumPy can convert)")
    if inplace and not isinstance(array, np.ndarray):
        raise HoraValueError(f"{kind}_: got {type(array).__name__}; the in-place form writes its result into a "
                             f"NumPy array, so pass one (or use the out-of-place {kind}(), which returns it)")
    try:
        a = np.asarray(array)
    except Exception as e:  # noqa: BLE001 - whatever NumPy refuses, the caller learns why
        raise HoraValueError(f"{kind}: cannot make a NumPy array of the {type(array).__name__} given: {e}") from e
    if a.dtype.kind == "O":
        raise HoraValueError(f"{kind}: a {type(array).__name__} is not an array of numbers (NumPy makes it an "
                             "array of Python objects); pass a NumPy array of a numeric dtype, or use "
                             "broadcast_object / allgather_object for Python objects")
    return a


def check_copy(a: np.ndarray, kind: str) -> None:
    """Refuse a zero-stride view whose contiguous copy would be huge (see ``EXPAND_LIMIT``)."""
    if a.nbytes <= EXPAND_LIMIT or not any(st == 0 and d > 1 for st, d in zip(a.strides, a.shape)):
        return
    held = a.itemsize * math.prod(d for st, d in zip(a.strides, a.shape) if st != 0)
    raise HoraValueError(f"{kind}: the array is a broadcast view (a zero stride, as np.broadcast_to or "
                         f"torch.expand make) of shape {a.shape}: {held} bytes of data that hora would have to "
                         f"copy into {a.nbytes / (1 << 30):.1f} GiB; hora refuses such copies over "
                         f"{EXPAND_LIMIT >> 20} MiB. Run the collective on the small array and broadcast its "
                         "result (e.g. np.broadcast_to(hora.allreduce(x), shape)), or pass a real array")


def factor(value, label: str, what: str) -> float:
    """A scale factor as a float; NaN and infinities are refused here, since they make every element
    NaN or infinite (and NaN, being unequal to itself, cannot be checked across ranks)."""
    try:
        f = float(value)
    except (TypeError, ValueError) as e:
        raise HoraValueError(f"{what}: {label} {value!r} is not a number") from e
    if not math.isfinite(f):
        raise HoraValueError(f"{what}: {label} is {f}; scale factors must be finite numbers")
    return f


def copy_back(user: np.ndarray, finish):
    def done(result):
        user[...] = result
        return finish(user) if finish else user
    return done


def root(root_rank, process_set, what) -> int:
    st = state()
    ranks = st.engine.process_sets[ps_id(process_set, st, what)]
    if isinstance(root_rank, (bool, np.bool_)) or not isinstance(root_rank, (int, np.integer)) \
            or int(root_rank) not in ranks:
        raise HoraValueError(f"{what}: root_rank {root_rank!r} is not a rank of the process set (ranks "
                             f"{list(ranks)}); root_rank is a global rank")
    return int(root_rank)
