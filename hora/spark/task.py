"""One rank of ``hora.spark.run``: the body of a Spark task in the barrier stage.

It runs inside Spark's Python worker on an executor. It works out its rank from where Spark placed the
stage's tasks (:mod:`hora.spark.layout`), starts the rank as its own process (``executable -m
hora.core.run_task``, as ``hora.run()`` does: a fresh interpreter, so the rank's hora and framework state
never outlive the job in Spark's reused worker) under :mod:`hora.spark.supervise`, which kills the rank's
process group should this task's worker die, and waits for it. The rank's environment carries its place
and the driver's store address and secret; the secret came in this task's closure (Spark's own RPC), so it
is on no command line and in no log. While the rank runs, this task relays its output to the driver
through the store and watches for the driver's ``abort`` key (another rank failed): then it stops the
rank's process group (SIGTERM, then SIGKILL). The rank's exit status goes to the store either way, so the
driver can name a rank that died without a result. The task itself never raises for a failed rank: a
failed task would make Spark rerun the whole barrier stage, the job included.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

from hora.base import contract
from hora.base.errors import HoraError, LaunchError
from hora.runner.envs import worker_envs
from hora.spark import supervise
from hora.spark.layout import layout
from hora.spark.python import mismatch
from hora.transport.store import StoreClient

POLL_S = 0.2  # how often a task looks for the driver's abort while its rank runs
STOP_GRACE_S = 3.0  # SIGTERM to SIGKILL when the driver aborts
CHUNK = 1 << 16


@dataclasses.dataclass(frozen=True)
class Spec:
    """What every task of one ``hora.spark.run`` gets in its closure."""

    store_addr: str
    secret: str = dataclasses.field(repr=False)  # never in a log line, a traceback or the closure's repr
    scope: str
    knobs: dict[str, str]
    env: dict[str, str] | None
    executable: str | None
    driver: tuple[str, str, str] | None = None  # the driver's interpreter (hora.spark.python.interpreter)


def main(spec: Spec, _partition: Iterator) -> Iterator[tuple[int, int]]:
    """The ``mapPartitions`` function of the barrier stage: yields (partition, the rank's exit status)."""
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    partition = ctx.partitionId()
    store = StoreClient(spec.store_addr, spec.secret, timeout=60)
    try:
        # a task (or a whole stage: PySpark's TaskContext has no stageAttemptNumber) that Spark tries again after
        # a failure runs no rank: the job does not restart behind the caller's back; the driver names the ranks
        # that never reported. The store counts the tries of each partition across attempts.
        if ctx.attemptNumber() > 0 or store.add(f"tries/{partition}") > 1:
            yield partition, -1
            return
        slots, ranks = layout([info.address for info in ctx.getTaskInfos()])
        rank = ranks[partition]
        problem = None if spec.executable else mismatch(spec.driver)
        code = _refuse(store, rank, problem) if problem else _run_rank(spec, slots, rank, partition, store)
        store.set(f"exit/{rank}", str(code).encode())
        yield partition, code
    finally:
        store.close()


def _refuse(store: StoreClient, rank: int, problem: str) -> int:
    """Fail ``rank`` without starting it, as a rank that raised :class:`LaunchError` (the driver re-raises it)."""
    import pickle

    from hora.base.outcome import from_exception  # the record every launcher reports through

    error = LaunchError(problem)
    outcome = from_exception(rank, error, f"LaunchError: {problem}", exception=pickle.dumps(error),
                             host=os.uname().nodename, pid=os.getpid())
    store.set(f"result/{rank}", pickle.dumps(("err", outcome)))
    return 1


def _run_rank(spec: Spec, slots: list, rank: int, partition: int, store: StoreClient) -> int:
    base = dict(os.environ)
    base.update(spec.env or {})
    env = worker_envs(slots, spec.knobs, spec.store_addr, spec.secret, spec.scope, base=base,
                      extra={contract.RUNFUNC_ADDR: spec.store_addr, contract.RUNFUNC_SECRET: spec.secret})[rank]
    proc, pumps = start_supervised(spec, rank, env, spec.executable or sys.executable)
    stopping = None
    try:
        store.set(f"started/{rank}", f"{slots[rank].host} {proc.pid} {partition}".encode())
        while (code := waited(proc, POLL_S)) is None:
            if stopping is None and store.check("abort"):
                stopping = time.monotonic()
                _signal(proc.pid, signal.SIGTERM)
            elif stopping is not None and time.monotonic() - stopping > STOP_GRACE_S:
                _signal(proc.pid, signal.SIGKILL)
    finally:  # also when the driver is gone (its store with it) or Spark kills this task
        _signal(proc.pid, signal.SIGKILL)  # the rank if it still runs, and what it left behind in its group
        proc.wait()
        proc.stdin.close()
    for p in pumps:
        p.join(timeout=5)
    return code


def waited(proc: subprocess.Popen, tick: float) -> int | None:
    """The worker's exit code, or None when it still runs after ``tick`` s (a supervising loop's tick)."""
    try:
        return proc.wait(timeout=tick)
    except subprocess.TimeoutExpired:
        return None


def start_supervised(spec, tag: int, env: dict[str, str], python: str
                     ) -> tuple[subprocess.Popen, list[threading.Thread]]:
    """``python -m hora.core.run_task`` under the supervisor, its output relayed to the store under ``tag``
    (``spec``: a Spec's ``store_addr`` and ``secret``): (the supervisor's process, the relay threads)."""
    command = [python, os.path.abspath(supervise.__file__), python, "-m", contract.RUN_TASK_MODULE]
    # the supervisor leads the rank's process group; its stdin (this process's end held open) tells it the
    # task is alive. Not PR_SET_PDEATHSIG on it: it must outlive this worker to clean up after it.
    proc = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    pumps = [threading.Thread(target=_relay, args=(spec, tag, name, pipe), daemon=True)
             for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr))]
    for p in pumps:
        p.start()
    return proc, pumps


def _signal(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _relay(spec: Spec, rank: int, stream: str, pipe) -> None:
    """The rank's ``stream`` to the store in chunks (``out/<rank>/<stream>/<n>``); the driver prints them.

    It reads the pipe to EOF whatever happens to the store (the driver gone, the connection lost): a rank
    whose output nobody reads would block on its next write and never exit."""
    client: StoreClient | None = None
    seq = 0
    try:
        fd = pipe.fileno()
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                break
            if client is None and seq >= 0:
                try:
                    client = StoreClient(spec.store_addr, spec.secret, timeout=60)
                except (OSError, HoraError):
                    seq = -1  # no store to send to: drain only
            if client is not None:
                try:
                    client.set(f"out/{rank}/{stream}/{seq}", chunk)
                    seq += 1
                except (OSError, HoraError):
                    client, seq = _closed(client), -1
    except OSError:
        pass
    finally:
        _closed(client)
        pipe.close()


def _closed(client: StoreClient | None) -> None:
    if client is not None:
        try:
            client.close()
        except (OSError, HoraError):
            pass
