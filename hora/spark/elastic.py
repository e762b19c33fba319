"""``hora.spark.run_elastic``'s driver side: the store, the elastic driver on Spark's tasks, the results.

The driver is ``hora run --elastic``'s (:class:`hora.runner.elastic.driver.Driver`), in a thread of this
process, with the Spark pool and discovery of :mod:`hora.spark.elastic_pool`; the workers run
``python -m hora.core.run_task`` as ``hora.run()``'s elastic workers do, so the function trains under
``hora.elastic.run`` with hora's State/commit semantics, and each worker's result goes to the store under
the generation it ended in. This process serves the store (the function, the control keys, the output).
"""

from __future__ import annotations

import pickle
import socket
import sys
import threading
import uuid
from typing import IO, Any, Callable

from hora.base import contract, knobs
from hora.base.errors import HoraTimeoutError, HoraValueError, LaunchError


def run(sc: Any, fn: Callable[..., Any], args: tuple, kwargs: dict, num_proc: int, min_np: int, max_np: int,
        start_timeout: float, elastic_timeout: float | None, reset_limit: int | None,
        env: dict[str, str], knob_env: dict[str, str], stdout: IO[str] | None, stderr: IO[str] | None,
        timestamps: bool) -> list:
    """The values ``fn`` returned on the ranks of the last generation, in rank order (see ``run_elastic``)."""
    import cloudpickle

    from hora.runner.api import collect_results
    from hora.runner.elastic import elastic_results
    from hora.runner.elastic.driver import Driver
    from hora.runner.elastic.launch import _common_env
    from hora.runner.elastic.settings import new_scope
    from hora.runner.envs import worker_envs
    from hora.spark import driver as spark_driver
    from hora.spark import elastic_pool, elastic_task, python
    from hora.spark.relay import Relay
    from hora.transport.auth import new_secret
    from hora.transport.store import StoreServer

    if not 1 <= min_np <= max_np:
        raise HoraValueError(f"hora.spark.run_elastic: min_num_proc {min_np} and max_num_proc {max_np}: need "
                             "1 <= min_num_proc <= max_num_proc")
    secret, scope = new_secret(), new_scope()
    bind, advertise = spark_driver.addresses(sc)
    with StoreServer(secret, host=bind, port=0) as store:
        if not advertise:
            advertise = bind if bind not in ("0.0.0.0", "", "::") else socket.getfqdn()
        addr = f"{advertise}:{store.address.rpartition(':')[2]}"
        store.set("func", cloudpickle.dumps((fn, args, kwargs)))
        store.set("sys.path", pickle.dumps([p for p in sys.path if isinstance(p, str)]))
        extra = {**env, contract.RUNFUNC_ADDR: addr, contract.RUNFUNC_SECRET: secret}
        common = _common_env(knob_env, secret, scope, extra, worker_envs)
        # the executor's own environment, plus hora's variables and the caller's (the alias's path too)
        keep = ("PYTHONUNBUFFERED", "PYTHONPATH") if common.get(contract.HOROVOD_ALIAS) == "1" else \
            ("PYTHONUNBUFFERED",)
        common = {k: v for k, v in common.items() if k.startswith(("HORA_", "HOROVOD_")) or k in extra or k in keep}
        spec = elastic_task.Spec(addr, secret, f"{scope}/spark", python.interpreter())
        group = f"hora.spark.run_elastic-{uuid.uuid4().hex[:12]}"
        pool = elastic_pool.TaskPool(sc, spec, store, max_np, group, Relay(stdout, stderr, timestamps),
                                     start_timeout)
        discovery = elastic_pool.TaskDiscovery(pool, num_proc, min_np, start_timeout)
        settings = _settings(num_proc, min_np, max_np, elastic_timeout, reset_limit)
        drv = Driver([], settings, common, store, lambda _host: addr, None, pool=pool, discovery=discovery)
        with python.driver_python_for_local_workers(sc), python.explained():
            code, why = _drive(drv, pool, discovery)
        results = elastic_results(store.get) or {0: None}
    try:
        return collect_results(results, code, [drv.root] if code and drv.root is not None else [],
                               job="hora.spark.run_elastic")
    except LaunchError as e:
        if why is None:
            raise
        raise LaunchError(f"hora.spark.run_elastic: {why}") from e


def _settings(num_proc: int, min_np: int, max_np: int, elastic_timeout: float | None, reset_limit: int | None
              ) -> dict[str, Any]:
    """The elastic driver's settings (:func:`hora.runner.elastic.settings.settings_from`'s keys)."""
    return {"np": num_proc, "min_np": min_np, "max_np": max_np,
            "elastic_timeout": float(elastic_timeout if elastic_timeout is not None
                                     else knobs.value("elastic_timeout")),
            "start_timeout": knobs.value("start_timeout"), "reset_limit": reset_limit, "cooldown": None,
            "blacklist_after": knobs.value("elastic_blacklist_after"),
            "slot_failures": knobs.value("elastic_slot_failures"),
            "failure_resets": knobs.value("elastic_failure_resets"),
            "restart_on_loss": knobs.value("elastic_restart_on_loss"),
            "discovery_grace": knobs.value("elastic_discovery_grace")}


def _drive(drv: Any, pool: Any, discovery: Any) -> tuple[int, str | None]:
    """Run the driver in a thread until it ends; stop it when no worker can start (too few tasks, or a task
    whose Python cannot load the function). (exit status, why the job failed or None)."""
    box: dict[str, int] = {}
    thread = threading.Thread(target=lambda: box.setdefault("rc", drv.run()), name="hora-spark-elastic-driver",
                              daemon=True)
    thread.start()
    stopped = None
    try:
        while thread.is_alive():
            thread.join(0.2)
            if stopped is None and (pool.refused or discovery.failed):
                stopped = pool.refused or discovery.failed
                drv.failure = drv.failure or (1, stopped)  # the driver fails the job: it stops the workers
    except KeyboardInterrupt:
        drv.stop(2)
        thread.join()
        raise
    if pool.refused:
        raise LaunchError(pool.refused)
    if discovery.failed:
        raise HoraTimeoutError(f"hora.spark.run_elastic: {discovery.failed}")
    failure = drv.failure or drv.member_failure
    return box.get("rc", 1), failure[1] if failure else stopped
