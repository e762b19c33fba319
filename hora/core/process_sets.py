"""Process sets: collectives among a subset of ranks, each set negotiated on its own.

``ProcessSet(ranks)`` is registered either at ``init(process_sets=[...])`` or, in dynamic mode,
with ``add_process_set`` — a collective: every rank makes the same calls in the same order. The
global set has id 0; others get 1, 2, ... in registration order.
"""

from __future__ import annotations

from hora.base.errors import HoraValueError


class ProcessSet:
    """A sorted list of global ranks; ``process_set_id`` is None until registered."""

    def __init__(self, ranks_or_comm):
        self.process_set_id: int | None = None
        self.mpi_comm = None
        if hasattr(ranks_or_comm, "Get_group"):  # an mpi4py communicator: its ranks are known at init()
            self.ranks, self.mpi_comm = None, ranks_or_comm
            return
        self.ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(self.ranks)) != len(self.ranks):
            raise HoraValueError(f"ProcessSet({ranks_or_comm!r}) lists a rank twice")

    def _require(self):
        from hora.core import basics

        basics.state()
        if self.process_set_id is None:
            raise HoraValueError(f"{self} is not registered; pass it to hora.init(process_sets=[...]) "
                                 "or hora.add_process_set()")

    def size(self) -> int:
        self._require()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not included)."""
        from hora.core import basics

        self._require()
        r = basics.rank()
        return self.ranks.index(r) if r in self.ranks else -1

    def included(self) -> bool:
        from hora.core import basics

        self._require()
        return basics.rank() in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"

    __repr__ = __str__

    def __eq__(self, other) -> bool:
        return isinstance(other, ProcessSet) and self.ranks == other.ranks

    __hash__ = None  # mutable (its id is set on registration)


class _GlobalProcessSet(ProcessSet):
    """The set of all ranks, id 0: ``ranks`` lists every rank of the job once ``init()`` has run (``[]``
    before it, and after ``shutdown()``)."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    @property
    def ranks(self) -> list[int]:
        from hora.core import basics

        return list(range(basics.size())) if basics.is_initialized() else []

    @ranks.setter
    def ranks(self, value) -> None:  # ProcessSet.__init__ assigns it; the job's size decides
        pass

    def _require(self):
        from hora.core import basics

        basics.state()


global_process_set = _GlobalProcessSet()


def register(ps: ProcessSet, at_init: bool = False) -> ProcessSet:
    """Register ``ps`` on every rank (a collective through the engine); sets its id."""
    from hora.core import basics, ops
    from hora.engine import messages as m

    st = basics.state()
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


def register_at_init(sets: list) -> None:
    """``init(process_sets=[...])``: the sets made from MPI communicators first, then those from ranks, each
    in the order given, as Horovod numbers them; a set that repeats another (or the global set) is an error
    on every rank. Each rank may pass a different communicator for a set (``comm.Split``): the sets are
    those the ranks' communicators form together, numbered by their lowest rank."""
    from hora.core import ops

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
        found = {ranks: register(ProcessSet(ranks), at_init=True).process_set_id for ranks in formed}
        for ps, ranks in zip(from_comm, mine):
            ps.ranks = None if ranks is None else list(ranks)
            ps.process_set_id = None if ranks is None else found[tuple(ranks)]
    for ps in sets:
        if ps.mpi_comm is None:
            register(ps, at_init=True)


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set (collective: same calls in the same order on every rank)."""
    if isinstance(process_set, ProcessSet) and process_set.ranks is None:
        raise NotImplementedError("add_process_set(ProcessSet(mpi_comm)): a set from an MPI communicator is "
                                  "registered at init(process_sets=[...]) only, as in Horovod; pass its ranks")
    return register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (collective). Returns False if it was not registered."""
    from hora.core import basics, ops
    from hora.engine import messages as m

    st = basics.state()
    if not st.dynamic:
        raise HoraValueError("remove_process_set needs dynamic process sets: hora.init(process_sets='dynamic')")
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in st.engine.process_sets:
        return False
    ops.synchronize(ops._submit(m.REMOVE_PS, None, ops._auto_name(None, 0, "process_set"), global_process_set,
                                flush=True, set_id=pid))
    process_set.process_set_id = None
    return True
