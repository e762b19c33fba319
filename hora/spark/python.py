"""Which Python runs the ranks of ``hora.spark.run``, and a clear error when it cannot load the driver's function.

The driver pickles the function with its cloudpickle; each rank loads it in the Python that Spark's worker
runs (``PYSPARK_PYTHON``, else ``python3`` from the PATH). From a virtualenv's Python that is not activated,
that is another interpreter, and the rank died with a cloudpickle ``AttributeError`` that named nothing.

- On a ``local`` master with ``PYSPARK_PYTHON`` unset, the stage's Python workers run the driver's own
  interpreter (:func:`driver_python_for_local_workers`): the same machine, so the same environment.
- Everywhere, each task compares its interpreter with the driver's (:func:`mismatch`) before it starts the
  rank, and a difference fails the rank with an error that says to set ``PYSPARK_PYTHON``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
from typing import Any, Iterator


def interpreter() -> tuple[str, str, str]:
    """(executable, Python ``major.minor``, cloudpickle's version) of this process."""
    import cloudpickle

    return sys.executable, "%d.%d" % sys.version_info[:2], cloudpickle.__version__


def mismatch(driver: tuple[str, str, str] | None) -> str | None:
    """Why this (task) interpreter cannot load what the driver pickled, or None."""
    if not driver:
        return None
    exe, version, pickler = driver
    mine = interpreter()
    if (version, pickler) == mine[1:]:
        return None
    return (f"hora.spark.run: the Spark worker runs {mine[0]} (Python {mine[1]}, cloudpickle {mine[2]}) but the "
            f"driver runs {exe} (Python {version}, cloudpickle {pickler}); the ranks cannot load the driver's "
            "function. Set PYSPARK_PYTHON to a Python with the driver's packages on every executor (e.g. "
            f"PYSPARK_PYTHON={exe} when that path exists there) before the SparkSession is created")


def _is_local(master: str) -> bool:
    return master == "local" or master.startswith(("local[", "local-cluster["))


@contextlib.contextmanager
def driver_python_for_local_workers(sc: Any) -> Iterator[None]:
    """For one ``hora.spark.run`` on a local master without ``PYSPARK_PYTHON``: the stage's Python workers run
    ``sys.executable`` (pyspark reads ``sc.pythonExec`` when it builds a stage), then the context's setting is
    restored."""
    saved = getattr(sc, "pythonExec", None)
    local = _is_local(sc.master or "") and not os.environ.get("PYSPARK_PYTHON")
    found = shutil.which(saved) if saved else None
    change = local and saved is not None and (found is None or os.path.realpath(found) != os.path.realpath(
        sys.executable))
    if change:
        sc.pythonExec = sys.executable
    try:
        yield
    finally:
        if change:
            sc.pythonExec = saved


@contextlib.contextmanager
def explained() -> Iterator[None]:
    """A stage whose Python workers cannot import hora at all fails inside Spark (``No module named 'hora'``
    deep in a Java stack trace): say which setting fixes it."""
    from hora.base.errors import LaunchError

    try:
        yield
    except LaunchError as e:
        text = f"{e} {e.__cause__ or ''}"
        if "No module named 'hora'" not in text:
            raise
        raise LaunchError("hora.spark.run: Spark's Python workers cannot import hora (No module named 'hora'): "
                          f"they run another Python than the driver's ({sys.executable}). Set PYSPARK_PYTHON to "
                          "a Python that has hora and the driver's packages, on every executor, before the "
                          "SparkSession is created") from e
