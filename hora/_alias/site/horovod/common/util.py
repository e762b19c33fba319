"""``horovod.common.util``'s build queries, answered for hora (hora.core.build): no extension is probed, NCCL
and CUDA are looked for at run time."""

from hora.core.build import (ccl_built, cuda_built, ddl_built, gloo_built, mpi_built,  # noqa: F401
                             nccl_built, rocm_built)
from hora.core.build import gpu_available as _gpu_available


def gpu_available(ext_base_name: str = "", verbose: bool = False) -> bool:
    """Whether a CUDA device is visible; hora has one GPU path for every framework, so ``ext_base_name``
    (Horovod's framework extension) changes nothing."""
    return _gpu_available(ext_base_name)
