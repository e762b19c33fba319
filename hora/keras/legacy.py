"""``DistributedOptimizer`` for Keras 2 (``tf_keras``, ``TF_USE_LEGACY_KERAS=1``), with Horovod's contract.

Keras 2's ``Model.fit`` trains through ``optimizer.minimize(loss, vars, tape=tape)``, which computes the
gradients (``_compute_gradients`` for ``tf_keras.optimizers.legacy``, ``compute_gradients`` for
``tf_keras.optimizers``) and then applies them. As in Horovod, the wrapper is a dynamic subclass of the
optimizer's own class (same name and module, so a saved model loads without hora) rebuilt from its config,
whose gradient methods (those two and the graph-mode ``get_gradients``) return the gradients reduced over
the ranks. The reduction is :class:`hora.tensorflow.gradient_tape.GradientReducer`'s: one host call per
step for every group, sparse gradients gathered (or densified with ``sparse_as_dense``).
``backward_passes_per_step`` > 1 goes through :class:`hora.tensorflow.gradient_aggregation.
LocalGradientAggregationHelper`. ``opt.variables()`` works on both optimizer families (a list that can be
called, Horovod's shim). A gradient computed elsewhere and handed to ``apply_gradients`` is applied as it
is, as in Horovod: reduce it with ``DistributedGradientTape``.
"""

from __future__ import annotations

import tensorflow as tf

from hora.base.errors import HoraValueError
from hora.kit.frontend import check_optimizer_args
from hora.core.ops import Average
from hora.core.process_sets import ProcessSet, global_process_set
from hora.tensorflow.compression import Compression
from hora.tensorflow.gradient_aggregation import LocalGradientAggregationHelper
from hora.tensorflow.gradient_tape import GradientReducer

__all__ = ["DistributedOptimizer", "PartialDistributedOptimizer", "CallableList", "load_model"]


class CallableList(list):
    """A list that returns itself when called: ``opt.variables`` and ``opt.variables()`` both work."""

    def __call__(self):
        return self


class _Distributed:
    """Placed before the wrapped optimizer's class in the dynamic subclass's bases."""

    _hora_reducer: GradientReducer
    _hora_agg: LocalGradientAggregationHelper | None

    def compute_gradients(self, loss, var_list, tape=None):
        """The ``(gradient, variable)`` pairs of ``loss``, the gradients reduced over the ranks."""
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(self, loss, var_list, grad_loss=None, tape=None):
        base = super()
        tape = tf.GradientTape() if tape is None else tape
        if hasattr(base, "_compute_gradients"):  # tf_keras.optimizers.legacy
            pairs = base._compute_gradients(loss, var_list, grad_loss, tape=tape)
        else:
            pairs = base.compute_gradients(loss, var_list, tape=tape)
        pairs = list(pairs)
        if not pairs:
            return pairs
        grads, variables = [list(x) for x in zip(*pairs)]
        return list(zip(self._hora_allreduce(grads, variables), variables))

    def get_gradients(self, loss, params):
        """Graph mode (Keras 2's ``get_updates``): the gradients of ``loss``, reduced over the ranks."""
        return self._hora_allreduce(list(super().get_gradients(loss, params)), list(params))

    def _hora_allreduce(self, grads: list, variables: list) -> list:
        if self._hora_agg is not None:
            return self._hora_agg.compute_gradients(grads, variables)
        return self._hora_reducer(grads, variables)

    def apply_gradients(self, *args, **kwargs):
        if self._hora_agg is None:
            return super().apply_gradients(*args, **kwargs)
        if args:
            args = (list(args[0]),) + args[1:]  # a zip is read twice (both branches)
        return self._hora_agg.apply_gradients(lambda: super(_Distributed, self).apply_gradients(*args, **kwargs),
                                              self, *args, **kwargs)

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient on this rank: not reduced, divided by the size with
        ``scale_local_gradients`` (model parallelism)."""
        if self._hora_agg is not None:
            self._hora_agg.register_local_var(var)
        else:
            self._hora_reducer.register_local(var)


class _DistributedV2(_Distributed):
    """For ``tf_keras.optimizers.Optimizer``, whose ``variables`` is a property (Horovod's shim)."""

    @property
    def variables(self):
        return CallableList(super().variables)


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='', compression=Compression.none,
                         sparse_as_dense=False, gradient_predivide_factor=1.0, op=Average,
                         backward_passes_per_step=1, average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set: ProcessSet = global_process_set, scale_local_gradients=True):
    """Wrap a ``tf_keras`` optimizer (legacy or not) so that the gradients it computes are reduced (``op``)
    over the ranks; the arguments are ``horovod.tensorflow.keras.DistributedOptimizer``'s."""
    if isinstance(optimizer, _Distributed):
        raise HoraValueError("DistributedOptimizer: this optimizer is already distributed; wrapping it twice "
                             "would reduce every gradient twice")
    check_optimizer_args("DistributedOptimizer", op, gradient_predivide_factor, backward_passes_per_step)
    where = name or f"Distributed{type(optimizer).__name__}"
    reducer = GradientReducer(where, compression, sparse_as_dense, op, gradient_predivide_factor, num_groups,
                              groups, process_set, device_dense, device_sparse, scale_local_gradients)
    agg = None
    if backward_passes_per_step > 1:
        plain = GradientReducer(where, compression, sparse_as_dense, op, gradient_predivide_factor, num_groups,
                                groups, process_set, device_dense, device_sparse, scale_local_gradients)
        agg = LocalGradientAggregationHelper(backward_passes_per_step, plain, sparse_as_dense,
                                             average_aggregated_gradients, process_set=process_set,
                                             scale_local_gradients=scale_local_gradients, name=where)
    base = type(optimizer)
    mixin = _Distributed if hasattr(base, "_compute_gradients") else _DistributedV2
    cls = type(base.__name__, (mixin, base), {"__module__": base.__module__, "__qualname__": base.__qualname__,
                                               "__doc__": base.__doc__})
    wrapped = cls.from_config(optimizer.get_config())
    object.__setattr__(wrapped, "_hora_reducer", reducer)  # not through Keras's attribute tracking
    object.__setattr__(wrapped, "_hora_agg", agg)
    object.__setattr__(wrapped, "_agg_helper", agg)  # Horovod's name (its tests read ._agg_helper.counter)
    return wrapped


def PartialDistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                                compression=Compression.none, sparse_as_dense=False, gradient_predivide_factor=1.0,
                                op=Average, backward_passes_per_step=1, average_aggregated_gradients=False,
                                groups=None, process_set=global_process_set, local_layers=None,
                                scale_local_gradients=True):
    """:func:`DistributedOptimizer` whose ``local_layers``' gradients stay on each rank."""
    wrapped = DistributedOptimizer(optimizer, name, device_dense, device_sparse, compression, sparse_as_dense,
                                   gradient_predivide_factor, op, backward_passes_per_step,
                                   average_aggregated_gradients, 0, groups, process_set, scale_local_gradients)
    layers = [] if local_layers is None else local_layers if isinstance(local_layers, (list, tuple)) \
        else [local_layers]
    for layer in layers:
        if not hasattr(layer, "trainable_weights"):
            raise HoraValueError(f"local_layers must hold Keras layers, got {type(layer).__name__}")
        for var in layer.trainable_weights:
            wrapped.register_local_var(var)
    return wrapped


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none,
               legacy_opts=False):
    """``tf_keras.models.load_model`` with every stock optimizer (and ``custom_optimizers``) built wrapped in
    :func:`DistributedOptimizer`, so the restored optimizer state is the distributed optimizer's, as
    Horovod's ``load_model``. ``legacy_opts``: the stock optimizers are ``tf_keras.optimizers.legacy``'s;
    an HDF5 file (``.h5``/``.hdf5``) gets those whatever it says, as ``tf_keras`` itself reads its optimizer
    (Horovod asks for ``legacy_opts=True`` there)."""
    from hora.keras.flavour import tf_keras

    keras2 = tf_keras()
    h5 = str(filepath).lower().endswith((".h5", ".hdf5"))
    module = keras2.optimizers.legacy if legacy_opts or h5 else keras2.optimizers
    stock = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, (
        keras2.optimizers.Optimizer, keras2.optimizers.legacy.Optimizer))]

    def wrap(cls):
        return lambda **kwargs: DistributedOptimizer(cls(**kwargs), compression=compression)
    objects = {c.__name__.lower(): wrap(c) for c in stock}
    objects.update({c.__name__: wrap(c) for c in stock})
    objects.update({c.__name__: wrap(c) for c in custom_optimizers or []})
    objects.update(custom_objects or {})
    return keras2.models.load_model(filepath, custom_objects=objects)
