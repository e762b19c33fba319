"""``horovod.ray.elastic``: ElasticRayExecutor and its settings; Horovod's driver internals are not here."""

import logging

from hora.ray import BaseHorovodWorker  # noqa: F401
from hora.ray.elastic import ElasticRayExecutor, ElasticSettings  # noqa: F401
from horovod import _shim

logger = logging.getLogger("horovod.ray.elastic")

_shim.fill(globals(), {
    "ElasticDriver HostDiscovery RayHostDiscovery TestDiscovery RendezvousServer create_rendezvous_handler "
    "create_run_env_vars create_slot_env_vars GetTimeoutError":
        "these are the internals of Horovod's elastic Ray driver; hora's ElasticRayExecutor runs hora's own "
        "elastic driver (discovery from the Ray cluster's nodes) and exports none of them",
    "detect_nics secret timeout": "Horovod's runner internals (NIC detection, secret, timeout); hora's runner "
                                  "does these itself",
})
