"""Registering and removing process sets: collectives through the engine, every rank making the same calls in
the same order (:class:`hora.core.process_sets.ProcessSet` is the value they register).
"""

from __future__ import annotations

from hora.base.errors import HoraValueError
from hora.core import ops
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core.session import state
from hora.engine import messages as m

__all__ = ["add_process_set", "remove_process_set", "register_process_set"]


def register_process_set(ps, at_init: bool = False) -> ProcessSet:
    """Register ``ps`` (a :class:`ProcessSet` or a list of ranks) on every rank, a collective through the
    engine, and set its id; ``init(process_sets=[...])`` calls it with ``at_init``."""
    st = state()
    if not (at_init or st.dynamic):
        raise HoraValueError("add_process_set needs dynamic process sets: hora.init(process_sets='dynamic') "
                             "or HORA_DYNAMIC_PROCESS_SETS=1")
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    bad = [r for r in ps.ranks if not 0 <= r < st.topo.size]
    if bad or not ps.ranks:
        raise HoraValueError(f"{ps}: ranks {bad or '[]'} are not ranks of this job (size {st.topo.size})")
    pid = ops.synchronize(ops._submit(m.ADD_PS, None, ops._auto_name(None, 0, "process_set"), global_process_set,
                                      flush=True, ranks=tuple(ps.ranks)))
    ps.process_set_id = pid
    return ps


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set (collective: same calls in the same order on every rank)."""
    return register_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective). Returns False if it was not registered."""
    st = state()
    if not st.dynamic:
        raise HoraValueError("remove_process_set needs dynamic process sets: hora.init(process_sets='dynamic')")
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in st.engine.process_sets:
        return False
    ops.synchronize(ops._submit(m.REMOVE_PS, None, ops._auto_name(None, 0, "process_set"), global_process_set,
                                flush=True, set_id=pid))
    process_set.process_set_id = None
    return True
