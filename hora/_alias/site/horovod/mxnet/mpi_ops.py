from hora.mxnet.mpi_ops import *  # noqa: F401,F403
