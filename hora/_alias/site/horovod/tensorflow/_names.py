"""What ``horovod.tensorflow`` and its ``mpi_ops`` share beyond hora.tensorflow's names: Horovod's helpers."""

from horovod.common.util import (check_installed_version, get_average_backwards_compatibility_fun,  # noqa: F401
                                 get_ext_suffix, gpu_available, num_rank_is_power_2, split_list)
import hora.tensorflow as _hvd

handle_average_backwards_compatibility = get_average_backwards_compatibility_fun(_hvd)
check_num_rank_power_of_2 = num_rank_is_power_2


def vars_to_refs(variables):
    """A variable's ``ref()`` (hashable), or a tuple of them for a (nested) list."""
    if isinstance(variables, list):
        return tuple(vars_to_refs(v) for v in variables)
    return variables.ref()


def refs_to_vars(refs):
    """The inverse of :func:`vars_to_refs`."""
    if isinstance(refs, tuple):
        return [refs_to_vars(r) for r in refs]
    return refs.deref()


REASONS = {
    "MPI_LIB": "it is Horovod's compiled TensorFlow op library; hora's ops are Python (tf.py_function)",
    "LocalGradientAggregationHelper": "hora's DistributedOptimizer and DistributedGradientTape aggregate "
                                      "backward_passes_per_step themselves; the helper class is not exported",
}
