"""One task of ``hora.spark.run_elastic``: a slot on a Spark executor that runs elastic workers when told.

Each task is a Spark job of its own (one partition, not a barrier stage), so Spark can lose, retry or add
one without touching the others. In Spark's Python worker on an executor it registers with the driver's
store (``<prefix>/up/<tid>``: its host, as the address it reaches the store from, and whether its Python
can load the driver's function), then waits for commands: ``<prefix>/cmd/<tid>/<k>`` holds a worker's number
and environment (the elastic driver's, :mod:`hora.runner.elastic.driver`), and the task runs that worker as
``hora.spark.run`` runs a rank (``python -m hora.core.run_task`` under :mod:`hora.spark.supervise`, which
kills the worker's process group should this task die), relays its output, applies the signals the
driver sends (``<prefix>/sig/<number>``) and reports its exit status (``<prefix>/exit/<number>``); then it
waits for the next command: a slot whose worker died is started again in the same task. It beats
(``<prefix>/beat/<tid>``) while it lives and returns when the driver sets ``<prefix>/over``.

A task Spark tries again (its first attempt died: the executor was lost, its Python worker was killed)
returns at once: the driver counts the slot as lost and submits a fresh task in its place, which Spark
places wherever a slot is free, on this executor or on a new one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import socket
import sys
import time
from typing import Iterator

from hora.spark.python import mismatch
from hora.spark.task import _closed, _signal, start_supervised, waited
from hora.transport.store import StoreClient

POLL_S = 0.1  # how often a task looks for a command, a signal or the end
BEAT_S = 1.0  # how often it tells the driver it lives


@dataclasses.dataclass(frozen=True)
class Spec:
    """What every task of one ``run_elastic`` gets in its closure."""

    store_addr: str
    secret: str = dataclasses.field(repr=False)
    prefix: str  # the job's keys: <scope>/spark
    driver: tuple[str, str, str] | None = None  # the driver's interpreter (hora.spark.python.interpreter)


def main(spec: Spec, tid: int, _partition: Iterator) -> Iterator[int]:
    """The ``mapPartitions`` function of task ``tid``'s one-partition job: yields ``tid`` when it ends."""
    from pyspark import TaskContext

    attempt = TaskContext.get().attemptNumber()
    store = StoreClient(spec.store_addr, spec.secret, timeout=60)
    try:
        if attempt > 0:  # its first attempt died with its worker: the driver replaces the slot
            yield tid
            return
        problem = mismatch(spec.driver)
        store.set(f"{spec.prefix}/up/{tid}", pickle.dumps((_host(spec.store_addr), os.getpid(), problem)))
        if problem is None:
            _serve(spec, tid, store)
    finally:
        _closed(store)
    yield tid


def _host(store_addr: str) -> str:
    """The address this executor reaches the driver's store from: its host in the job (a UDP connect sends
    nothing)."""
    host = store_addr.rpartition(":")[0].strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return s.getsockname()[0]


class _Beat:
    def __init__(self, store: StoreClient, key: str) -> None:
        self.store, self.key, self.at = store, key, 0.0

    def __call__(self) -> None:
        if time.monotonic() - self.at >= BEAT_S:
            self.at = time.monotonic()
            self.store.add(self.key, 1)


def _serve(spec: Spec, tid: int, store: StoreClient) -> None:
    beat = _Beat(store, f"{spec.prefix}/beat/{tid}")
    k = 1
    while not store.check(f"{spec.prefix}/over"):
        beat()
        cmd = store.try_get(f"{spec.prefix}/cmd/{tid}/{k}")
        if cmd is None:
            time.sleep(POLL_S)
            continue
        k += 1
        number, env = pickle.loads(cmd)
        code = _run_worker(spec, store, number, env, beat)
        store.set(f"{spec.prefix}/exit/{number}", str(code).encode())


def _run_worker(spec: Spec, store: StoreClient, number: int, env: dict[str, str], beat: _Beat) -> int:
    proc, pumps = start_supervised(spec, number, {**os.environ, **env}, sys.executable)
    sent = b""
    try:
        while (code := waited(proc, POLL_S)) is None:
            beat()
            sig = store.try_get(f"{spec.prefix}/sig/{number}")
            if sig and sig != sent:  # "<n> <signal>": the n-th signal the driver sent this worker
                sent = sig
                _signal(proc.pid, int(sig.split()[1]))
    finally:  # also when the driver is gone or Spark kills this task
        _signal(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdin.close()
    for p in pumps:
        p.join(timeout=5)
    return code
