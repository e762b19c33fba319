"""TensorFlow tensors to hora's NumPy core and back: one stateful host call per collective (or group).

``tf.numpy_function(..., stateful=True)`` runs the core in eager mode, inside ``tf.function`` and in v1
graphs; stateful calls in one function run in program order (the same order on every rank) and are never
pruned. The call loses the static shape, which is put back here. A step's gradients must go out in one
grouped call: each host call costs ~55 µs inside a ``tf.function``.
"""

from __future__ import annotations

import tensorflow as tf

import hora.core.ops as _core
from hora.core.process_sets import ProcessSet, global_process_set

__all__ = ["host_call", "grouped_allreduce"]


def host_call(fn, inputs: list, touts: list, shapes: list | None = None, name: str | None = None) -> list:
    """``fn(*arrays) -> list of arrays`` run on the host with ``inputs``' values; returns tensors of dtypes
    ``touts`` with static ``shapes`` (default: the inputs' shapes, one per output)."""
    outs = tf.numpy_function(lambda *a: list(fn(*a)), list(inputs), list(touts), stateful=True, name=name)
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    shapes = shapes if shapes is not None else [t.shape for t in inputs]
    for o, s in zip(outs, shapes):
        o.set_shape(s)
    return list(outs)


def grouped_allreduce(tensors: list, op: int, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                      name: str | None = None, process_set: ProcessSet = global_process_set) -> list:
    """Allreduce ``tensors`` as one group in one host call; new tensors of the same dtypes and shapes."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []

    def run(*arrays):
        return _core.grouped_allreduce(list(arrays), op, prescale_factor, postscale_factor, name, process_set)
    return host_call(run, tensors, [t.dtype for t in tensors])
