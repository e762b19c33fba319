"""The MPI communicator that is hora's world under mpirun: ``COMM_WORLD``, or the one ``init(comm=...)`` named.

Horovod's ``init(comm=[ranks])`` runs the job on those ranks of ``MPI_COMM_WORLD`` (renumbered 0..n-1 in
that order), and ``init(comm=<mpi4py communicator>)`` on that communicator's ranks. The launcher detection
(ranks, hosts, the store's address broadcast) and the MPI transport read the world from here, and
:func:`load_mpi` is how everything loads mpi4py.
"""

from __future__ import annotations

import sys
from typing import Any

from hora.base import knobs
from hora.base.errors import HoraError, HoraValueError

_world: list[Any] = []  # the communicator set by init(comm=...), for this initialisation only


def world(MPI) -> Any:
    """hora's world communicator (``MPI.COMM_WORLD`` unless ``init(comm=...)`` chose another)."""
    return _world[0] if _world else MPI.COMM_WORLD


def choose(comm: Any) -> None:
    """Make ``comm`` (ranks of ``COMM_WORLD``, an mpi4py communicator, or None for ``COMM_WORLD``) the world
    of the next ``init()``. A list of ranks is a collective over those ranks only (``Create_group``)."""
    _world.clear()
    if comm is None:
        return
    MPI = load_mpi()
    if isinstance(comm, MPI.Comm):
        if comm == MPI.COMM_NULL:
            raise HoraValueError("init(comm=MPI.COMM_NULL): this process is not in that communicator; only its "
                                 "members call init(comm=...)")
        _world.append(comm)
        return
    try:
        ranks = [int(r) for r in comm]
    except TypeError:
        raise HoraValueError(f"init(comm=...) takes a list of MPI_COMM_WORLD ranks or an mpi4py communicator, "
                             f"not {type(comm).__name__}") from None
    everyone = MPI.COMM_WORLD
    if everyone.Get_rank() not in ranks:
        raise HoraValueError(f"init(comm={ranks}): this process is rank {everyone.Get_rank()} of MPI_COMM_WORLD, "
                             "not one of them; only the listed ranks call init(comm=...)")
    bad = [r for r in ranks if not 0 <= r < everyone.Get_size()] or sorted({r for r in ranks if ranks.count(r) > 1})
    if bad:
        raise HoraValueError(f"init(comm={ranks}): ranks {bad} are out of range (size {everyone.Get_size()}) "
                             "or listed twice")
    group = everyone.Get_group().Incl(ranks)
    try:
        _world.append(everyone.Create_group(group))
    finally:
        group.Free()


def ranks_of(comm: Any, MPI) -> list[int] | None:
    """The ranks of hora's world that make up ``comm`` (None for ``COMM_NULL``), sorted."""
    if comm == MPI.COMM_NULL:
        return None
    mine = comm.Get_group()
    ours = world(MPI).Get_group()
    try:
        out = mine.Translate_ranks(list(range(comm.Get_size())), ours)
    finally:
        mine.Free()
        ours.Free()
    if any(r == MPI.UNDEFINED for r in out):
        raise HoraValueError("ProcessSet(mpi_comm): the communicator holds processes outside hora's job")
    return sorted(out)


def started_by_mpirun() -> bool:
    """Whether mpirun (Open MPI, or MPICH / Intel MPI's hydra) started this process."""
    from hora.base import env

    return env.raw("OMPI_COMM_WORLD_RANK") is not None or env.raw("PMI_RANK") is not None


def load_mpi():
    """``mpi4py.MPI``, initialising MPI on first use, or a clear error when mpi4py is missing."""
    if "mpi4py.MPI" not in sys.modules:
        try:
            import mpi4py
        except ImportError as e:
            raise HoraError(
                "this process was started by mpirun (OMPI_COMM_WORLD_RANK / PMI_RANK is set), and hora then "
                "takes its ranks, the store address and the job secret from MPI, which needs mpi4py: "
                "pip install 'hora[mpi]' (or pip install mpi4py; Debian: apt-get install openmpi-bin "
                "libopenmpi-dev first). Or start the job with `hora run` instead of mpirun") from e
        if knobs.value("mpi_threads_disable"):
            mpi4py.rc.thread_level = "serialized"
    from mpi4py import MPI

    return MPI
