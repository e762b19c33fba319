"""``horovod.torch.mpi_ops``: the collectives and basics of ``hora.torch``."""

from horovod import _shim
from horovod.torch._names import *  # noqa: F401,F403
from horovod.torch._names import INTERNAL, handle_average_backwards_compatibility  # noqa: F401

_shim.fill(globals(), INTERNAL)
