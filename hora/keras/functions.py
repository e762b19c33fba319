"""Collectives on Keras values, variables and saved models, the same on every Keras backend.

Horovod's ``horovod.tensorflow.keras.allreduce`` & co. evaluate a value now (they are for callbacks, metrics
and scripts, not for a traced train step), so here a value goes to NumPy (``keras.ops.convert_to_numpy``),
through the core, and back as a tensor of the Keras backend. Inside a traced function use the backend's own
binding (``hora.tensorflow``, ``hora.jax``, ``hora.torch``).
"""

from __future__ import annotations

import keras
import numpy as np

import hora.core.ops as _core
from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit.frontend import grouped_viewed, resolve_op, viewed
from hora.core.ops import Average
from hora.core.process_sets import ProcessSet, global_process_set
from hora.keras.compression import Compression
from hora.keras.flavour import legacy_requested, tf_keras
from hora.keras.optimizer import DistributedOptimizer

__all__ = ["allreduce", "allgather", "broadcast", "reducescatter", "broadcast_variables",
           "broadcast_global_variables", "load_model"]


def _numpy(value, what: str) -> np.ndarray:
    """A Keras value (a backend tensor, a variable, NumPy or Python numbers) as a NumPy array."""
    try:
        array = np.asarray(keras.ops.convert_to_numpy(value.value if isinstance(value, keras.Variable) else value))
    except Exception as e:  # noqa: BLE001 - a symbolic tensor, a string: say what to do instead
        raise HoraValueError(f"{what}: cannot take the value of {type(value).__name__} now ({e}); hora.keras's "
                             "collectives run eagerly; inside a traced function use the backend's hora binding") \
            from None
    if array.dtype.kind not in "biuf":
        raise HoraValueError(f"{what}: values of dtype {array.dtype} are not supported; give numbers")
    return array


def allreduce(value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None,
              compression=Compression.none):
    """The reduction (Average unless ``op``/``average`` say otherwise) of ``value`` over all ranks."""
    op = resolve_op(op, average, "allreduce", name)
    value = keras.ops.convert_to_tensor(value) if not isinstance(value, keras.Variable) else value.value
    packed, ctx = compression.compress(value)
    array = viewed(_numpy, packed, "allreduce", name)
    out = keras.ops.convert_to_tensor(_core.allreduce(array, op, prescale_factor, postscale_factor, name))
    return compression.decompress(out, ctx)


def allgather(value, name=None):
    """The ranks' ``value``s concatenated along the first dimension (which may differ between ranks)."""
    return keras.ops.convert_to_tensor(_core.allgather(viewed(_numpy, value, "allgather", name), name))


def broadcast(value, root_rank, name=None):
    """``root_rank``'s ``value`` on every rank."""
    return keras.ops.convert_to_tensor(_core.broadcast(viewed(_numpy, value, "broadcast", name), root_rank, name))


def reducescatter(value, name=None, op=Average):
    """``value`` reduced over the ranks and split along the first dimension; this rank's part."""
    return keras.ops.convert_to_tensor(_core.reducescatter(viewed(_numpy, value, "reducescatter", name), op, name))


def broadcast_variables(variables, root_rank: int, process_set: ProcessSet = global_process_set,
                        name: str | None = None) -> None:
    """Assign ``root_rank``'s values to ``variables`` (Keras variables) on every rank; the broadcasts are
    submitted together, so the engine fuses them (hora only: what the broadcast callback does, for scripts
    that call it themselves)."""
    variables = list(variables)
    if not variables:
        return
    arrays = grouped_viewed(_numpy, variables, "grouped_broadcast", name, process_set)
    handles = [_core.broadcast_async(a, root_rank, name=None if name is None else f"{name}.{i}",
                                     process_set=process_set) for i, a in enumerate(arrays)]
    for var, handle in zip(variables, handles):
        var.assign(np.asarray(_core.synchronize(handle)).reshape(var.shape))


def broadcast_global_variables(root_rank):
    """Horovod's TF1-session call. Keras 2 (``TF_USE_LEGACY_KERAS=1``) in graph mode: broadcast the default
    graph's global variables through Keras's session, as Horovod; in eager mode Horovod's RuntimeError (use
    the callback or ``broadcast_variables``). Keras 3 keeps no global variable collection to broadcast."""
    if legacy_requested():
        from hora.tensorflow.v1 import broadcast_global_variables as graph_broadcast

        op = graph_broadcast(root_rank)  # RuntimeError in eager mode, as Horovod's
        return tf_keras().backend.get_session().run(op)
    raise NotSupportedError(
        "not supported yet: broadcast_global_variables(root_rank) broadcasts a TF1 session's global variables, "
        "which Keras 3 does not have; use callbacks.BroadcastGlobalVariablesCallback(root_rank) in model.fit, or "
        "hora.keras.broadcast_variables(model.variables + optimizer.variables, root_rank)")


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """``keras.models.load_model(filepath)`` with the model's optimizer wrapped in :func:`DistributedOptimizer`
    (state included), so training resumes distributed. ``custom_optimizers``: optimizer classes the file may
    name; ``legacy_opts``: Keras 3 has no legacy optimizers, so only False is accepted. With
    ``TF_USE_LEGACY_KERAS=1`` the model is loaded by ``tf_keras`` (:func:`hora.keras.legacy.load_model`, where
    ``legacy_opts`` means ``tf_keras.optimizers.legacy``)."""
    if legacy_requested():
        from hora.keras import legacy

        return legacy.load_model(filepath, custom_optimizers, custom_objects, compression, legacy_opts)
    if legacy_opts:
        raise NotSupportedError("not supported yet: legacy_opts=True (Keras 3 has no legacy optimizers)")
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression)
    return model
