"""Registering and removing process sets: collectives through the engine, every rank making the same calls in
the same order (:class:`hora.core.process_sets.ProcessSet` is the value they register).
"""

from __future__ import annotations

from hora.base.errors import HoraValueError
from hora.core import ops
from hora.core.process_sets import ProcessSet, global_process_set
from hora.core.session import state
from hora.engine import messages as m

__all__ = ["add_process_set", "remove_process_set", "register_process_set", "register_at_init"]


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
    if isinstance(process_set, ProcessSet) and process_set.ranks is None:
        raise NotImplementedError("add_process_set(ProcessSet(mpi_comm)): a set from an MPI communicator is "
                                  "registered at init(process_sets=[...]) only, as in Horovod; pass its ranks")
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


def register_at_init(sets: list) -> None:
    """``init(process_sets=[...])``: the sets made from MPI communicators first, then those from ranks, each
    in the order given, as Horovod numbers them; a set that repeats another (or the global set) is an error
    on every rank. Each rank may pass a different communicator for a set (``comm.Split``): the sets are
    those the ranks' communicators form together, numbered by their lowest rank."""
    sets = [ps if isinstance(ps, ProcessSet) else ProcessSet(ps) for ps in sets]
    from_comm = [ps for ps in sets if ps.ranks is None]
    if from_comm:
        from hora.transport.mpi import load_mpi
        from hora.transport.mpi_world import ranks_of, world

        MPI = load_mpi()
        global_process_set.mpi_comm = world(MPI)
        mine = [ranks_of(ps.mpi_comm, MPI) for ps in from_comm]
        listed = [tuple(r) for r in mine if r is not None] + [tuple(ps.ranks) for ps in sets if ps.mpi_comm is None]
        dup = len(set(listed)) < len(listed)  # on this rank; every rank learns of it (no rank may run ahead)
        every = ops.allgather_object(([None if r is None else tuple(r) for r in mine], dup),
                                     name="hora.init.comm_sets")
        bad = [rank for rank, (_, d) in enumerate(every) if d]
        if bad:
            raise HoraValueError(f"init(process_sets=...): ranks {bad} pass the same set twice (communicators or "
                                 "ranks that name the same processes)")
        formed = sorted({r for rows, _ in every for r in rows if r is not None}, key=lambda r: (r[0], r))
        found = {ranks: register_process_set(ProcessSet(ranks), at_init=True).process_set_id for ranks in formed}
        for ps, ranks in zip(from_comm, mine):
            ps.ranks = None if ranks is None else list(ranks)
            ps.process_set_id = None if ranks is None else found[tuple(ranks)]
    for ps in sets:
        if ps.mpi_comm is None:
            register_process_set(ps, at_init=True)
