"""The Spark parts of ``hora.spark.run_elastic``: the elastic driver's pool (Spark tasks) and its discovery
(the executors those tasks run on), plugged into :class:`hora.runner.elastic.driver.Driver` in place of
processes and a discovery script, as :mod:`hora.ray.elastic_parts` plugs in Ray's actors and nodes.

:class:`TaskPool` keeps ``max_np`` tasks (:mod:`hora.spark.elastic_task`) submitted, each a one-partition
Spark job of its own from a thread of its own: a lost task fails only its job. Spark runs as many at once
as it has free task slots; the others wait in Spark's queue and start when an executor joins. A task that
registers is a slot on its host (the address it reaches the driver from), ``host:index`` with the lowest
index free there; ``start(wid, host, index, env)`` hands a worker to that slot's task by a command in the
store (it waits while the task's last worker is still ending). A task that is lost (its job ended, Spark
tried it again, or it stopped beating for ``LOST_AFTER_S``) ends its worker as lost and is replaced by a fresh
task, up to ``RESUBMITS`` times per task wanted.

:class:`TaskDiscovery` lists, per host, the tasks that are up: a new executor's tasks are added slots, a lost
task a removed one; ``slots(hosts)`` names them (a lost task leaves a hole in its host's indices). The first
list waits for ``num_proc`` tasks (or, past ``start_timeout``, for ``min_np``).
"""

from __future__ import annotations

import pickle
import queue
import signal
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from hora.runner.elastic.workers import Proc
from hora.spark import elastic_task
from hora.spark.relay import Relay

POLL_S = 0.1  # the pool's own loop: registrations, beats, exits, output, pending starts
LOST_AFTER_S = 15.0  # a busy task that has not beaten for this long is lost (its executor hangs or is gone)
RESUBMITS = 3  # lost tasks replaced per task wanted, then no more (a crash loop ends in the driver's policy)
STOP_WAIT_S = 10.0


