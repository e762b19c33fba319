"""``horovod.ray.ray_logger`` is ``hora.ray.ray_logger``."""

from hora.ray.ray_logger import *  # noqa: F401,F403
from horovod import _shim

warning_raised = False  # Horovod's flag; hora's logger keeps its own and warns once as well

_shim.fill(globals(), {
    "configure": "hora's RayExecutor configures the workers' logging itself (ray_logger.log works on the "
                 "workers of a RayExecutor that was started with it); there is no queue to hand in",
})
