"""``horovod.torch`` is ``hora.torch``."""

from hora.torch import *  # noqa: F401,F403
from hora.torch import __all__  # noqa: F401
from horovod.common.util import check_extension  # noqa: F401
from horovod.torch import elastic  # noqa: F401
from horovod.torch.mpi_ops import gpu_available, handle_average_backwards_compatibility  # noqa: F401
