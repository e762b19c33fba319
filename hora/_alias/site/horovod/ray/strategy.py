"""``horovod.ray.strategy``: Horovod's placement strategies; hora's RayExecutor places workers itself."""

import logging

from hora.ray import BaseHorovodWorker  # noqa: F401
from horovod import _shim

logger = logging.getLogger("horovod.ray.strategy")

_shim.fill(globals(), {
    "BaseStrategy ColocatedStrategy PGStrategy create_placement_group map_blocking":
        "hora's RayExecutor reserves one placement group from num_workers / num_hosts / num_workers_per_host "
        "itself (hora.ray.placement); Horovod's strategy classes are internals it does not export",
})
