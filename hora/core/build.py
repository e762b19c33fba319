"""What this installation was "built" with, answered truthfully in Horovod's terms.

hora has no compiled extension: its TCP transport plays the part of Horovod's Gloo, there is no NCCL, CUDA,
ROCm, DDL or oneCCL code; MPI (through mpi4py) carries the collectives of jobs started by mpirun when the
MPI transport is chosen (``mpi_enabled()``).
"""

from __future__ import annotations

import functools

from hora.base.errors import HoraValueError

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built"]


@functools.cache
def mpi_built() -> bool:
    """True when mpi4py can be imported."""
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return False
    return True


def mpi_enabled() -> bool:
    """True when this initialised job runs its collectives over MPI (mpirun and the MPI transport)."""
    from hora.core import basics

    if not basics.is_initialized():
        return False
    comm = basics.state().comm
    while comm is not None:  # the MPI communicator, possibly inside another transport's wrapper
        if type(comm).__name__ == "MpiCommunicator":
            return True
        comm = getattr(comm, "inner", None) or getattr(comm, "_inner", None)
    return False


def mpi_threads_supported() -> bool:
    """Whether MPI runs with ``MPI_THREAD_MULTIPLE``, so that the script may call mpi4py itself beside hora's
    engine thread (Horovod's docs tell users to assert this first). Raises ``ValueError`` unless
    :func:`mpi_enabled`."""
    if not mpi_enabled():
        raise HoraValueError("mpi_threads_supported: MPI is not enabled in this job (it was not started by "
                             "mpirun with the MPI transport, or hora is not initialised), so there is no MPI "
                             "thread level to report")
    from hora.transport.mpi import load_mpi

    MPI = load_mpi()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def gloo_built() -> bool:
    return True


def gloo_enabled() -> bool:
    return True


def nccl_built() -> int:
    """The NCCL version hora was built with: 0, none."""
    return 0


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    return False


def rocm_built() -> bool:
    return False
