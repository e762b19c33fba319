"""Process sets: collectives among a subset of ranks, each set negotiated on its own.

A :class:`ProcessSet` is a value: its sorted ranks and, once registered, its id. Registering one is a
collective (:func:`hora.core.sets.add_process_set`, or ``init(process_sets=[...])``): every rank makes the same
calls in the same order. The global set has id 0; others get 1, 2, ... in registration order. The queries
(``size``, ``rank``, ``included``) read the session (:mod:`hora.core.session`), never the collectives.
"""

from __future__ import annotations

from hora.base.errors import HoraValueError
from hora.core import session


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
        session.state()
        if self.process_set_id is None:
            raise HoraValueError(f"{self} is not registered; pass it to hora.init(process_sets=[...]) "
                                 "or hora.add_process_set()")

    def size(self) -> int:
        self._require()
        return len(self.ranks)

    def rank(self) -> int:
        """This process's rank within the set (-1 when not included)."""
        self._require()
        r = session.state().topo.rank
        return self.ranks.index(r) if r in self.ranks else -1

    def included(self) -> bool:
        self._require()
        return session.state().topo.rank in self.ranks

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
        return list(range(session.state().topo.size)) if session.is_initialized() else []

    @ranks.setter
    def ranks(self, value) -> None:  # ProcessSet.__init__ assigns it; the job's size decides
        pass

    def _require(self):
        session.state()


global_process_set = _GlobalProcessSet()
