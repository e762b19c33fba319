"""hora on a Ray cluster: Horovod's ``horovod.ray`` (``RayExecutor``), with ranks as Ray actors.

    import ray
    from hora.ray import RayExecutor

    ray.init()
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=30), num_workers=2)
    executor.start()
    print(executor.run(train))          # train() calls hvd.init(); one result per rank, in rank order
    executor.shutdown()

Importing this package imports Ray (``pip install 'hora[ray]'``); ``import hora`` never does. docs/ray.md says
how ranks map to actors, where the store runs, how the secret travels and what a failure does.
"""

try:
    import ray  # noqa: F401 - a missing Ray is said here, not deep inside start()
except ImportError as e:  # pragma: no cover - depends on the installation
    raise ImportError(f"hora.ray needs Ray: pip install 'hora[ray]' ({e})") from e

from hora.ray import ray_logger  # noqa: E402
from hora.ray.elastic import ElasticRayExecutor  # noqa: E402
from hora.ray.runner import MiniSettings, RayExecutor  # noqa: E402
from hora.ray.worker import BaseHorovodWorker  # noqa: E402

__all__ = ["RayExecutor", "BaseHorovodWorker", "ElasticRayExecutor", "MiniSettings", "ray_logger"]
