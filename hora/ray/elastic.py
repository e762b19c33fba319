"""``ElasticRayExecutor`` (Horovod's name): an elastic job on Ray, which hora does not have yet.

An elastic Ray job needs hora's elastic driver (the one that follows the hosts, resets the ranks and restarts
lost workers), with Ray's node membership as its discovery source. That driver is not built yet, so this
class, and ``RayExecutor(min_workers=...)``, raise :class:`~hora.base.errors.NotSupportedError` rather than
run a fixed-size job that would look elastic and is not.
"""

from __future__ import annotations

from typing import Any

from hora.base.errors import NotSupportedError
from hora.ray.runner import ELASTIC_NOT_YET


class ElasticRayExecutor:
    """Not built yet: raises :class:`NotSupportedError` (see the module docstring)."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: int = 600, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: set | None = None, **kwargs: Any):
        raise NotSupportedError(ELASTIC_NOT_YET)

    def __init__(self, settings: Any = None, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict | None = None, override_discovery: bool = True):
        raise NotSupportedError(ELASTIC_NOT_YET)
