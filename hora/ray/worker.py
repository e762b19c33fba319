"""The body of one worker actor: Horovod's ``BaseHorovodWorker``, plus what hora needs to run a rank in it.

The driver (:class:`hora.ray.RayExecutor`) makes this class a Ray actor, asks each instance where it runs
(:meth:`place`), then hands it its rank's environment (:meth:`setup`: the ``HORA_*`` contract of
:func:`hora.runner.envs.worker_envs`, the job secret included). The environment arrives as an actor-method
argument, so the secret travels inside Ray's own channels (token-authenticated; encrypted only with Ray's TLS
on, see docs/ray.md) and never on a command line; it goes into this process's ``os.environ`` after the process
started, which ``/proc/<pid>/environ`` does not show. hora reads it when the user's function calls
``hvd.init()``.

Functions arrive cloudpickled and are unpickled here, after the driver's ``sys.path`` has been added to ours,
so a function defined in a module next to the driver's script (or in a test module) is found, as under
``hora.run()``.
"""

from __future__ import annotations

import inspect
import os
import socket
import sys
import threading
import types
from typing import Any, Callable

from hora.base import contract

_HIDDEN = "<hidden>"


def _shutdown_hora() -> None:
    """Close hora on this rank, if it is open: after the user's function raised here (as the process exiting
    would under ``hora run``, so that peers blocked in a collective with this rank fail within seconds), or
    when another rank's did (:func:`_watch`). A later call starts again with ``hvd.init()``."""
    core = sys.modules.get("hora.core.basics")
    if core is not None and core.is_initialized():
        core.shutdown()


class BaseHorovodWorker:
    """One rank of a Ray job (Horovod's name). ``executable`` is the object made by ``start(executable_cls)``,
    passed to the functions of ``RayExecutor.execute``."""

    executable: Any = None

    def __init__(self, world_rank: int = 0, world_size: int = 1):
        self._rank = world_rank
        self._size = world_size
        self._job: str | None = None  # the job's store scope, from setup()
        self._seen = 0
        self._failures: _Failures | None = None

    # --- Horovod's methods -------------------------------------------------------------------------------
    def hostname(self) -> str:
        return socket.gethostname()

    def get_gpu_ids(self) -> list:
        """The GPU IDs Ray assigned to this actor (``ray.get_gpu_ids()``)."""
        import ray

        return ray.get_gpu_ids()

    def update_env_vars(self, env_vars: dict[str, Any]) -> None:
        """Set variables in this actor's environment (values become strings)."""
        os.environ.update({str(k): str(v) for k, v in env_vars.items()})

    def env_vars(self) -> dict[str, str]:
        """This actor's environment, with the job secret hidden."""
        env = dict(os.environ)
        if "HORA_SECRET" in env:
            env["HORA_SECRET"] = _HIDDEN
        return env

    def start_executable(self, executable_cls: type | None = None, executable_args: list | None = None,
                         executable_kwargs: dict | None = None) -> None:
        """Make ``executable_cls(*args, **kwargs)`` this worker's ``executable`` (None when no class)."""
        if executable_cls is not None:
            self.executable = executable_cls(*(executable_args or []), **(executable_kwargs or {}))

    def execute(self, func: Callable[[Any], Any]) -> Any:
        """``func(self.executable)``. A raised exception shuts hora down on this rank (see :func:`_shutdown_hora`)."""
        try:
            return func(self.executable)
        except BaseException:
            _shutdown_hora()
            raise

    def set_queue(self, queue) -> None:
        """Horovod's hook for a Ray queue; hora's callbacks travel through the job's store instead
        (:mod:`hora.ray.ray_logger`), so this is accepted and has no effect."""

    def node_id(self) -> str:
        """The ID of the Ray node this actor runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # --- hora's ------------------------------------------------------------------------------------------
    def place(self) -> tuple[str, str, int, list[str]]:
        """(Ray node ID, node address, pid, the GPU IDs Ray gave this actor): what the driver plans ranks and
        ``CUDA_VISIBLE_DEVICES`` from."""
        import ray

        return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid(),
                [str(g) for g in ray.get_gpu_ids()])

    def setup(self, env: dict[str, str], sys_path: list[str]) -> None:
        """Take this rank's environment (replacing any ``HORA_*``/``HOROVOD_*`` topology a previous job left)
        and the driver's ``sys.path``."""
        for name in contract.ALL:
            os.environ.pop("HORA_" + name, None)
            os.environ.pop("HOROVOD_" + name, None)
        os.environ.update(env)
        self._rank = int(env["HORA_RANK"])
        self._size = int(env["HORA_SIZE"])
        self._job = env["HORA_STORE_SCOPE"]
        self._seen = 0  # the job's failure count (_Failures) when this rank's last call began
        self._failures = None  # the connection to count them, made on the first call
        sys.path.extend(p for p in sys_path if p not in sys.path)

    def call(self, payload: bytes, scope: str, log_key: str | None) -> Any:
        """Run a cloudpickled ``func(executable)`` under a fresh store scope (``HORA_STORE_SCOPE``), so one
        call's ``hvd.init()`` can never meet a rendezvous left half done by an earlier failed call.

        Failures are counted in the store for the whole job (:class:`_Failures`): a rank whose function raises
        counts one before its exception leaves, whichever executor method sent the call. While a call runs, a
        thread shuts hora down here as soon as any rank counts one (:func:`_watch`), so no rank waits for the
        failed one in a collective. A call that begins after a failure (of this call's predecessor on another
        rank, say, which failed after this rank had returned) begins with hora shut down, so that every rank
        of it initialises afresh instead of some joining the new rendezvous and others keeping the old job."""
        import cloudpickle

        from hora.ray import ray_logger

        os.environ["HORA_STORE_SCOPE"] = scope
        if self._failures is None:  # one connection for the actor's life; the watcher makes its own
            self._failures = _Failures.connect(self._job)
        failures = self._failures
        seen = failures.count() if failures is not None else None
        if seen is None:  # no store to ask: the executor is going away
            seen = self._seen
        elif seen > self._seen:
            _shutdown_hora()
        self._seen = seen
        ray_logger._configure(log_key, self._rank)
        done = threading.Event()
        if failures is not None:
            threading.Thread(target=_watch, args=(failures.job, seen, done), daemon=True,
                             name="hora-ray-abort").start()
        try:
            func = cloudpickle.loads(payload)
            return self.execute(func)
        except BaseException:
            if failures is not None:
                failures.report()
            raise
        finally:
            done.set()
            ray_logger._configure(None, self._rank)


