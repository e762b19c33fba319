"""``ElasticRayExecutor`` (Horovod's name): an elastic hora job whose workers are Ray actors.

The job is run by hora's elastic driver (:class:`hora.runner.elastic.driver.Driver`, the one behind
``hora run --min-np``), in a thread of the calling process, with two parts of its own:

* the pool (:class:`hora.ray.elastic_parts.ActorPool`): one Ray actor per slot (``host:index``), pinned to
  the slot's node (``NodeAffinitySchedulingStrategy``), given its environment, the job's secret included, as
  an actor-method argument, and running ``worker_fn`` once. A fresh actor takes the place of a lost one, as a
  fresh process does under ``hora run``. An actor that dies (killed, out of memory) is a worker killed by a
  signal to the driver: the survivors roll back to their last commit, re-form, and its slot is started again.
* the discovery (:class:`hora.ray.elastic_parts.RayDiscovery`): Ray's alive nodes, each with
  ``CPU // cpus_per_slot`` slots (and at most ``GPU // gpus_per_slot`` with ``use_gpu``), polled every second;
  or, with ``override_discovery=False``, the ``discovery`` object of the settings
  (``find_available_hosts_and_slots()``), its host names matched to Ray nodes by address.

``run`` returns ``worker_fn``'s value on every rank of the last generation, in rank order. A worker_fn that
raises fails the job (after the driver's own handling of it) and its exception is re-raised here.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable

from hora.base.errors import HoraValueError, LaunchError


@dataclass
class ElasticSettings:
    """What :meth:`ElasticRayExecutor.create_settings` makes (the fields of Horovod's ``ElasticSettings`` that
    mean something here). ``nics``: ``HORA_NETWORK_INTERFACES``; ``timeout_s`` is accepted and has no effect
    (each generation's mesh has the elastic driver's short timeout, 10 s, so that a lost worker is noticed soon;
    ``HORA_START_TIMEOUT`` in ``env_vars`` sets it); ``ssh_identity_file`` is accepted and has no effect (Ray
    starts the workers)."""

    min_np: int = 1
    max_np: int | None = None
    reset_limit: int | None = None
    cooldown_range: tuple[float, float] | None = None
    elastic_timeout: float = 600
    timeout_s: float = 30
    ssh_identity_file: str | None = None
    nics: set | None = None
    discovery: Any = None
    verbose: int = 1


_KNOWN = {"cooldown_range", "discovery", "verbose"}


class ElasticRayExecutor:
    """An elastic job on Ray (see the module docstring and docs/ray.md)."""

    @staticmethod
    def create_settings(min_num_proc: int = 1, max_num_proc: int | None = None, reset_limit: int | None = None,
                        elastic_timeout: int = 600, timeout_s: int = 30, ssh_identity_file: str | None = None,
                        nics: set | None = None, min_np: int | None = None, max_np: int | None = None,
                        **kwargs: Any) -> ElasticSettings:
        """Horovod's settings; ``min_np``/``max_np`` are its older names of ``min_num_proc``/``max_num_proc``.
        Of its other keyword arguments, ``cooldown_range``, ``discovery`` and ``verbose`` are taken."""
        unknown = sorted(set(kwargs) - _KNOWN)
        if unknown:
            raise HoraValueError(f"ElasticRayExecutor.create_settings: unknown arguments {', '.join(unknown)}")
        lo = min_np if min_np is not None else min_num_proc
        hi = max_np if max_np is not None else max_num_proc
        if lo < 1 or (hi is not None and hi < lo):
            raise HoraValueError(f"ElasticRayExecutor: min_np {lo} and max_np {hi}: need 1 <= min_np <= max_np")
        cooldown = kwargs.get("cooldown_range")
        return ElasticSettings(min_np=lo, max_np=hi, reset_limit=reset_limit,
                               cooldown_range=tuple(cooldown) if cooldown else None, elastic_timeout=elastic_timeout,
                               timeout_s=timeout_s, ssh_identity_file=ssh_identity_file, nics=nics,
                               discovery=kwargs.get("discovery"), verbose=kwargs.get("verbose", 1))

    def __init__(self, settings: Any = None, use_gpu: bool = False, cpus_per_slot: int = 1,
                 gpus_per_slot: int | None = None, env_vars: dict | None = None, override_discovery: bool = True):
        if settings is None:
            settings = self.create_settings()
        if not isinstance(settings, ElasticSettings):
            raise HoraValueError("ElasticRayExecutor needs ElasticRayExecutor.create_settings(...), got "
                                 f"{type(settings).__name__}")
        if gpus_per_slot and not use_gpu:
            raise HoraValueError("ElasticRayExecutor: gpus_per_slot is set but use_gpu is False; set use_gpu=True")
        if not isinstance(cpus_per_slot, (int, float)) or cpus_per_slot <= 0:
            raise HoraValueError(f"ElasticRayExecutor: cpus_per_slot must be a positive number, got {cpus_per_slot!r}")
        if not override_discovery and settings.discovery is None:
            raise HoraValueError("ElasticRayExecutor: override_discovery=False needs create_settings(discovery=...)")
        self.settings = settings
        self.use_gpu, self.cpus_per_slot = use_gpu, cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot or 1) if use_gpu else 0
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self.override_discovery = override_discovery
        self._store = None
        self._secret = ""

    def start(self) -> None:
        """Serve the job's store here (on every interface: actors may run on any node; every connection is
        authenticated with the job's secret)."""
        import ray

        from hora.transport.auth import new_secret
        from hora.transport.store import StoreServer

        from hora.ray.placement import refuse_ray_client

        if not ray.is_initialized():
            raise LaunchError("ElasticRayExecutor.start: Ray is not initialised (call ray.init() first)")
        refuse_ray_client("ElasticRayExecutor")
        if self._store is not None:
            raise HoraValueError("ElasticRayExecutor.start: already started; call shutdown() first")
        self._secret = new_secret()
        self._store = StoreServer(self._secret, host="0.0.0.0", port=0)

    def run(self, worker_fn: Callable[[], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list:
        """Run ``worker_fn`` (which calls ``hora.init()`` and trains under ``hora.elastic.run``) as an elastic
        job; its return values on the ranks of the last generation, in rank order. ``callbacks`` get what
        rank 0 sends with :func:`hora.ray.ray_logger.log`."""
        import ray

        from hora.ray import elastic_parts as parts
        from hora.runner.elastic.driver import Driver
        from hora.runner.elastic.settings import new_scope

        if self._store is None:
            raise LaunchError("ElasticRayExecutor.run: not started; call start() first")
        if not callable(worker_fn):
            raise HoraValueError(f"ElasticRayExecutor.run needs a function, got {type(worker_fn).__name__}")
        scope = new_scope()
        port = self._store.address.rpartition(":")[2]
        here = ray.util.get_node_ip_address()
        log_key = f"{scope}/ray_log" if callbacks else None
        discovery = parts.RayDiscovery(self.cpus_per_slot, self.gpus_per_slot,
                                       None if self.override_discovery else self.settings.discovery)
        pool = parts.ActorPool(worker_fn, discovery, self.cpus_per_slot, self.gpus_per_slot, log_key)
        env = self._env(scope)
        settings = parts.driver_settings(self.settings)
        driver = Driver([], settings, env, self._store, lambda _host: f"{here}:{port}", None, pool=pool,
                        discovery=discovery)
        relay = None
        if callbacks:
            from hora.ray.ray_logger import Relay

            relay = Relay(f"127.0.0.1:{port}", self._secret, log_key, callbacks)
        box: dict[str, Any] = {}
        thread = threading.Thread(target=lambda: box.setdefault("rc", driver.run()), name="hora-ray-elastic",
                                  daemon=True)
        thread.start()
        try:
            while thread.is_alive():
                thread.join(0.2)
        except KeyboardInterrupt:
            driver.stop(2)  # the driver stops its workers and returns 130
            thread.join()
            raise
        finally:
            if relay is not None:
                relay.close()
        failure = driver.failure or driver.member_failure
        return pool.outcome(box.get("rc", 1), failure[1] if failure else None)

    def _env(self, scope: str) -> dict[str, str]:
        """Every worker's environment but its own variables (as ``hora run``'s elastic driver gives it)."""
        from hora.runner.elastic.launch import _common_env
        from hora.runner.envs import worker_envs

        knobs: dict[str, str] = {}  # the driver sets the generations' mesh timeout (HORA_START_TIMEOUT)
        if self.settings.nics:
            knobs["HORA_NETWORK_INTERFACES"] = ",".join(sorted(self.settings.nics))
        env = _common_env(knobs, self._secret, scope, self.env_vars, worker_envs)
        return {k: v for k, v in env.items() if k.startswith(("HORA_", "HOROVOD_")) or k in self.env_vars}

    def shutdown(self) -> None:
        """Close the store (the actors of a run are gone when it returns)."""
        store, self._store = self._store, None
        if store is not None:
            store.close()
