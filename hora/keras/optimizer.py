"""``DistributedOptimizer`` for Keras 3: the checks and the settings of a call, then the wrapped optimizer's own
class with gradients averaged over ranks (:mod:`hora.keras.wrapped` says how, with backward_passes_per_step
and mixed precision); ``zero_stage=1`` shards its state (:mod:`hora.keras.sharded`); a ``tf_keras`` optimizer
takes the Keras 2 path (:mod:`hora.keras.legacy`).
"""

from __future__ import annotations

import warnings

import keras

from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit.compressors import check_compression_op
from hora.kit.frontend import check_optimizer_args, predivide
from hora.kit.sharding import check_stage
from hora.core.ops import Average
from hora.core.process_sets import global_process_set
from hora.keras.compression import Compression
from hora.keras.flavour import is_tf_keras
from hora.keras.wrapped import _DistributedOptimizer, _LossScale, _Settings, _wrap

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer"]


def _variable_ids(groups) -> object:
    if groups is None or isinstance(groups, int):
        if isinstance(groups, bool) or (isinstance(groups, int) and groups < 0):
            raise HoraValueError(f"groups={groups!r}: give a non-negative number of groups or lists of variables")
        return groups
    out, seen = [], set()
    for group in groups:
        ids = []
        for v in group:
            if not isinstance(v, keras.Variable):
                raise HoraValueError(f"groups must hold keras.Variable objects, got {type(v).__name__}")
            if id(v) in seen:
                raise HoraValueError(f"variable {v.path!r} appears twice in groups; a variable can be in one group")
            seen.add(id(v))
            ids.append(id(v))
        out.append(ids)
    return out


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average, num_groups=0, groups=None,
                         *, backward_passes_per_step=1, average_aggregated_gradients=False,
                         process_set=global_process_set, scale_local_gradients=True, zero_stage=0):
    """Wrap a Keras 3 optimizer (or a ``tf_keras`` one: :mod:`hora.keras.legacy`) so that each step applies
    gradients reduced (``op``) over the ranks. The positional order is ``horovod.keras``'s (``num_groups``
    after ``op``); the arguments Horovod has only in ``horovod.tensorflow.keras`` are keywords here, and
    ``hora.tensorflow.keras.DistributedOptimizer`` takes them in that module's order.

    ``device_dense``/``device_sparse``: accepted, no effect (hora reduces on the host). ``name``: the prefix
    of the collectives' names (default ``Distributed<Class>``). ``zero_stage=1`` (or 2, which behaves as 1):
    each rank keeps the optimizer state of its slice of the variables only (:mod:`hora.keras.sharded`,
    docs/sharded_optimizer.md).

    >>> model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss=...)
    """
    return distributed_optimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                 gradient_predivide_factor, op, backward_passes_per_step, average_aggregated_gradients,
                                 num_groups, groups, process_set, scale_local_gradients, zero_stage)


def distributed_optimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                          sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                          backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                          process_set=global_process_set, scale_local_gradients=True, zero_stage=0):
    """:func:`DistributedOptimizer` with every argument, in ``horovod.tensorflow.keras``'s order."""
    if zero_stage and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise NotSupportedError("DistributedOptimizer(zero_stage=...): not supported yet: sharding the state of "
                                f"a {type(optimizer).__module__}.{type(optimizer).__name__}; hora.keras shards "
                                "Keras 3 optimizers only")
    if is_tf_keras(optimizer):  # Keras 2 code (TF_USE_LEGACY_KERAS=1): Horovod's own way
        from hora.keras import legacy

        return legacy.DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression,
                                           sparse_as_dense, gradient_predivide_factor, op, backward_passes_per_step,
                                           average_aggregated_gradients, num_groups, groups, process_set,
                                           scale_local_gradients)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise HoraValueError(f"DistributedOptimizer: expected a Keras 3 optimizer (or a tf_keras one), got "
                             f"{type(optimizer).__name__}; "
                             "for a tf.compat.v1.train.Optimizer use hora.tensorflow.DistributedOptimizer")
    if isinstance(optimizer, _DistributedOptimizer):
        raise HoraValueError("DistributedOptimizer: this optimizer is already distributed; wrapping it twice "
                             "would reduce every gradient twice")
    check_optimizer_args("DistributedOptimizer", op, gradient_predivide_factor, backward_passes_per_step)
    check_compression_op(compression, op, "DistributedOptimizer")
    if not isinstance(optimizer, _LossScale) and keras.mixed_precision.global_policy().name == "mixed_float16":
        optimizer = _LossScale(optimizer)  # what compile would add, but inside: reduced before its check
    if isinstance(optimizer, _LossScale) and backward_passes_per_step > 1:
        raise NotSupportedError("not supported yet: backward_passes_per_step > 1 with a LossScaleOptimizer "
                                "(mixed_float16): Keras accumulates inside the inner optimizer, after the "
                                "finiteness check; use backward_passes_per_step=1 or the float32 policy")
    if num_groups:
        warnings.warn("DistributedOptimizer(num_groups=...) is deprecated; use groups=", DeprecationWarning,
                      stacklevel=2)
        groups = num_groups if groups is None else groups
    pre, post = predivide(op, gradient_predivide_factor)
    settings = _Settings(name or f"Distributed{type(optimizer).__name__}", op, pre, post, compression,
                         bool(sparse_as_dense), _variable_ids(groups), process_set, bool(scale_local_gradients),
                         backward_passes_per_step, bool(average_aggregated_gradients))
    stage = check_stage(zero_stage, "DistributedOptimizer")
    if stage:
        from hora.keras import sharded

        return sharded.wrap(optimizer, settings, stage)
    return _wrap(optimizer, settings)


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """:func:`DistributedOptimizer` whose ``local_layers``' (a layer or layers) gradients are not reduced:
    each rank applies its own (divided by the size with ``scale_local_gradients``), for model parallelism."""
    if is_tf_keras(optimizer):
        from hora.keras import legacy

        return legacy.PartialDistributedOptimizer(
            optimizer, name, device_dense, device_sparse, compression, sparse_as_dense, gradient_predivide_factor,
            op, backward_passes_per_step, average_aggregated_gradients, groups, process_set, local_layers,
            scale_local_gradients)
    wrapped = distributed_optimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else [local_layers] if isinstance(local_layers, keras.layers.Layer) \
        else list(local_layers)
    for layer in layers:
        if not isinstance(layer, keras.layers.Layer):
            raise HoraValueError(f"local_layers must hold keras.layers.Layer objects, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped
