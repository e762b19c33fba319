"""``horovod.ray.ray_logger`` is ``hora.ray.ray_logger``."""

from hora.ray.ray_logger import *  # noqa: F401,F403
