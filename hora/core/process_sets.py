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
        if hasattr(ranks_or_comm, "Get_group"):
            raise HoraValueError("ProcessSet(mpi_comm) needs the MPI transport, which is not supported yet; "
                                 "pass a list of ranks")
        self.ranks = sorted(int(r) for r in ranks_or_comm)
        if len(set(self.ranks)) != len(self.ranks):
            raise HoraValueError(f"ProcessSet({ranks_or_comm!r}) lists a rank twice")
        self.process_set_id: int | None = None
        self.mpi_comm = None

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
    """The set of all ranks, id 0; its ranks are filled in by ``init()``."""

    def __init__(self):
        super().__init__([])
        self.process_set_id = 0

    def _require(self):
        from hora.core import basics

        self.ranks = list(range(basics.size()))


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


def add_process_set(process_set) -> ProcessSet:
    """Register a new process set (collective: same calls in the same order on every rank)."""
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
