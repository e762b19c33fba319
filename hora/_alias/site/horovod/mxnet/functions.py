"""``horovod.mxnet.functions``: broadcast_object, allgather_object and what Horovod's module imports."""

from hora.mxnet import allgather, broadcast_, rank, size  # noqa: F401
from hora.mxnet.functions import *  # noqa: F401,F403
