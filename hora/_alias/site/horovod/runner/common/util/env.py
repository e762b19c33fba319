"""``horovod.runner.common.util.env``: a process's rank and size from its launcher's environment."""

import os

from horovod import _shim
from horovod.runner.common.util import LAUNCHER, secret  # noqa: F401

LOG_LEVEL_STR = ["FATAL", "ERROR", "WARNING", "INFO", "DEBUG", "TRACE"]


def get_env_rank_and_size() -> tuple[int, int]:
    """(rank, size) from hora's, Horovod's, Open MPI's or PMI's variables; (0, 1) when none is set."""
    for rank_var, size_var in (("HORA_RANK", "HORA_SIZE"), ("HOROVOD_RANK", "HOROVOD_SIZE"),
                               ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"), ("PMI_RANK", "PMI_SIZE")):
        rank, size = os.environ.get(rank_var), os.environ.get(size_var)
        if rank is not None and size is not None:
            return int(rank), int(size)
        if rank is not None or size is not None:
            raise RuntimeError(f"cannot tell this process's rank and size: {rank_var if rank else size_var} is "
                               f"set but {size_var if rank else rank_var} is not")
    return 0, 1


_shim.fill(globals(), {"IGNORE_REGEXES KUBEFLOW_MPI_EXEC is_exportable is_kubeflow_mpi": LAUNCHER})
