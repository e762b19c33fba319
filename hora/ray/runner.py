"""``RayExecutor``: a hora job whose ranks are Ray actors (Horovod's ``horovod.ray.RayExecutor``).

Ray places and starts the processes; hora does the rest as under ``hora run``. :meth:`RayExecutor.start`
reserves a placement group, starts one :class:`~hora.ray.worker.BaseHorovodWorker` actor per rank, asks each
where Ray put it, plans ranks node by node from that (:mod:`hora.ray.placement`), serves the job's store in
this process (the driver), and gives every actor its ``HORA_*`` environment, the secret included, as an
actor-method argument. Each call (``run``, ``execute``...) then sends a cloudpickled function to the actors
and gathers the results in rank order.

Failures: a function that raises on a rank is re-raised here with that rank's traceback as its ``__cause__``
(the first rank to fail for a reason of its own, not one that failed only because it lost a peer). The failing
worker itself tells the others, through the store, to shut hora down (:mod:`hora.ray.worker`), so none waits
for it in a collective under ``run_remote`` either, and the next call starts afresh on every rank. A worker
actor that dies (killed, out of memory, its node lost) fails the call at once with a :class:`LaunchError`
naming its rank, and the executor's other actors are stopped, since a job cannot go on without a rank; so
does an interruption of the driver (Ctrl-C, or any exception a signal handler raises, such as a SIGALRM
timeout's) while it waits for a call. The driver waits in Python, not in ``ray.wait``: there Python's signal
handlers run inside Ray's own signal check, which keeps KeyboardInterrupt and SystemExit and drops any other
exception, so the driver would go on waiting (:func:`_wait_one`).
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from hora.base import outcome
from hora.base.errors import HoraTimeoutError, HoraValueError, LaunchError, NotSupportedError
from hora.ray import placement
from hora.ray.placement import refuse_ray_client
from hora.ray.worker import RayWorker, _Failures

# After one rank raised, how long the others get to finish or fail in turn before they are stopped: they are
# told to shut hora down and normally end within a second; one waiting in hora.init() for the failed rank
# ends when its start timeout (settings.timeout_s) runs out, so the grace is that plus this.
FAILURE_GRACE_S = 15.0
# Ray's default max_direct_call_object_size: an argument up to this size travels inside the task itself
INLINE_MAX = 100 * 1024
ELASTIC_ONLY_RUN = ("not supported yet: {what} in an elastic RayExecutor (min_workers): its workers live for one "
                    "run(); use run(), or num_workers for a fixed-size job")


class Timeout:
    """A deadline ``timeout_s`` from now (what Horovod's ``MiniSettings.start_timeout`` gives)."""

    def __init__(self, timeout_s: float, message: str):
        self._deadline = time.monotonic() + timeout_s
        self._timeout_s, self._message = timeout_s, message

    def remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def timed_out(self) -> bool:
        return time.monotonic() >= self._deadline

    def check_time_out_for(self, activity: str) -> None:
        """Raise :class:`HoraTimeoutError` if the deadline has passed."""
        if self.timed_out():
            raise HoraTimeoutError(self._message.format(activity=activity))


@dataclass
class MiniSettings:
    """The settings of a Ray job (Horovod's name and defaults; ``create_settings`` makes them with
    ``timeout_s=30``). ``timeout_s``: how long workers get to start and meet (hora's ``start_timeout``);
    ``nics``: the network interfaces hora may use (``HORA_NETWORK_INTERFACES``); the ssh fields are accepted
    and unused (Ray starts the processes, not ssh)."""

    nics: set | None = None
    verbose: int = 1
    key: str | None = None
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    timeout_s: int = 300
    placement_group_timeout_s: int = 100
    elastic: bool = False

    @property
    def start_timeout(self) -> Timeout:
        """A fresh deadline ``timeout_s`` from now, as Horovod's."""
        return Timeout(self.timeout_s, f"Timed out waiting for {{activity}} (timeout_s={self.timeout_s:g}); "
                                       "raise timeout_s in RayExecutor.create_settings if the workers need longer")


def _apply(fn: Callable, args: tuple, kwargs: dict, _executable: Any) -> Any:
    return fn(*args, **kwargs)


class RayExecutor:
    """A fixed group of Ray actors that run hora ranks. See the module docstring and docs/ray.md."""

    @classmethod
    def create_settings(cls, timeout_s: int = 30, ssh_identity_file: str | None = None, ssh_str: str | None = None,
                        placement_group_timeout_s: int = 100, nics: set | None = None) -> MiniSettings:
        """Horovod's settings. ``ssh_identity_file`` / ``ssh_str`` are accepted and have no effect: hora does
        not ssh between Ray nodes (Horovod wrote ``ssh_str`` to the file; hora writes no key anywhere)."""
        return MiniSettings(nics=nics, ssh_identity_file=ssh_identity_file, timeout_s=timeout_s,
                            placement_group_timeout_s=placement_group_timeout_s)

    def __init__(self, settings: MiniSettings, num_workers: int | None = None, num_hosts: int | None = None,
                 num_workers_per_host: int = 1, cpus_per_worker: int = 1, use_gpu: bool = False,
                 gpus_per_worker: int | None = None, use_current_placement_group: bool = True,
                 min_workers: int | None = None, max_workers: int | None = None, reset_limit: int | None = None,
                 cooldown_range: list | None = None, elastic_timeout: int = 600, override_discovery: bool = True):
        if max_workers and (not min_workers or min_workers <= 0):
            raise HoraValueError("RayExecutor: max_workers was given without a positive min_workers; an elastic "
                                 "job needs min_workers")
        if min_workers is not None and num_workers is not None:
            raise HoraValueError("RayExecutor: give num_workers (a fixed-size job) or min_workers (elastic), not both")
        self._elastic = None
        if min_workers is not None:  # Horovod's elastic mode: the job is an ElasticRayExecutor's
            from hora.ray.elastic import ElasticRayExecutor

            if not isinstance(cpus_per_worker, (int, float)) or cpus_per_worker <= 0:
                raise HoraValueError(f"RayExecutor: cpus_per_worker must be a positive number in elastic mode, got "
                                     f"{cpus_per_worker!r}")
            es = ElasticRayExecutor.create_settings(
                min_np=min_workers, max_np=max_workers, reset_limit=reset_limit, elastic_timeout=elastic_timeout,
                timeout_s=settings.timeout_s, nics=settings.nics, cooldown_range=cooldown_range)
            self._elastic = ElasticRayExecutor(es, use_gpu=use_gpu, cpus_per_slot=cpus_per_worker,
                                               gpus_per_slot=gpus_per_worker, override_discovery=True)
        if num_workers is not None and num_hosts is not None:
            raise HoraValueError("RayExecutor: give num_workers, or num_hosts and num_workers_per_host, not both")
        # in a Ray Tune trial too: its group holds other bundles
        if num_workers is None and num_hosts is None and self._elastic is None:
            raise HoraValueError("RayExecutor: set num_workers, or num_hosts and num_workers_per_host")
        if gpus_per_worker and not use_gpu:
            raise HoraValueError("RayExecutor: gpus_per_worker is set but use_gpu is False; set use_gpu=True")
        if use_gpu and gpus_per_worker is not None and gpus_per_worker < 1:
            raise HoraValueError(f"RayExecutor: gpus_per_worker must be at least 1, got {gpus_per_worker}")
        for name, value in (("num_workers", num_workers), ("num_hosts", num_hosts),
                            ("num_workers_per_host", num_workers_per_host), ("cpus_per_worker", cpus_per_worker)):
            if value is not None and (not isinstance(value, (int, float)) or value < (0 if name == "cpus_per_worker"
                                                                                     else 1)):
                raise HoraValueError(f"RayExecutor: {name} must be a positive number, got {value!r}")
        self.settings = settings
        self.num_workers, self.num_hosts, self.num_workers_per_host = num_workers, num_hosts, num_workers_per_host
        self.cpus_per_worker, self.use_gpu = cpus_per_worker, use_gpu
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list = []  # the actors, in rank order
        self.places: list[placement.Place] = []  # where each rank runs, in rank order
        self._pg = None
        self._own_pg = False
        self._store = None
        self._secret = ""
        self._scope = ""
        self._calls = 0
        self._shutdowns = 0  # counts shutdown(): a call that sees it change was shut down under it

    # --- start / shutdown ------------------------------------------------------------------------------------
    def start(self, executable_cls: type | None = None, executable_args: list | None = None,
              executable_kwargs: dict | None = None, extra_env_vars: dict | None = None) -> None:
        """Start the actors, give them their ranks, and make ``executable_cls(*args, **kwargs)`` on each. In
        elastic mode (min_workers), only serve the store (each run() starts its own actors, ``extra_env_vars`` set on
        them); ``override_discovery`` has no effect there (Ray's nodes are the hosts: a RayExecutor has no
        ``discovery`` setting to use instead)."""
        if self._elastic is not None:
            if executable_cls is not None:
                raise NotSupportedError(ELASTIC_ONLY_RUN.format(what="executable_cls"))
            self._elastic.env_vars.update({str(k): str(v) for k, v in (extra_env_vars or {}).items()})
            return self._elastic.start()
        if self.workers:
            raise HoraValueError("RayExecutor.start: already started; call shutdown() first")
        try:
            self._start(extra_env_vars or {})
            self._gather([w.start_executable.remote(executable_cls, executable_args, executable_kwargs)
                          for w in self.workers])
        except BaseException:
            self.shutdown()
            raise

    def _start(self, extra_env_vars: dict) -> None:
        import ray
        from ray.util.placement_group import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        refuse_ray_client("RayExecutor")
        current = get_current_placement_group() if self.use_current_placement_group else None
        n = self.num_workers if self.num_workers is not None else self.num_hosts * self.num_workers_per_host
        if current is not None:  # running inside a Ray Tune trial, say: its group holds our resources
            self._pg, index = current, [-1] * n
        else:
            specs, strategy, index = placement.bundles(self.num_workers, self.num_hosts, self.num_workers_per_host,
                                                       self.cpus_per_worker, self.gpus_per_worker)
            self._pg = placement.reserve(specs, strategy, self.settings.placement_group_timeout_s)
            self._own_pg = True
        actor = ray.remote(RayWorker)
        started = [actor.options(num_cpus=self.cpus_per_worker, num_gpus=self.gpus_per_worker, max_restarts=0,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(
                                     self._pg, placement_group_bundle_index=index[i])).remote(i, n)
                   for i in range(n)]
        self.workers = started  # so that shutdown() stops them if what follows fails
        places = [placement.Place(*p) for p in self._gather([w.place.remote() for w in started],
                                                            timeout=self.settings.timeout_s, what="start")]
        plan = placement.plan_ranks(places)
        self.workers = [started[i] for i, _ in plan]
        self.places = [places[i] for i, _ in plan]
        envs = self._serve([s for _, s in plan], self.places, extra_env_vars)
        path = [p for p in sys.path if isinstance(p, str)]
        self._gather([w.setup.remote(env, path) for w, env in zip(self.workers, envs)],
                     timeout=self.settings.timeout_s, what="start")

    def _serve(self, slots: list, places: list[placement.Place], extra_env_vars: dict) -> list[dict[str, str]]:
        """Serve the store here and return each rank's environment (``places`` in rank order). The store listens
        on loopback when every worker shares this node, else on all interfaces, advertised as this node's Ray
        address. With ``use_gpu``, each rank sees every GPU of its node (:func:`placement.visible_devices`)
        unless ``extra_env_vars`` names ``CUDA_VISIBLE_DEVICES``."""
        import ray

        from hora.runner.envs import worker_envs
        from hora.transport.auth import new_secret
        from hora.transport.store import StoreServer

        here = ray.get_runtime_context().get_node_id()
        local = all(p.node_id == here for p in places)
        self._secret = new_secret()
        self._store = StoreServer(self._secret, host="127.0.0.1" if local else "", port=0)
        port = self._store.address.rpartition(":")[2]
        addr = f"127.0.0.1:{port}" if local else f"{ray.util.get_node_ip_address()}:{port}"
        self._scope = f"ray-{uuid.uuid4().hex[:12]}"
        knobs = {"HORA_START_TIMEOUT": str(self.settings.timeout_s)}
        if self.settings.nics:
            knobs["HORA_NETWORK_INTERFACES"] = ",".join(sorted(self.settings.nics))
        extra = {str(k): str(v) for k, v in extra_env_vars.items()}
        envs = worker_envs(slots, knobs, addr, self._secret, self._scope, base={}, extra=extra)
        if self.use_gpu and "CUDA_VISIBLE_DEVICES" not in extra:
            for env, devices in zip(envs, placement.visible_devices(places)):
                if devices is not None:
                    env["CUDA_VISIBLE_DEVICES"] = devices
        return envs

    def shutdown(self) -> None:
        """Stop the actors, release the placement group (when this executor made it) and close the store."""
        import ray

        if self._elastic is not None:
            return self._elastic.shutdown()
        self._shutdowns += 1
        workers, self.workers, self.places = self.workers, [], []
        for w in workers:
            try:
                ray.kill(w, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        if self._pg is not None and self._own_pg:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001 - the cluster went away first
                pass
        self._pg, self._own_pg = None, False
        store, self._store = self._store, None
        if store is not None:
            store.close()

    # --- calls ----------------------------------------------------------------------------------------------
    def run(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None,
            callbacks: list[Callable[[Any], Any]] | None = None) -> list:
        """``fn(*args, **kwargs)`` on every worker; the return values in rank order. Every callback is called
        on every value rank 0 sends with :func:`hora.ray.ray_logger.log`. In elastic mode: the values of the
        last generation's ranks (:class:`hora.ray.ElasticRayExecutor`)."""
        if self._elastic is not None:
            return self._elastic.run(functools.partial(fn, *(args or ()), **(kwargs or {})), callbacks)
        return self._call(functools.partial(_apply, fn, tuple(args or ()), dict(kwargs or {})), callbacks)

    def execute(self, fn: Callable[[Any], Any], callbacks: list[Callable[[Any], Any]] | None = None) -> list:
        """``fn(executable)`` on every worker (the object ``start(executable_cls)`` made); results in rank order."""
        return self._call(fn, callbacks)

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only; its return value."""
        workers = self._live()
        payload, scope = self._payload(fn)
        return self._gather([workers[0].call.remote(payload, scope, None)])[0]

    def run_remote(self, fn: Callable[..., Any], args: list | None = None, kwargs: dict | None = None) -> list:
        """Like :meth:`run`, without waiting: one ``ray.ObjectRef`` per rank, in rank order (``ray.get`` them).
        A rank that raises still tells the others to stop (see the module docstring)."""
        workers = self._live()
        payload, scope = self._payload(functools.partial(_apply, fn, tuple(args or ()), dict(kwargs or {})))
        return [w.call.remote(payload, scope, None) for w in workers]

    def _live(self) -> list:
        if self._elastic is not None:
            raise NotSupportedError(ELASTIC_ONLY_RUN.format(what="execute / execute_single / run_remote"))
        if not self.workers:
            raise LaunchError("RayExecutor: not started (call start() first; after a worker died, shutdown() "
                              "and start() again)")
        return self.workers

    def _payload(self, fn: Callable):
        """(the cloudpickled function, or a ref to it; the call's store scope). Ray sends a small argument inside
        each task, and puts a large one (a closure over a model, say) in its object store once per task; so a
        large one is put there once here, for all ranks."""
        import cloudpickle
        import ray

        if not callable(fn):
            raise HoraValueError(f"RayExecutor needs a function, got {type(fn).__name__}")
        self._calls += 1
        data = cloudpickle.dumps(fn)
        return (ray.put(data) if len(data) > INLINE_MAX else data), f"{self._scope}/{self._calls}"

    def _call(self, fn: Callable, callbacks: list | None) -> list:
        from hora.ray.ray_logger import Relay

        workers = self._live()
        store = self._store
        payload, scope = self._payload(fn)
        if not callbacks or store is None:
            return self._gather([w.call.remote(payload, scope, None) for w in workers])
        key = f"{scope}/ray_log"
        relay = Relay(f"127.0.0.1:{store.address.rpartition(':')[2]}", self._secret, key, callbacks)
        try:
            results = self._gather([w.call.remote(payload, scope, key) for w in workers])
        except BaseException:
            try:
                relay.close()
            except Exception:  # noqa: BLE001 - the job's own error is the one to see
                pass
            raise
        relay.close()
        return results

    # --- results and failures ----------------------------------------------------------------------------------
    def _gather(self, refs: list, timeout: float | None = None, what: str = "call") -> list:
        """The values of ``refs`` (one per rank, in rank order), or the error that explains the failure.

        An exception that is not Ray's while waiting (Ctrl-C: ``KeyboardInterrupt``) leaves the actors busy with
        a call nobody waits for, so the ranks are told to stop and the executor is shut down before it goes on."""
        shutdowns = self._shutdowns
        try:
            results, failed, late, lost = self._wait(refs, timeout)
        except BaseException:
            if self._shutdowns == shutdowns:
                self._stop_all()
            raise
        if lost is not None and self._shutdowns != shutdowns:
            raise LaunchError(f"RayExecutor: the executor was shut down (shutdown() was called) during a {what}; "
                              "call start() for a new job") from lost[1]
        if lost is not None:
            self._lost(*lost, what)
        if failed:
            if late:
                self.shutdown()
            _raise_task_error(failed, late, self.settings.timeout_s + FAILURE_GRACE_S, self.places)
        if late:
            self.shutdown()
            raise LaunchError(f"RayExecutor: ranks {late} did not {'start' if what == 'start' else 'answer'} within "
                              f"{timeout:g} s (settings.timeout_s); the workers were stopped")
        return results

    def _wait(self, refs: list, timeout: float | None) -> tuple[list, list, list[int], tuple | None]:
        """Wait for ``refs``: (results, [(rank, RayTaskError, when)], ranks that had not answered, (rank, RayActorError)
        of a dead actor or None). After one rank raised, the others get ``settings.timeout_s`` + the grace."""
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: r for r, ref in enumerate(refs)}
        results: list = [None] * len(refs)
        failed: list[tuple[int, RayTaskError, float]] = []
        pending = list(refs)
        deadline = None if timeout is None else time.monotonic() + timeout
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = _wait_one(pending, left)
            if not ready:
                break
            rank = rank_of[ready[0]]
            try:
                results[rank] = ray.get(ready[0])
            except RayActorError as e:
                return results, failed, [], (rank, e)
            except RayTaskError as e:  # the worker has told the other ranks already (hora.ray.worker)
                failed.append((rank, e, time.time()))
                grace = self.settings.timeout_s + FAILURE_GRACE_S
                if deadline is None or deadline - time.monotonic() > grace:
                    deadline = time.monotonic() + grace
        return results, failed, sorted(rank_of[r] for r in pending), None

    def _stop_all(self) -> None:
        """Count a failure (the ranks' watchers shut hora down) and shut the executor down."""
        store = self._store
        if store is not None:
            failures = _Failures.connect_to(f"127.0.0.1:{store.address.rpartition(':')[2]}", self._secret,
                                            self._scope)
            if failures is not None:
                failures.report()
                failures.close()
        self.shutdown()

    def _lost(self, rank: int, error: Exception, what: str) -> None:
        where = self.places[rank] if rank < len(self.places) else None
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
        o = outcome.RankOutcome(rank, host=where.address if where else None, pid=where.pid if where else None,
                                lost=f"(its worker actor) died during a {what}: {reason}")
        self.shutdown()
        raise LaunchError(f"RayExecutor: {outcome.headline(o)}. A job cannot go on without one of its "
                          "ranks, so its other workers were stopped; call start() for a new job") from error


def _wait_one(pending: list, timeout: float | None) -> tuple[list, list]:
    """``ray.wait(pending, num_returns=1, timeout=timeout)``; from the main thread, on a thread of its own while
    the main thread waits for it in Python (an interruptible lock), so that a signal handler's exception reaches
    the caller as it is (see the module docstring). Ray's check of signals does nothing outside the main thread."""
    import ray

    if threading.current_thread() is not threading.main_thread():
        return ray.wait(pending, num_returns=1, timeout=timeout)
    box: list = []
    done = threading.Event()

    def wait() -> None:
        try:
            box.append(ray.wait(pending, num_returns=1, timeout=timeout))
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box.append(e)
        finally:
            done.set()

    threading.Thread(target=wait, name="hora-ray-wait", daemon=True).start()
    while not done.wait(0.2):  # a signal's handler runs here (an exception from it leaves; the thread ends
        pass  # with the actors); the timeout: _thread.interrupt_main() only marks it, with no signal to wake us
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _clean(tb: str) -> str:
    """Ray's remote traceback without its terminal colours and the caret lines left under frames it hid."""
    tb = re.sub(r"\x1b\[[0-9;]*m", "", tb)
    return "\n".join(line for line in tb.splitlines() if line.strip().strip("^~") or not line.strip())


def _raise_task_error(failed: list, late: list[int], grace: float, places: list) -> None:
    """Re-raise the root cause (:func:`hora.base.outcome.root_cause`) of the ranks' task errors."""
    from hora.runner.api import RemoteTraceback

    outcomes, errors = [], {}
    for rank, err, when in failed:
        exc = getattr(err, "cause", None)
        where = places[rank] if rank < len(places) else None
        o = outcome.from_exception(rank, exc if isinstance(exc, BaseException) else err,
                                   _clean(getattr(err, "traceback_str", "") or str(err)),
                                   host=where.address if where else None, pid=where.pid if where else None)
        o.time, errors[rank] = when, exc
        outcomes.append(o)
    root = outcome.root_cause(outcomes)
    exc = errors[root.rank]
    if not isinstance(exc, BaseException):
        exc = LaunchError(f"RayExecutor: {outcome.headline(root)}")
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(f"RayExecutor: {outcome.report(outcomes, tail=False)}")
        exc.add_note(f"(raised on rank {root.rank} of a RayExecutor job; its traceback is above"
                     + (f"; ranks {late} had not finished {grace:g} s later and were stopped)" if late
                        else ")"))
    raise exc.with_traceback(None) from RemoteTraceback(f"\n\nTraceback on rank {root.rank}:\n{root.traceback}")