class _End:
    """What the driver reads of a worker (``done``, ``returncode``, ``lost``, ``tail``), for a task's worker."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.returncode: int | None = None
        self.lost: str | None = None
        self.tail: list[str] = []
        self.pid: int | None = None  # its task's Python worker (the worker's own pid is not reported)
        self.proc = None
        self.session = None
        self.threads: list = []
        self.tid: int | None = None  # the task running it; None while it waits for a free one


@dataclass
class _Task:
    tid: int
    host: str | None = None
    index: int = 0  # its slot on its host (host:index): the lowest free one when it registered
    pid: int | None = None
    gone: bool = False
    busy: Proc | None = None
    commands: int = 0
    beat: int = 0
    beat_at: float = 0.0


class TaskPool:
    """The driver's pool (see the module docstring); its own thread runs :meth:`_loop`."""

    def __init__(self, sc: Any, spec: elastic_task.Spec, store: Any, tasks: int, group: str, relay: Relay,
                 pending_limit: float) -> None:
        self.sc, self.spec, self.store, self.wanted, self.group = sc, spec, store, tasks, group
        self.relay, self.pending_limit = relay, pending_limit
        self.procs: list[Proc] = []
        self.exits: queue.Queue[Proc] = queue.Queue()
        self.tasks: dict[int, _Task] = {}
        self.refused: str | None = None  # a task could not start (its Python cannot load the function ...)
        self._pending: list[tuple[Proc, dict[str, str], float]] = []
        self._number = 0
        self._resubmits = RESUBMITS * tasks
        self._lock = threading.RLock()
        self._over = threading.Event()  # the pool's loop stops
        self._closing = False  # stop_all began: lost tasks are not replaced
        self._threads: list[threading.Thread] = []

    # --- what the driver's Pool offers
    @property
    def next_number(self) -> int:
        return self._number + 1

    def start(self, wid: str, host: str, index: int, env: dict[str, str]) -> Proc:
        with self._lock:
            self._number += 1
            p = Proc(wid, host, index, self._number, _End())
            self.procs.append(p)
            self._pending.append((p, env, time.monotonic()))
            self._dispatch()
        return p

    def live(self) -> list[Proc]:
        return [p for p in self.procs if not p.done]

    def signal(self, procs: list[Proc], sig: int) -> None:
        """A waiting worker ends at once; a running one gets ``sig`` from its task."""
        with self._lock:
            for p in procs:
                if p.done:
                    continue
                if p.worker.tid is None:
                    self._pending = [e for e in self._pending if e[0] is not p]
                    self._end(p, -sig, None)
                else:
                    n = self.store.get(f"{self.spec.prefix}/sig/{p.number}") or b"0"
                    self.store.set(f"{self.spec.prefix}/sig/{p.number}", f"{int(n.split()[0]) + 1} {sig}".encode())

    def check_sessions(self) -> None:
        """Nothing to check: the pool's thread sees the tasks' ends."""

    def stop_all(self) -> None:
        """Tell every task to return, kill the workers, cancel the tasks that never started."""
        self._closing = True
        self.store.set(f"{self.spec.prefix}/over", b"1")
        self.signal(self.live(), signal.SIGKILL)
        deadline = time.monotonic() + STOP_WAIT_S
        while self.live() and time.monotonic() < deadline:
            time.sleep(POLL_S)
        with self._lock:
            up = [t.tid for t in self.tasks.values() if t.host is not None and not t.gone]
        while any(not self.tasks[tid].gone for tid in up) and time.monotonic() < deadline:
            time.sleep(POLL_S)  # the tasks that run return on their own (their jobs end cleanly)
        self._over.set()
        self.sc.cancelJobGroup(self.group)  # the tasks still in Spark's queue
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()) + 1)
        with self._lock:
            for p in self.live():
                self._end(p, None, "was still running when the job ended")
            self.relay.pull(self.store.get, self.store.set, [p.number for p in self.procs], final=True)

    # --- the discovery's view
    def slots(self, hosts: dict[str, int]) -> list[tuple[str, str, int]]:
        """The elastic driver's slots (wid, host, index) of the tasks up on ``hosts``, at most ``hosts[h]`` on
        each: a slot is a task, so a lost task removes its own slot, not the host's last one."""
        with self._lock:
            out = []
            for h, n in hosts.items():
                indices = sorted(t.index for t in self.tasks.values() if t.host == h and not t.gone)
                out += [(f"{h}:{i}", h, i) for i in indices[:n]]
            return out

    def hosts(self) -> dict[str, int]:
        """Tasks up per host (hosts in the order of their first task)."""
        with self._lock:
            out: dict[str, int] = {}
            for t in self.tasks.values():
                if t.host is not None and not t.gone:
                    out[t.host] = out.get(t.host, 0) + 1
            return out

    # --- tasks
    def launch(self) -> None:
        with self._lock:
            for _ in range(self.wanted):
                self._submit()
        t = threading.Thread(target=self._loop, name="hora-spark-elastic", daemon=True)
        t.start()
        self._threads.append(t)

    def _submit(self) -> None:
        from pyspark import InheritableThread

        tid = len(self.tasks)
        self.tasks[tid] = _Task(tid)
        fn = partial(elastic_task.main, self.spec, tid)

        def job() -> None:
            error = None
            try:
                self.sc.setJobGroup(self.group, f"hora.spark.run_elastic: task {tid}", interruptOnCancel=True)
                self.sc.parallelize([tid], 1).mapPartitions(fn).collect()
            except BaseException as e:  # noqa: BLE001 - the task's end is what matters
                error = e
            if error is not None and self.tasks[tid].host is None and not self._closing:  # Spark gave up on it
                self.refused = self.refused or (f"hora.spark.run_elastic: a Spark task failed before it started: "
                                                f"{_first_line(error)}")
            self._lost(tid, "its Spark task ended" + (f" ({_first_line(error)})" if error else ""))

        thread = InheritableThread(target=job, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _lost(self, tid: int, why: str) -> None:
        with self._lock:
            t = self.tasks[tid]
            if t.gone:
                return
            t.gone = True
            if t.busy is not None and not t.busy.done:
                self.relay.pull(self.store.get, self.store.set, [t.busy.number], final=True)
                self._end(t.busy, None, f"was lost: {why}")
            t.busy = None
            if not self._closing and self._resubmits > 0:
                self._resubmits -= 1
                self._submit()

    def _loop(self) -> None:
        while not self._over.wait(POLL_S):
            with self._lock:
                self._poll()

    def _poll(self) -> None:
        now, prefix, get = time.monotonic(), self.spec.prefix, self.store.get
        for t in list(self.tasks.values()):
            if t.gone:
                continue
            if t.host is None:
                raw = get(f"{prefix}/up/{t.tid}")
                if raw is not None:
                    host, t.pid, problem = pickle.loads(raw)
                    taken = {u.index for u in self.tasks.values() if u.host == host and not u.gone}
                    t.host, t.index, t.beat_at = host, min(set(range(len(taken) + 1)) - taken), now
                    if problem:
                        self.refused = self.refused or problem
                        t.gone = True
                continue
            beat = int(get(f"{prefix}/beat/{t.tid}") or b"0")
            if beat != t.beat:
                t.beat, t.beat_at = beat, now
            elif now - t.beat_at > LOST_AFTER_S:
                self._lost(t.tid, f"its Spark task on {t.host} stopped answering for {LOST_AFTER_S:g} s")
                continue
            p = t.busy
            if p is not None:
                code = get(f"{prefix}/exit/{p.number}")
                if code is not None:
                    self.relay.pull(get, self.store.set, [p.number], final=True)
                    self._end(p, int(code), None)
                    t.busy = None
        self.relay.pull(get, self.store.set, [p.number for p in self.procs if p.worker.tid is not None])
        self._dispatch()

    def _dispatch(self) -> None:
        """Hand waiting workers to free tasks on their host; end those that waited ``pending_limit`` s."""
        now, left = time.monotonic(), []
        for p, env, since in self._pending:
            free = [t for t in self.tasks.values()
                    if (t.host, t.index) == (p.host, p.index) and not t.gone and t.busy is None]
            if not free:
                if now - since > self.pending_limit:
                    self._end(p, None, f"found no free Spark task on {p.host} within {self.pending_limit:g} s")
                else:
                    left.append((p, env, since))
                continue
            t = free[0]
            t.busy, p.worker.tid = p, t.tid
            p.worker.pid = t.pid
            t.commands += 1
            self.store.set(f"{self.spec.prefix}/cmd/{t.tid}/{t.commands}", pickle.dumps((p.number, env)))
        self._pending = left

    def _end(self, p: Proc, returncode: int | None, lost: str | None) -> None:
        if p.done:
            return
        p.worker.returncode, p.worker.lost = returncode, lost
        p.worker.tail = self.relay.tail(p.number)
        p.ended = time.monotonic()
        p.worker.done.set()
        self.exits.put(p)


class TaskDiscovery:
    """The driver's discovery: the pool's tasks per host, once enough are up (see the module docstring)."""

    what = "Spark's executors (the tasks of hora.spark.run_elastic)"

    def __init__(self, pool: TaskPool, num_proc: int, min_np: int, start_timeout: float) -> None:
        self.pool, self.num_proc, self.min_np, self.start_timeout = pool, num_proc, min_np, start_timeout
        self.problem: str | None = None
        self.failed: str | None = None  # too few tasks started: run_elastic fails with this
        self._begun = 0.0
        self._ready = False

    @property
    def checked(self) -> float:
        return time.monotonic()

    @property
    def hosts(self) -> dict[str, int] | None:
        hosts = self.pool.hosts()
        up = sum(hosts.values())
        if not self._ready:
            late = time.monotonic() - self._begun > self.start_timeout
            if up < self.num_proc and not (late and up >= self.min_np):
                if late:
                    self.failed = (f"only {up} of {self.num_proc} Spark tasks started within start_timeout="
                                   f"{self.start_timeout:g} s (min_np {self.min_np}): each worker needs a free "
                                   "task slot")
                self.problem = f"{up} of {self.num_proc} Spark tasks started"
                return None
            self._ready, self.problem = True, None
        return hosts

    def slots(self, hosts: dict[str, int]) -> list[tuple[str, str, int]]:
        return self.pool.slots(hosts)

    def start(self) -> "TaskDiscovery":
        self._begun = time.monotonic()
        self.pool.launch()
        return self

    def close(self) -> None:
        """Nothing to close: the pool's ``stop_all`` ends the tasks."""


def _first_line(error: BaseException) -> str:
    from hora.spark.driver import _first_line as first

    return first(error)
