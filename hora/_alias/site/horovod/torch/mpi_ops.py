from hora.torch.mpi_ops import *  # noqa: F401,F403
