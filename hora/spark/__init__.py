"""``hora.spark``: run a hora job as the tasks of a Spark barrier stage (Horovod's ``horovod.spark.run``).

>>> def train(lr):
...     import hora
...     hora.init()
...     return hora.rank(), lr
>>> hora.spark.run(train, args=(0.1,), num_proc=2)     # inside a PySpark session
[(0, 0.1), (1, 0.1)]

Spark places and starts the ranks; hora's store (served by this process, the Spark driver) and its
transports do the rest. ``run_elastic`` runs an elastic job (``hora.elastic``) on the executors, one Spark
task per worker, under the elastic driver of ``hora run``. How ranks map to tasks, where the store runs
and what a failure does: docs/spark.md. Importing this package does not import pyspark; ``run`` needs an
active SparkContext.

Horovod's Spark ML Estimators are in the subpackages: :mod:`hora.spark.torch`, :mod:`hora.spark.keras`,
:mod:`hora.spark.lightning` (``TorchEstimator``/``KerasEstimator`` and their Models), on the Stores of
:mod:`hora.spark.common.store`; they train through :func:`run`.
"""

from __future__ import annotations

import os
from types import MappingProxyType
from typing import IO, Any, Callable, Mapping

from hora.base import contract
from hora.base.errors import HoraValueError, NotSupportedError

__all__ = ["run", "run_elastic"]

_NO_KWARGS: Mapping[str, Any] = MappingProxyType({})  # Horovod's default, kwargs={}, made immutable


