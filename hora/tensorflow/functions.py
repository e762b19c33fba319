"""``broadcast_variables``: put every rank on ``root_rank``'s values of some variables, in one host call.

The values travel in one stateful host call (all broadcasts started, then all waited for), then each
variable is assigned its value: eagerly, inside a ``tf.function`` (the assignments run when it does) and
in a v1 graph (the returned op does it when run).
"""

from __future__ import annotations

import itertools

import tensorflow as tf

import hora.core.ops as _core
from hora.base.errors import HoraValueError
from hora.kit.gradients import broadcast_all
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow import bridge

__all__ = ["broadcast_variables"]


_calls = itertools.count()  # broadcast_variables calls (built ops, in graphs) in this process: part of the names


def broadcast_variables(variables, root_rank: int, process_set: ProcessSet = global_process_set,
                        inplace: bool = False):
    """Assign every variable in ``variables`` rank ``root_rank``'s value; returns the op (a v1 graph) or
    ``None`` (eager). ``inplace``: accepted, no effect (the variables are assigned in place either way;
    Horovod's in-place path is a graph-mode optimisation of the same result)."""
    variables = list(variables)
    # the wire names: the call's number and positions, the same on every rank whatever it passed (so a refusal
    # below reaches the peers under their names) and distinct for duplicate TF names (two "Variable:0")
    call = next(_calls)
    names = [f"broadcast_variables.{call}.{i}" for i in range(len(variables))]
    if any(not hasattr(v, "assign") for v in variables):
        e = HoraValueError("broadcast_variables: every element must be a variable (with .assign), got "
                           f"{sorted({type(v).__name__ for v in variables if not hasattr(v, 'assign')})}")
        for n in names:  # the peers wait on every member: each is refused
            _core.refused("broadcast", e, n, process_set)
        raise e
    if not variables:
        return None if tf.executing_eagerly() else tf.no_op()
    values = [tf.convert_to_tensor(v) for v in variables]

    def run(*arrays):
        return broadcast_all(arrays, root_rank, names, process_set)
    # not chained to the graph's other host calls: a hook runs this op alone, before any step's inputs exist
    received = bridge.host_call(run, values, [t.dtype for t in values], chain=False)
    assigns = [v.assign(r) for v, r in zip(variables, received)]
    return None if tf.executing_eagerly() else tf.group(*assigns)
