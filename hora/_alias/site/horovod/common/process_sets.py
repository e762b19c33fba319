"""``horovod.common.process_sets``: hora's process sets under Horovod's names."""

from hora.core.process_sets import ProcessSet, global_process_set  # noqa: F401
from hora.core.sets import add_process_set, remove_process_set  # noqa: F401
from horovod import _shim
from horovod.common.util import is_iterable  # noqa: F401

_shim.fill(globals(), {
    "HorovodBasics": "it wraps Horovod's compiled library; hora's basics are plain functions (hvd.rank(), ...)",
})


def __getattr__(name: str):
    # Horovod imports mpi4py's MPI here; importing it initialises MPI, so hora does it only when asked
    if name == "MPI":
        try:
            from mpi4py import MPI
        except ImportError:
            return _shim.placeholder(f"{__name__}.MPI", "mpi4py is not installed (pip install 'hora[mpi]')")
        return MPI
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
