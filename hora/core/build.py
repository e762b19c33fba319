"""What this installation was "built" with, answered truthfully in Horovod's terms.

hora has no compiled extension: its TCP transport plays the part of Horovod's Gloo; MPI (through mpi4py)
carries the collectives of jobs started by mpirun when the MPI transport is chosen (``mpi_enabled()``). NCCL
and CUDA are loaded at run time through ``ctypes`` (docs/gpu.md): ``nccl_built()`` is the version of the NCCL
library hora would load (0 when there is none), ``cuda_built()`` says whether a CUDA runtime library works, and
``gpu_available()`` whether it sees a device. There is no ROCm, DDL or oneCCL code.
"""

from __future__ import annotations

import functools

from hora.base.errors import HoraValueError

__all__ = ["mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled", "nccl_built",
           "ddl_built", "ccl_built", "cuda_built", "rocm_built", "gpu_available"]


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
    """The version code of the NCCL library GPU tensors would go through (``NCCL_VERSION_CODE``: 2.32.3 is
    23203), found as hora.transport.nccl_lib says; 0 when none loads (GPU tensors then take the staged path)."""
    from hora.base import knobs
    from hora.base.errors import HoraError
    from hora.transport import nccl_lib
    try:
        major, minor, patch = nccl_lib.load(knobs.value("nccl_library")).version
    except HoraError:
        return 0
    return major * 10000 + minor * 100 + patch


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when a CUDA runtime library loads (the framework's, a wheel's or the system's) and finds a driver
    it can work with: hora can then take GPU tensors, through NCCL or the staged path."""
    from hora.base import knobs
    from hora.base.errors import HoraError
    from hora.transport import cuda
    try:
        cuda.load(knobs.value("nccl_library")).device_count()
    except HoraError:
        return False
    return True


def gpu_available(ext: str | None = None) -> bool:
    """True when a CUDA device is visible (Horovod's ``horovod.common.util.gpu_available``; ``ext``, the
    framework's name there, changes nothing: hora has one GPU path for every framework)."""
    from hora.base import knobs
    from hora.transport import cuda
    return cuda.device_count(knobs.value("nccl_library")) > 0


def rocm_built() -> bool:
    return False
