"""``horovod.ray`` is ``hora.ray``."""

from hora.ray import *  # noqa: F401,F403
from hora.ray import __all__  # noqa: F401
from horovod.ray import ray_logger  # noqa: F401
