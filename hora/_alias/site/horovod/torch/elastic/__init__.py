"""``horovod.torch.elastic`` is ``hora.torch.elastic``."""

from hora.elastic import run_fn  # noqa: F401
from hora.torch import init, shutdown  # noqa: F401
from hora.torch.elastic import *  # noqa: F401,F403
from hora.torch.elastic import __all__  # noqa: F401
