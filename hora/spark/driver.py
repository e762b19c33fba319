"""``hora.spark.run``'s driver side: the store, the barrier stage, the watch loop and the results.

The driver (the process calling ``hora.spark.run``, where the SparkContext lives) serves the job's store
and the function, as ``hora.run()`` does, then runs one barrier stage of ``num_proc`` tasks
(:mod:`hora.spark.task`) from a background thread, and watches the store meanwhile: it prints the ranks'
output, and the first rank to fail (a result that is an exception, or an exit without a result) sets the
store's ``abort`` key, which every task acts on within a fraction of a second by stopping its rank. If the
stage still has not ended ``CANCEL_AFTER_S`` later (an executor that does not answer), the driver cancels
its job group, which kills the tasks. A stage that Spark reran (a task was lost) runs no rank a second
time: its tasks return at once and the run fails, naming the ranks that never reported.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import sys
import threading
import time
import uuid
from typing import IO, Any, Callable

from hora.base.errors import HoraTimeoutError, LaunchError
from hora.base import outcome
from hora.base.outcome import CONSEQUENCE_WAIT, RankOutcome, headline, report, root_cause
from hora.runner.api import collect_results
from hora.spark import task
from hora.spark.relay import Relay
from hora.transport.store import StoreServer

CANCEL_AFTER_S = 10.0  # after an abort, how long the tasks get to stop their ranks before the job is cancelled
GIVE_UP_S = 30.0  # after the cancel, how long the driver waits for Spark to end the job
POLL_S = 0.05


def spark_context(barrier: bool = True):
    """The active SparkContext (the one ``SparkSession.builder.getOrCreate()`` made), checked for a barrier stage
    unless ``barrier`` is False (``run_elastic`` runs none)."""
    try:
        from pyspark import SparkContext
    except ImportError as e:
        raise LaunchError("hora.spark needs pyspark: pip install 'hora[spark]' (and Java 17 or 21)") from e
    sc = SparkContext._active_spark_context
    if sc is None:
        raise LaunchError("hora.spark.run: no active SparkContext; start one first, e.g. "
                          "SparkSession.builder.getOrCreate(), or run inside pyspark / spark-submit (a Spark "
                          "Connect session, sc://..., has no SparkContext: hora.spark.run needs a classic one)")
    if barrier:
        check_conf(sc)
    return sc


def check_conf(sc) -> None:
    """Refuse up front what makes every barrier stage fail: dynamic allocation on a cluster master (Spark
    ignores it on ``local`` / ``local[N]``). Spark's own error comes only after the job is submitted, as a
    Py4JJavaError that names no setting."""
    master = sc.master or ""
    on = (sc.getConf().get("spark.dynamicAllocation.enabled") or "false").strip().lower() == "true"
    if on and not (master == "local" or master.startswith("local[")):
        raise LaunchError(f"hora.spark.run: spark.dynamicAllocation.enabled is true on master {master!r}: Spark's "
                          "barrier stages (one task per rank, all started at once) do not run with dynamic "
                          "allocation; start the session with spark.dynamicAllocation.enabled=false and enough "
                          "executors for num_proc task slots (docs/spark.md)")


def addresses(sc) -> tuple[str, str]:
    """(where the store listens, the address the ranks are given for it).

    Loopback both when Spark runs on this machine only (local, local-cluster). Else it listens where Spark's
    driver does, ``spark.driver.bindAddress`` if set (e.g. 0.0.0.0 in a container), else
    ``spark.driver.host``, and advertises ``spark.driver.host``: the address the executors reach the driver at."""
    master = sc.master or ""
    if master.startswith("local"):
        return "127.0.0.1", "127.0.0.1"
    conf = sc.getConf()
    host = conf.get("spark.driver.host") or ""
    return conf.get("spark.driver.bindAddress") or host, host


class Job:
    """One ``hora.spark.run``: call :meth:`run` once."""

    def __init__(self, sc, num_proc: int, spec_args: dict[str, Any], start_timeout: float,
                 stdout: IO[str] | None, stderr: IO[str] | None, timestamps: bool, verbose: int):
        self.sc, self.n, self.start_timeout, self.verbose = sc, num_proc, start_timeout, verbose
        self.sinks = {"stdout": stdout, "stderr": stderr}
        self.relay = Relay(stdout, stderr, timestamps)
        self.spec_args = spec_args
        self.group = f"hora.spark.run-{uuid.uuid4().hex[:12]}"
        self.outcome: dict[str, Any] = {}
        self.kinds: dict[int, RankOutcome | None] = {}  # rank -> its failure (None: a value), once its result arrived
        self.exited: dict[int, float] = {}  # rank -> when the driver saw it exit without a result
        self.consequence_at: float | None = None  # when the first failure seen was only a consequence
        self.culprit: int | None = None  # the rank the abort named as the root cause

    def run(self, func: Callable, args: tuple, kwargs: dict) -> list:
        import cloudpickle

        from hora.transport.auth import new_secret

        secret = new_secret()
        bind, advertise = addresses(self.sc)
        with StoreServer(secret, host=bind, port=0) as store:
            host, _, port = store.address.rpartition(":")
            if not advertise:
                advertise = host if host not in ("0.0.0.0", "", "::") else socket.getfqdn()
            spec = task.Spec(store_addr=f"{advertise}:{port}", secret=secret,
                             scope=f"spark-{uuid.uuid4().hex[:16]}", **self.spec_args)
            store.set("func", cloudpickle.dumps((func, args, kwargs)))
            store.set("sys.path", pickle.dumps([p for p in sys.path if isinstance(p, str)]))
            thread = self._start_stage(spec)
            try:
                failure = self._watch(store, thread)
            except BaseException:  # e.g. KeyboardInterrupt in a notebook: no rank may outlive the call
                self.sc.cancelJobGroup(self.group)
                raise
            self._relay(store, final=True)
            results = {r: store.get(f"result/{r}") for r in range(self.n)}
            codes = {r: store.get(f"exit/{r}") for r in range(self.n)}
            started = {r: store.get(f"started/{r}") for r in range(self.n)}
        return self._results(results, codes, started, failure)

    def _start_stage(self, spec: task.Spec) -> threading.Thread:
        from functools import partial

        from pyspark import InheritableThread

        def stage() -> None:
            try:
                self.sc.setJobGroup(self.group, f"hora.spark.run: {self.n} ranks", interruptOnCancel=True)
                rdd = self.sc.parallelize(range(self.n), self.n).barrier()
                self.outcome["value"] = rdd.mapPartitions(partial(task.main, spec)).collect()
            except BaseException as e:  # noqa: BLE001 - the driver reports it
                self.outcome["error"] = e

        thread = InheritableThread(target=stage, daemon=True)
        thread.start()
        return thread

    def _watch(self, store: StoreServer, thread: threading.Thread) -> str | None:
        """Until the stage ends: relay output, abort on the first failure, cancel if the tasks do not stop.
        Returns why the driver aborted (None when it did not)."""
        begun = time.monotonic()
        aborted_at, why, cancelled, placed = None, None, False, False
        while thread.is_alive():
            thread.join(POLL_S)
            self._relay(store)
            if self.verbose >= 2 and not placed:
                placed = self._placement(store)
            if aborted_at is None:
                why = self._failure(store, begun)
                if why is not None:
                    aborted_at = time.monotonic()
                    store.set("abort", why.encode())
                    timeout = why.startswith("only")
                    if self.verbose:
                        self._note(f"{why}; {'cancelling the Spark job' if timeout else 'stopping the other ranks'}")
                    if timeout:  # tasks that never started cannot see the abort
                        self.sc.cancelJobGroup(self.group)
                        cancelled = True
            elif time.monotonic() - aborted_at > CANCEL_AFTER_S + GIVE_UP_S:
                if self.verbose:
                    self._note(f"the Spark job did not end {GIVE_UP_S:g} s after it was cancelled; not waiting for it")
                break
            elif time.monotonic() - aborted_at > CANCEL_AFTER_S and not cancelled:
                self.sc.cancelJobGroup(self.group)
                cancelled = True
        return why

    def _placement(self, store: StoreServer) -> bool:
        """Once every rank started (verbose=2): where each runs."""
        where = [store.get(f"started/{r}") for r in range(self.n)]
        if any(w is None for w in where):
            return False
        for r, w in enumerate(where):
            host, pgid, partition = w.decode().split()  # the group its supervisor leads (kill -- -<pgid>)
            self._note(f"rank {r}: host {host}, process group {pgid}, Spark partition {partition}")
        return True

    def _outcomes(self, store) -> list[RankOutcome]:
        """The failed ranks so far: a stored exception, or an exit without a result (when the driver saw it)."""
        codes = {r: store.get(f"exit/{r}") for r in range(self.n)}  # before the results: a rank stores its
        for r in range(self.n):                                      # result before it exits
            if r not in self.kinds:
                raw = store.get(f"result/{r}")
                if raw is not None:
                    kind, body = pickle.loads(raw)
                    if kind == "err":
                        body.rank = r
                    self.kinds[r] = body if kind == "err" else None
        out = []
        for r in range(self.n):
            if self.kinds.get(r) is not None:
                out.append(self.kinds[r])
            elif r not in self.kinds and codes[r] is not None and int(codes[r]) != 0:
                where = (store.get(f"started/{r}") or b"").decode().split()
                out.append(RankOutcome(r, host=where[0] if where else None, pid=int(where[1]) if where else None,
                                       exit_code=int(codes[r]), time=self.exited.setdefault(r, time.time())))
        return out

    def _failure(self, store, begun: float) -> str | None:
        """Why to abort now, if at all, naming the root cause (:func:`hora.base.outcome.root_cause`) whatever
        its rank number."""
        root = root_cause(self._outcomes(store))
        if root is not None and root.consequence:  # wait a little for the failure behind it
            self.consequence_at = self.consequence_at or time.monotonic()
            if time.monotonic() - self.consequence_at < CONSEQUENCE_WAIT:
                return None
        if root is not None:
            if not root.consequence:
                self.culprit = root.rank
            return headline(root)
        started = sum(store.get(f"started/{r}") is not None for r in range(self.n))
        if started < self.n and time.monotonic() - begun > self.start_timeout:
            return (f"only {started} of {self.n} ranks started within start_timeout={self.start_timeout:g} s "
                    f"(a barrier stage needs {self.n} free task slots at once)")
        return None

    def _results(self, results: dict, codes: dict, started: dict, failure: str | None) -> list:
        error = self.outcome.get("error")
        primary = [r for r, raw in results.items() if raw is not None and _own_error(raw)]
        if primary:
            return collect_results(results, 0, job="hora.spark.run")
        lost = [r for r, raw in results.items() if raw is None]
        if failure is not None and failure.startswith("only"):
            raise HoraTimeoutError(f"hora.spark.run: {failure}")
        if lost and error is not None and not any(started.values()):
            raise LaunchError(f"hora.spark.run: the Spark job failed before any rank started: "
                              f"{_first_line(error)}") from error
        if lost:
            r = self.culprit if self.culprit in lost else _failed_task(error, started, lost)
            where = started[r].decode().split() if started[r] else []
            o = RankOutcome(r, host=where[0] if where else None, pid=int(where[1]) if where else None,
                            exit_code=int(codes[r]) if codes[r] is not None else None)
            if codes[r] is not None:
                how = f"{report([o], tail=False)}; it returned no result"
            elif started[r] is not None:
                how = f"{outcome.who(o)}{outcome.where(o)} lost its Spark task (its executor failed or was killed)"
            else:
                how = f"rank {r} never started"
            cause = f"; Spark: {_first_line(error)}" if error is not None else ""
            raise LaunchError(f"hora.spark.run: {how}{cause}") from error
        if error is not None:
            raise LaunchError(f"hora.spark.run: the Spark job failed: {_first_line(error)}") from error
        return collect_results(results, 0, job="hora.spark.run")

    def _relay(self, store: StoreServer, final: bool = False) -> None:
        self.relay.pull(store.get, store.set, range(self.n), final)

    def _note(self, text: str) -> None:
        sink = self.sinks["stderr"] or sys.stderr
        try:
            sink.write(f"hora.spark.run: {text}\n")
            sink.flush()
        except (OSError, ValueError):
            pass


def _failed_task(error: BaseException | None, started: dict[int, bytes | None], lost: list[int]) -> int:
    """Of the ranks whose task was lost, the one whose task Spark says failed first (its failure reason names
    the barrier task by partition: ``ResultTask(<stage>, <partition>)``); else the first lost rank. When one
    task fails Spark kills the others, so they are all lost alike in the store."""
    m = re.search(r"barrier task ResultTask\(\d+, (\d+)\)", str(error or ""))
    if m is not None:
        for r in lost:
            if started[r] is not None and started[r].decode().split()[2] == m.group(1):
                return r
    return lost[0]


def _own_error(raw: bytes) -> bool:
    """Whether a rank's stored result is an exception of its own (not caused by another rank's failure)."""
    kind, body = pickle.loads(raw)
    return kind == "err" and not body.consequence


def _first_line(error: BaseException) -> str:
    """What a Spark failure says, in one line. py4j's message begins with a header that only names the JVM call
    (``An error occurred while calling o81.collectAndServe.``); the cause is the first line after it that
    names an exception or a Spark error class (``org.apache.spark.SparkException: Job aborted ...``,
    ``[SPARK-24942]: Barrier execution mode does not support dynamic resource allocation ...``)."""
    lines = [ln.strip().lstrip(": ").strip() for ln in str(error).strip().splitlines()]
    lines = [ln for ln in lines if ln]
    body = lines[1:] if lines and lines[0].startswith("An error occurred while calling") else lines
    why = next((ln for ln in body if _CAUSE.search(ln)), body[0] if body else (lines[0] if lines else ""))
    raised = _python_error(str(error))
    return f"{type(error).__name__}: {why}"[:400] + (f"; the task raised {raised}"[:300] if raised else "")


def _python_error(text: str) -> str | None:
    """The exception line of the Python traceback a failed task's error carries (Spark's ``PythonException``),
    the last one before the Java stack: what actually went wrong in the task."""
    lines = text.splitlines()
    start = next((i for i, ln in enumerate(lines) if "Traceback (most recent call last)" in ln), None)
    if start is None:
        return None
    found = None
    for ln in lines[start + 1:]:
        if ln.startswith("\tat "):
            break
        if not ln.startswith((" ", "\t")) and re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt)\b", ln):
            found = ln.strip()
    return found


_CAUSE = re.compile(r"^\[[A-Z][A-Z0-9_.-]*\]|[A-Za-z0-9_.$]*(Exception|Error):")


def start_timeout(value: float | None) -> float:
    """Horovod's rule: the argument, else HOROVOD_SPARK_START_TIMEOUT, else 600 s."""
    if value is not None:
        return float(value)
    return float(os.environ.get("HORA_SPARK_START_TIMEOUT") or os.environ.get("HOROVOD_SPARK_START_TIMEOUT")
                 or 600)