def run(fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = _NO_KWARGS,
        num_proc: int | None = None, start_timeout: float | None = None, use_mpi: bool | None = None,
        use_gloo: bool | None = None, extra_mpi_args: str | None = None, env: dict[str, str] | None = None,
        stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
        nics: list[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
        executable: str | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one per Spark task; return the results in rank order.

    ``kwargs``: Horovod's default ``{}`` (an immutable empty mapping here; ``None`` means the same).
    ``num_proc``: default the SparkContext's ``defaultParallelism``; the cluster needs that many free task
    slots at once (a barrier stage). ``start_timeout``: seconds for all tasks to start, else
    ``HOROVOD_SPARK_START_TIMEOUT``, else 600. ``env``: variables added to each rank's environment (which is
    otherwise its executor's, plus the driver's ``HORA_*``/``HOROVOD_*`` settings). ``stdout`` / ``stderr``:
    where the ranks' output is printed in the driver, each line tagged ``[rank]<stdout>:`` (default this
    process's), with a timestamp before it when ``prefix_output_with_timestamp``. ``nics``: the network
    interfaces the ranks use (``HORA_NETWORK_INTERFACES``). ``executable``: the Python that runs each rank
    (default the executor's Python worker's). ``verbose``: 0 prints nothing of the driver's own.

    ``use_gloo`` is accepted and has no effect: hora's own TCP and shared-memory transports connect the
    ranks (gloo's role in Horovod). ``use_mpi=True`` and ``extra_mpi_args`` raise ``NotSupportedError``:
    the ranks are Spark tasks, which no mpirun starts.

    A rank that raises fails the run with that exception (its traceback as ``__cause__``, as ``hora.run``);
    one that dies, or whose executor is lost, fails it with a ``LaunchError`` naming the rank; either way
    the other ranks are stopped within seconds.
    """
    if use_mpi:
        raise NotSupportedError("not supported yet: hora.spark.run(use_mpi=True): the ranks are Spark tasks, "
                                "which mpirun cannot start; leave use_mpi unset (hora's own transports connect "
                                "them)")
    if extra_mpi_args:
        raise NotSupportedError("not supported yet: hora.spark.run(extra_mpi_args=...): no mpirun runs under "
                                "Spark; set hora's knobs through env= instead (docs/knobs.md)")
    if not callable(fn):
        raise TypeError(f"hora.spark.run needs a function, got {type(fn).__name__}")
    from hora.spark import driver

    sc = driver.spark_context()
    n = sc.defaultParallelism if num_proc is None else num_proc
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise HoraValueError(f"hora.spark.run(num_proc={num_proc!r}): expected a positive int")
    from hora.spark import python

    spec_args = dict(knobs=_knobs(nics), env={str(k): str(v) for k, v in (env or {}).items()} or None,
                     executable=executable, driver=python.interpreter())
    job = driver.Job(sc, n, spec_args, driver.start_timeout(start_timeout), stdout, stderr,
                     prefix_output_with_timestamp, verbose)
    with python.driver_python_for_local_workers(sc), python.explained():  # hora.spark.python says why
        return job.run(fn, tuple(args), dict(kwargs or {}))


def _knobs(nics: list[str] | set[str] | None) -> dict[str, str]:
    """The driver's hora settings for the ranks: its ``HORA_*`` / ``HOROVOD_*`` variables (not a launcher's)."""
    own = {"HORA_" + n for n in contract.ALL} | {"HOROVOD_" + n for n in contract.ALL}
    own |= {contract.RUNFUNC_ADDR, contract.RUNFUNC_SECRET}
    knobs = {k: v for k, v in os.environ.items() if k.startswith(("HORA_", "HOROVOD_")) and k not in own}
    if nics:
        knobs["HORA_NETWORK_INTERFACES"] = ",".join(sorted(nics) if isinstance(nics, set) else nics)
    return knobs


def run_elastic(fn: Callable[..., Any], args: tuple = (), kwargs: Mapping[str, Any] | None = _NO_KWARGS,
                num_proc: int | None = None, min_num_proc: int | None = None, max_num_proc: int | None = None,
                start_timeout: float | None = None, elastic_timeout: float | None = None,
                reset_limit: int | None = None, env: dict | None = None,
                stdout: IO[str] | None = None, stderr: IO[str] | None = None, verbose: int = 1,
                nics: list[str] | set[str] | None = None, prefix_output_with_timestamp: bool = False,
                min_np: int | None = None, max_np: int | None = None) -> list:
    """Run ``fn(*args, **kwargs)`` as an elastic job on Spark's executors; return its values on the ranks of
    the last generation, in rank order.

    ``fn`` calls ``hora.init()`` and trains inside ``hora.elastic.run`` (a framework's ``elastic.run`` and
    ``State``): a worker that dies, or whose Spark task or executor is lost, rolls the others back to the last
    ``state.commit()``; they go on without it and it is started again in a free task slot. Each worker runs in
    a Spark task of its own (no barrier stage), ``max_num_proc`` of them (default ``num_proc``); the job's
    hosts are the executors those tasks run on, so a new executor adds slots and a lost one removes them.
    The driver is ``hora run --elastic``'s (docs/elastic.md): ``min_num_proc`` (default ``num_proc``),
    ``max_num_proc``, ``elastic_timeout`` (else ``HOROVOD_ELASTIC_TIMEOUT``, else 600 s), ``reset_limit``
    as there; its log lines go to this process's stderr, prefixed ``hora run:``. How it maps onto Spark:
    docs/spark.md.

    ``num_proc``: the first generation's size, default ``defaultParallelism``. ``start_timeout``: seconds for
    ``num_proc`` tasks to start (else ``HOROVOD_SPARK_START_TIMEOUT``, else 600); past it the job starts with
    the tasks up if they are at least ``min_num_proc``, else fails. ``min_np`` / ``max_np``: Horovod's
    deprecated names (a ``DeprecationWarning``). ``env``, ``stdout``, ``stderr``, ``nics``,
    ``prefix_output_with_timestamp``: as :func:`run` (output lines are tagged ``[<worker number>]``).
    ``verbose`` is accepted and has no effect: the elastic driver's log is the one ``hora run`` writes.
    """
    import warnings

    for old, new, given in (("min_np", "min_num_proc", min_np), ("max_np", "max_num_proc", max_np)):
        if given is not None:
            warnings.warn(f"hora.spark.run_elastic({old}=...) is deprecated; use {new}=...", DeprecationWarning,
                          stacklevel=2)
    min_num_proc = min_np if min_np is not None else min_num_proc
    max_num_proc = max_np if max_np is not None else max_num_proc
    if not callable(fn):
        raise TypeError(f"hora.spark.run_elastic needs a function, got {type(fn).__name__}")
    from hora.spark import driver, elastic

    sc = driver.spark_context(barrier=False)
    n = sc.defaultParallelism if num_proc is None else num_proc
    for name, value in (("num_proc", n), ("min_num_proc", min_num_proc), ("max_num_proc", max_num_proc)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise HoraValueError(f"hora.spark.run_elastic({name}={value!r}): expected a positive int")
    lo = min_num_proc if min_num_proc is not None else n
    hi = max_num_proc if max_num_proc is not None else max(n, lo)
    return elastic.run(sc, fn, tuple(args), dict(kwargs or {}), min(max(n, lo), hi), lo, hi,
                       driver.start_timeout(start_timeout), elastic_timeout, reset_limit,
                       {str(k): str(v) for k, v in (env or {}).items()}, _knobs(nics), stdout, stderr,
                       prefix_output_with_timestamp)