FAILURES = "failures"  # under the job's scope: how many times a rank's call failed (the store's atomic ADD)


class _Failures:
    """The job's failure count in the store: ``<job>/failures``, and ``<job>/failed/<n>`` set by the n-th
    failure, which a watcher can wait for without polling."""

    def __init__(self, client, job: str):
        self.client, self.job = client, job

    @classmethod
    def connect(cls, job: str | None) -> "_Failures | None":
        """From a worker (the store's address and secret are in its environment): a connection to the job's
        store, or None outside a started job."""
        from hora.base import env

        return cls.connect_to(env.get("STORE_ADDR") or "", env.get("SECRET") or "", job) if job else None

    @classmethod
    def connect_to(cls, addr: str, secret: str, job: str) -> "_Failures | None":
        """A connection to the store at ``addr``, or None when it is gone (the executor is shutting down)."""
        from hora.transport.store import StoreClient

        try:
            return cls(StoreClient(addr, secret, timeout=10), job)
        except Exception:  # noqa: BLE001 - no store: nothing to count, nobody to tell
            return None

    def count(self) -> int | None:
        """The job's failure count, or None when the store cannot be asked."""
        try:
            return self.client.add(f"{self.job}/{FAILURES}", 0)
        except Exception:  # noqa: BLE001 - the store closed: the executor is shutting down
            return None

    def report(self) -> None:
        """Count a failure, so every rank in a call now shuts hora down and every later call starts afresh."""
        try:
            n = self.client.add(f"{self.job}/{FAILURES}")
            self.client.set(failed_key(self.job, n), b"1")
        except Exception:  # noqa: BLE001 - the store closed: the executor is shutting down anyway
            pass

    def close(self) -> None:
        self.client.close()


def failed_key(job: str, n: int) -> str:
    return f"{job}/failed/{n}"


def _watch(job: str, seen: int, done: threading.Event) -> None:
    """Until the call is ``done``: once the job counts more than ``seen`` failures (a rank failed), shut hora
    down here, so a collective this rank waits in raises ``ShutdownError`` at once (a peer that shut down on
    purpose need not end a collective that this rank submits afterwards)."""
    from hora.transport.store import StoreTimeout

    failures = _Failures.connect(job)
    if failures is None:
        return
    try:
        while not done.is_set():
            try:
                failures.client.get(failed_key(job, seen + 1), timeout=0.5)
            except StoreTimeout:
                continue
            # and again until the call ends: an hvd.init() that was under way completes after the first
            while not done.is_set():
                _shutdown_hora()
                done.wait(0.05)
            return
    except Exception:  # noqa: BLE001 - the store closed (shutdown): the call is over anyway
        return
    finally:
        failures.close()


def _own_copy(f: Callable) -> Callable:
    """A function like ``f`` that is a different object (same code, defaults and globals)."""
    g = types.FunctionType(f.__code__, f.__globals__, f.__name__, f.__defaults__, f.__closure__)
    g.__kwdefaults__, g.__doc__, g.__qualname__ = f.__kwdefaults__, f.__doc__, f.__qualname__
    return g


# What the executor makes a Ray actor. ``ray.remote`` sets a new ``__signature__`` (with a ``_ray_trace_ctx``
# parameter) on the functions of the class it is given, so it is given a subclass with its own copies of them
# and Horovod's ``BaseHorovodWorker`` keeps the signatures users see.
RayWorker = type("RayWorker", (BaseHorovodWorker,),
                 {"__module__": __name__, "__qualname__": "RayWorker", "__doc__": "A BaseHorovodWorker as a Ray actor",
                  **{k: _own_copy(v) for k, v in vars(BaseHorovodWorker).items() if inspect.isfunction(v)}})
