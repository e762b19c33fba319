"""What this installation was "built" with, answered truthfully in Horovod's terms.

hora has no compiled extension: its TCP transport plays the part of Horovod's Gloo, there is no NCCL, CUDA,
ROCm, DDL or oneCCL code, and MPI is not used as a transport (mpi4py being importable is all
``mpi_built()`` reports).
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
    return False


def mpi_threads_supported() -> bool:
    raise HoraValueError("mpi_threads_supported: MPI is not in use (hora's TCP transport plays Gloo's part), "
                         "so there is no MPI thread level to report")


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
