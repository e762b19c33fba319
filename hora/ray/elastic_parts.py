"""The Ray parts of :class:`hora.ray.ElasticRayExecutor`: the elastic driver's pool (Ray actors) and its
discovery (Ray's nodes), plugged into :class:`hora.runner.elastic.driver.Driver` in place of processes and a
discovery script. The driver only uses what its own pool and discovery offer (see ``Driver.__init__``).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

from hora.runner.elastic.workers import Proc

_POLL_S = 1.0  # how often Ray's node list is read
_STOP_WAIT_S = 10.0  # how long stop_all() waits for a killed actor's end to be seen


def driver_settings(s: Any) -> dict[str, Any]:
    """The driver's settings (:func:`hora.runner.elastic.settings.settings_from`'s keys) from ElasticSettings;
    the first generation has as many workers as the nodes offer, up to ``max_np``."""
    from hora.base import knobs

    return {"np": None, "min_np": s.min_np, "max_np": s.max_np, "elastic_timeout": float(s.elastic_timeout),
            "start_timeout": float(s.timeout_s), "reset_limit": s.reset_limit, "cooldown": s.cooldown_range,
            "blacklist_after": knobs.value("elastic_blacklist_after"),
            "slot_failures": knobs.value("elastic_slot_failures"),
            "failure_resets": knobs.value("elastic_failure_resets"),
            "restart_on_loss": knobs.value("elastic_restart_on_loss"),
            "discovery_grace": knobs.value("elastic_discovery_grace")}


class RayDiscovery:
    """Hosts and slots from Ray's alive nodes, read every second in a thread; a node is named by its address
    (``addr#1``, ``addr#2`` for further nodes at the same address, in first-seen order, see ``_name``). With
    ``source`` (Horovod's discovery object: ``find_available_hosts_and_slots()``), the hosts come from it and
    are matched to nodes by address or node ID."""

    def __init__(self, cpus_per_slot: float, gpus_per_slot: float, source: Any = None):
        self.cpus_per_slot, self.gpus_per_slot, self.source = cpus_per_slot, gpus_per_slot, source
        self.what = "Ray's node list" if source is None else "the discovery of ElasticSettings"
        self.hosts: dict[str, int] | None = None
        self.problem: str | None = None
        self.node_of: dict[str, str] = {}  # host name -> Ray node ID
        self._name_of: dict[str, str] = {}  # Ray node ID -> its host name: given once, first seen first, kept
        self._taken: dict[str, int] = {}  # address -> how many names it has given
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hora-ray-discovery", daemon=True)

    def read(self) -> None:
        import ray

        nodes = sorted((n for n in ray.nodes() if n.get("Alive")), key=lambda n: n["NodeID"])
        names: dict[str, str] = {}
        slots: dict[str, int] = {}
        for n in nodes:
            name = self._name(n["NodeID"], n["NodeManagerAddress"])
            names[name] = n["NodeID"]
            res = n.get("Resources", {})
            count = int(res.get("CPU", 0) // self.cpus_per_slot)
            if self.gpus_per_slot:
                count = min(count, int(res.get("GPU", 0) // self.gpus_per_slot))
            if count > 0:
                slots[name] = count
        if self.source is not None:
            by_id = {v: v for v in names.values()}
            wanted = dict(self.source.find_available_hosts_and_slots())
            names = {h: names.get(h) or by_id.get(h) for h in wanted}
            unknown = sorted(h for h, nid in names.items() if nid is None)
            self.problem = f"hosts that are no Ray node: {' '.join(unknown)}" if unknown else None
            slots = {h: int(n) for h, n in wanted.items() if names.get(h) and int(n) > 0}
            names = {h: nid for h, nid in names.items() if nid}
        self.node_of.update(names)
        self.hosts = slots

    def _name(self, node_id: str, addr: str) -> str:
        """A node's host name: its address, ``addr#1``, ``addr#2`` for further nodes at that address, given
        once in first-seen order and never reused, so that a host name (a slot ``host:index``, a blacklist
        entry) always means the same node, even after the node before it at that address has gone."""
        name = self._name_of.get(node_id)
        if name is None:
            k = self._taken[addr] = self._taken.get(addr, 0) + 1
            name = self._name_of[node_id] = addr if k == 1 else f"{addr}#{k - 1}"
        return name

    def _loop(self) -> None:
        while not self._stop.wait(_POLL_S):
            try:
                self.read()
            except Exception as e:  # noqa: BLE001 - keep the last good list, say why
                self.problem = f"reading Ray's nodes failed: {e}"

    def start(self) -> "RayDiscovery":
        self.read()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(_POLL_S + 5)


class ElasticActor:
    """The actor of one slot: runs ``worker_fn`` once with the slot's environment (``env``, the secret
    included, arrives as this method's argument; it goes into ``os.environ`` before hora reads it)."""

    def gpu_ids(self) -> list[str]:
        """The GPU IDs Ray gave this actor (what its node's ``CUDA_VISIBLE_DEVICES`` is made of)."""
        import ray

        return [str(g) for g in ray.get_gpu_ids()]

    def run(self, env: dict[str, str], sys_path: list[str], payload: bytes, log_key: str | None) -> tuple:
        import cloudpickle

        from hora.ray import ray_logger

        os.environ.update(env)  # CUDA_VISIBLE_DEVICES among them with use_gpu (ActorPool._devices)
        sys.path.extend(p for p in sys_path if p not in sys.path)
        fn = cloudpickle.loads(payload)
        ray_logger._configure(log_key, None)
        try:
            value = fn()
        except SystemExit as e:  # the driver told it to leave (hora.elastic's "exit" answer), or fn exited
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            return ("exit", code, None)
        return ("ok", 0, (*elastic_place(), value))


def elastic_place() -> tuple[int, int | None]:
    """This elastic worker's (generation, rank) in its current generation; (0, None) before it has one (a late
    joiner that has not been placed yet is no rank, rank 0 least of all)."""
    from hora.elastic import place

    return place()


class _ActorEnd:
    """What the driver reads of a worker (``done``, ``returncode``, ``lost``), for an actor."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.done = threading.Event()
        self.returncode: int | None = None
        self.lost: str | None = None
        self.proc = None
        self.session = None
        self.threads: list = []
        self.value: tuple | None = None  # (generation, rank, worker_fn's value) when it returned
        self.error: BaseException | None = None  # worker_fn's exception


class ActorPool:
    """The driver's pool, with one Ray actor per started worker (see :mod:`hora.ray.elastic`)."""

    def __init__(self, worker_fn: Callable[[], Any], discovery: RayDiscovery, cpus: float, gpus: float,
                 log_key: str | None):
        import cloudpickle
        import ray

        self._payload = ray.put(cloudpickle.dumps(worker_fn))
        self._discovery, self._cpus, self._gpus, self._log_key = discovery, cpus, gpus, log_key
        self._actor = ray.remote(ElasticActor)
        self._path = [p for p in sys.path if isinstance(p, str)]
        self.procs: list[Proc] = []
        self.exits: queue.Queue[Proc] = queue.Queue()
        self._number = 0
        self._gpu_of: dict[int, list[str]] = {}  # worker number -> the GPU IDs Ray gave its actor
        self._reported = threading.Condition()

    @property
    def next_number(self) -> int:
        return self._number + 1

    def start(self, wid: str, host: str, index: int, env: dict[str, str]) -> Proc:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self._number += 1
        node = self._discovery.node_of[host]
        actor = self._actor.options(num_cpus=self._cpus, num_gpus=self._gpus, max_restarts=0,
                                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
        end = _ActorEnd(actor)
        p = Proc(wid, host, index, self._number, end)
        self.procs.append(p)
        threading.Thread(target=self._wait, args=(p, env), daemon=True, name=f"hora-ray-wait-{p.number}").start()
        return p

    def _devices(self, p: Proc) -> str | None:
        """``CUDA_VISIBLE_DEVICES`` for ``p``: every GPU Ray gave the live actors of its node, in slot-index
        order (the local-rank order of a generation with all of them), as the static RayExecutor shows them
        (:func:`hora.ray.placement.visible_devices`), so that device ``local_rank()`` exists. Ray assigns an
        actor's GPUs when it is made, so this waits (up to ``_STOP_WAIT_S``) for the node's other live actors
        to report theirs."""
        import ray

        from hora.ray import placement

        ids = [str(g) for g in ray.get(p.worker.actor.gpu_ids.remote())]
        with self._reported:
            self._gpu_of[p.number] = ids
            self._reported.notify_all()
            deadline = time.monotonic() + _STOP_WAIT_S
            while True:
                peers = sorted((q for q in self.procs if q.host == p.host and not q.done), key=lambda q: q.index)
                if all(q.number in self._gpu_of for q in peers) or time.monotonic() > deadline:
                    break
                self._reported.wait(0.2)
            peers = [q for q in peers if q.number in self._gpu_of] or [p]
            places = [placement.Place(q.host, q.host, q.number, tuple(self._gpu_of.get(q.number, ids)))
                      for q in peers]
        return placement.visible_devices(places)[0]

    def _wait(self, p: Proc, env: dict[str, str]) -> None:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        end = p.worker
        try:
            if self._gpus and "CUDA_VISIBLE_DEVICES" not in env:
                devices = self._devices(p)
                env = {**env, "CUDA_VISIBLE_DEVICES": devices} if devices else env
            kind, code, value = ray.get(end.actor.run.remote(env, self._path, self._payload, self._log_key))
            end.returncode = code
            if kind == "ok":
                end.value = value
        except RayTaskError as e:  # worker_fn raised
            end.returncode, end.error = 1, e.as_instanceof_cause()
            print(f"hora ray: worker {p.number} ({p.wid}) raised: {e}", file=sys.stderr, flush=True)
        except RayActorError as e:  # the actor died: a kill, to the driver; or it was never made: a host fault
            unborn = bool(getattr(e, "actor_init_failed", False))
            end.returncode = 1 if unborn else -signal.SIGKILL
            print(f"hora ray: worker {p.number} ({p.wid}) {'could not start' if unborn else 'died'}: {e}",
                  file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - Ray itself failed: the worker is lost
            end.returncode, end.lost = None, f"was lost ({type(e).__name__}: {e})"
        try:
            ray.kill(end.actor, no_restart=True)  # done either way: free its slot at once
        except Exception:  # noqa: BLE001 - already gone
            pass
        p.ended = time.monotonic()
        end.done.set()
        self.exits.put(p)

    def live(self) -> list[Proc]:
        return [p for p in self.procs if not p.done]

    def signal(self, procs: list[Proc], sig: int) -> None:
        """Any signal ends an actor (Ray has no other): ``ray.kill``."""
        import ray

        for p in procs:
            try:
                ray.kill(p.worker.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def check_sessions(self) -> None:
        """Nothing to check: an actor's end is seen by its wait thread."""

    def stop_all(self) -> None:
        live = self.live()
        self.signal(live, signal.SIGKILL)
        deadline = time.monotonic() + _STOP_WAIT_S
        for p in live:
            p.worker.done.wait(max(0.0, deadline - time.monotonic()))

    def outcome(self, rc: int, why: str | None = None) -> list:
        """``run``'s answer: the values of the last generation's ranks in rank order; or the job's failure
        raised (worker_fn's own exception when it is what failed last, else LaunchError with the driver's why)."""
        values = [p.worker.value for p in self.procs if p.worker.value is not None and p.worker.value[1] is not None]
        if rc == 0 and values:
            last = max(g for g, _r, _v in values)
            ranks = sorted(((r, v) for g, r, v in values if g == last), key=lambda t: t[0])
            return [v for _r, v in ranks]
        from hora.base.errors import JobFailed

        # the last worker that failed of itself (not one told by the driver that the job failed): when
        # worker_fn raised there, that is the job's failure; else (a kill, a reset limit) the driver's reason is
        failed = [p for p in self.procs if p.done and not p.stopping and p.worker.returncode != 0
                  and not isinstance(p.worker.error, JobFailed)]
        if failed:
            last = max(failed, key=lambda p: p.ended)
            if last.worker.error is not None and rc != 0:
                raise last.worker.error
        from hora.base.errors import LaunchError

        raise LaunchError(f"the elastic Ray job failed (status {rc}): {why or 'see the driver log above'}")
