"""``hora.keras.DistributedOptimizer(opt, zero_stage=1|2)``: the wrapped optimizer keeps the state of this rank's
slice of the model's variables only (ZeRO, :mod:`hora.kit.sharding` has the layout), under ``model.fit`` on
Keras 3's TensorFlow, JAX and torch backends.

As the unsharded wrapper, it is a dynamic subclass of the wrapped optimizer's class. ``build(variables)``
lays the model's variables end to end, cuts the flat vector into one slice per rank and builds the base class
on *piece* variables: one 1-D variable per model variable that this rank's slice touches, holding that part
of it. So every slot the base class makes (SGD's momentum, Adam's two moments) is piece-shaped: about 1/N of
the unsharded state per rank, plus the pieces themselves (1/N of the parameters). A step:

1. the model's gradients are packed into one flat vector and reduce-scattered in ONE host call (an
   ``alltoall`` with uneven splits; :func:`hora.kit.sharding.reduce_scatter_async`): this rank gets its slice,
   averaged (fp16/bf16 compression sends 16 bits, the owner sums in the variables' dtype);
2. the pieces are refreshed from the model's variables (weights set between steps are seen), and the base
   class's own ``apply`` updates them with the slice's gradients (learning-rate schedules, weight decay,
   ``iterations``: all the base class's);
3. the updated pieces are all-gathered in a second host call and assigned to the model's variables, whose
   constraints then apply to the whole tensors, as in the unsharded step.

TensorFlow and torch go through ``apply``; JAX's trainer calls ``stateless_apply`` with the model's values
and the optimizer's state, which this class maps onto the pieces the same way (the base class's
``stateless_apply`` runs on the piece values). Stage 2 is accepted and behaves as stage 1: the gradients are
the backend's tensors of the step, which the trainer owns.

What cannot combine is refused at construction with the reason: Adasum, top-k/PowerSGD, a
``LossScaleOptimizer`` (mixed_float16), gradient accumulation, ``clipnorm``/``global_clipnorm`` (a norm
over a tensor or the model, while a rank sees its slice), EMA, an already-built optimizer, elastic training.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np

import hora.core.ops as _core
from hora.base import knobs
from hora.base.errors import HoraValueError, NotSupportedError
from hora.kit import sharding
from hora.keras import dispatch
from hora.keras.compression import Compression
from hora.keras.wrapped import _DistributedOptimizer, _LossScale, _Settings

__all__ = ["wrap", "optimizer_bytes"]

_NOT_YET = "not supported yet with zero_stage in hora.keras"


class _ShardedOptimizer(_DistributedOptimizer):
    """Placed before the wrapped optimizer's class; see the module docstring."""

    _hora_stage: int
    _hora_wire: str | None

    # -- layout
    def build(self, variables):
        variables = list(variables)
        ps = self._hora.process_set
        if not ps.included():
            raise HoraValueError(f"DistributedOptimizer(zero_stage={self._hora_stage}): this rank is not in the "
                                 "optimizer's process set, so it owns no slice; build it on the set's ranks only")
        dtypes = {keras.backend.standardize_dtype(v.dtype) for v in variables}
        if len(dtypes) > 1:
            odd = [v.path for v in variables if keras.backend.standardize_dtype(v.dtype) != variables[0].dtype]
            raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: variables of several dtypes "
                                    f"({sorted(dtypes)}; e.g. {odd[:3]}); keep the trainable variables to one dtype")
        plan = sharding.make_plan([int(np.prod(v.shape)) for v in variables], ps.size())
        spans = plan.pieces(ps.rank())
        with _eager():
            pieces = [keras.Variable(keras.ops.convert_to_numpy(variables[i]).reshape(-1)[a:b],
                                     dtype=variables[i].dtype, trainable=False, name=variables[i].name)
                      for i, a, b in spans]
        # kept out of Keras's tracking: the pieces are not optimizer state to save
        object.__setattr__(self, "_hora_layout", (plan, spans, tuple(variables), tuple(pieces)))
        excluded = getattr(self, "_exclude_from_weight_decay", None)
        if excluded:  # exclude_from_weight_decay(var_list=...) named the model's variables: their pieces too
            self._exclude_from_weight_decay = excluded | {self._var_key(pieces[k]) for k, (i, _, _) in
                                                          enumerate(spans) if self._var_key(variables[i]) in excluded}
        super().build(list(pieces))

    def _hora_check(self, variables: list) -> None:
        mine = self._hora_layout[2]
        if len(variables) != len(mine) or any(a is not b for a, b in zip(variables, mine)):
            raise HoraValueError(f"DistributedOptimizer(zero_stage={self._hora_stage}): built for {len(mine)} "
                                 f"variables, given {len(variables)} (or others); a sharded optimizer steps the "
                                 "variables it was built with, in the same order")

    # -- the two collectives
    def _hora_reduce(self, grads: list, shapes: list) -> object:
        """This rank's slice of the flat gradients, reduced over the process set."""
        plan, s = self._hora_layout[0], self._hora
        dtype = self._hora_layout[2][0].dtype
        flat = keras.ops.concatenate([
            keras.ops.reshape(keras.ops.zeros(shape, dtype) if g is None else
                              dispatch.densify(g) if dispatch.is_sparse(g) else g, (-1,))
            for g, shape in zip(grads, shapes)])
        lo, hi = plan.range(s.process_set.rank())
        if not _active(s):
            return flat[lo:hi]
        counts = plan.counts(0, plan.total)

        def reduce(x):
            return [sharding.reduce_scatter_async(x, counts, f"{s.name}.zero.rs", s.op, s.prescale, s.postscale,
                                                  self._hora_wire, s.process_set).wait()]
        return _host_call(reduce, flat, (hi - lo,))

    def _hora_gather(self, pieces: list, shapes: list) -> list:
        """The model's variables' values from every rank's updated pieces."""
        plan, s = self._hora_layout[0], self._hora
        mine = keras.ops.concatenate([keras.ops.reshape(p, (-1,)) for p in pieces]) if pieces \
            else keras.ops.zeros((0,), self._hora_layout[2][0].dtype)
        if _active(s):
            def gather(x):
                return [_core.synchronize(sharding.allgather_async(x, f"{s.name}.zero.ag", s.process_set))]
            full = _host_call(gather, mine, (plan.total,))
        else:
            full = mine
        offsets = plan.offsets
        return [keras.ops.reshape(full[offsets[i]:offsets[i + 1]], shape) for i, shape in enumerate(shapes)]

    def _hora_piece_values(self, values: list) -> list:
        return [keras.ops.reshape(values[i], (-1,))[a:b] for i, a, b in self._hora_layout[1]]

    def _hora_split(self, mine) -> list:
        cuts = [b - a for _, a, b in self._hora_layout[1]]
        return dispatch._split(mine, cuts) if len(cuts) > 1 else [mine][:len(cuts)]

    # -- the step (TensorFlow, torch: apply; JAX: stateless_apply)
    def apply(self, grads, trainable_variables=None):
        base = super(_DistributedOptimizer, self)
        if trainable_variables is None:  # base.stateless_apply's own call, on the pieces
            return base.apply(grads)
        grads, variables = list(grads), list(trainable_variables)
        if not grads:
            return base.apply(grads, variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(variables)
            self.built = True
        self._hora_check(variables)
        shapes = [tuple(v.shape) for v in variables]
        mine = self._hora_reduce(grads, shapes)
        _, _, _, pieces = self._hora_layout
        for piece, value in zip(pieces, self._hora_piece_values([v.value for v in variables])):
            piece.assign(value)
        if pieces:
            base.apply(self._hora_split(mine), list(pieces))
        else:  # this rank owns nothing (fewer elements than ranks): the step still counts
            self._iterations.assign_add(1)
        for v, value in zip(variables, self._hora_gather([p.value for p in pieces], shapes)):
            v.assign(value)
            if v.constraint is not None:
                v.assign(v.constraint(v))

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        base = super(_DistributedOptimizer, self)
        if not self.built:
            return base.stateless_apply(optimizer_variables, grads, trainable_variables)  # Keras's error
        values = list(trainable_variables)
        variables = self._hora_layout[2]
        if len(values) != len(variables):
            raise HoraValueError(f"DistributedOptimizer(zero_stage={self._hora_stage}): built for {len(variables)} "
                                 f"variables, given {len(values)} values")
        shapes = [tuple(v.shape) for v in variables]
        mine = self._hora_reduce(list(grads), shapes)
        if self._hora_layout[1]:
            pieces, optimizer_variables = base.stateless_apply(optimizer_variables, self._hora_split(mine),
                                                               self._hora_piece_values(values))
        else:
            pieces = []
            optimizer_variables = [v + 1 if o is self._iterations else v
                                   for o, v in zip(self.variables, optimizer_variables)]
        out = self._hora_gather(pieces, shapes)
        out = [v.constraint(x) if v.constraint is not None else x for v, x in zip(variables, out)]
        return out, list(optimizer_variables)

    def _clip_gradients(self, grads):
        return super(_DistributedOptimizer, self)._clip_gradients(grads)

    def _apply_weight_decay(self, variables):
        # a rank whose pieces are all excluded from weight decay: Keras's torch optimizer would hand
        # torch._foreach_mul_ an empty list, which it refuses
        if self.weight_decay is not None and any(self._use_weight_decay(v) for v in variables):
            super()._apply_weight_decay(variables)

    def register_local_var(self, var) -> None:
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: local variables "
                                "(PartialDistributedOptimizer); every gradient is reduce-scattered to its owner")


def _active(s: _Settings) -> bool:
    return s.process_set.size() > 1


@contextlib.contextmanager
def _eager():
    """Variables made in ``build`` live outside a ``tf.function`` that happens to build the optimizer."""
    if dispatch.backend() == "tensorflow":
        import tensorflow as tf

        with tf.init_scope():
            yield
    else:
        yield


def _host_call(fn, tensor, shape: tuple) -> object:
    """``fn(numpy array) -> [array of shape]`` on the host, inside the backend's step (TensorFlow's and JAX's
    bridges take the result's shape; torch's step is eager)."""
    which = dispatch.backend()
    if which == "tensorflow":
        from hora.tensorflow.bridge import host_call

        return host_call(fn, [tensor], [tensor.dtype], [shape])[0]
    if which == "jax":
        import jax

        from hora.jax.bridge import host_call

        return host_call(fn, [tensor], [jax.ShapeDtypeStruct(shape, tensor.dtype)], "sharded optimizer")[0]
    (out,) = fn(keras.ops.convert_to_numpy(tensor))
    return keras.ops.convert_to_tensor(out, dtype=tensor.dtype)


def _wire(compression) -> str | None:
    return sharding.compression_wire(compression, Compression)


def _refuse(optimizer, s: _Settings) -> None:
    """What a sharded optimizer cannot do, said at construction."""
    sharding.check_shardable(s.op, "DistributedOptimizer")
    if isinstance(optimizer, _LossScale):
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: a LossScaleOptimizer "
                                "(mixed_float16): its finiteness check would need every slice's gradients; use the "
                                "float32 policy, or zero_stage=0")
    if s.accumulate > 1 or optimizer.gradient_accumulation_steps:
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: backward_passes_per_step > 1 / "
                                "gradient_accumulation_steps (Keras would accumulate the reduced slices, communicating "
                                "every pass); use backward_passes_per_step=1")
    if optimizer.clipnorm is not None or optimizer.global_clipnorm is not None:
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: clipnorm/global_clipnorm (a "
                                "norm over a whole tensor or the whole model, while each rank holds a slice); "
                                "clipvalue works")
    if optimizer.use_ema:
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: use_ema (the averages would "
                                "be of this rank's slice, and would overwrite the slice, not the model)")
    if optimizer.built:
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: an optimizer that is already "
                                "built (its whole state cannot be sliced yet); wrap it before the first fit")
    if knobs.value("elastic"):
        raise NotSupportedError(f"DistributedOptimizer(zero_stage=...): {_NOT_YET}: elastic training (the "
                                "slices would have to be resharded when the world changes)")


def wrap(optimizer, settings: _Settings, stage: int):
    """A new instance of a dynamic sharded subclass of ``type(optimizer)``, with ``optimizer``'s config."""
    _refuse(optimizer, settings)
    base = type(optimizer)
    cls = type(base.__name__, (_ShardedOptimizer, base),
               {"__module__": base.__module__, "__qualname__": base.__qualname__, "__doc__": base.__doc__,
                "_hora": settings, "_hora_stage": stage, "_hora_wire": _wire(settings.compression)})
    wrapped = cls.from_config(optimizer.get_config())
    object.__setattr__(wrapped, "_hora_ready", True)
    return wrapped


def optimizer_bytes(optimizer) -> dict:
    """Bytes this rank's optimizer holds: ``state`` (its variables that have a shape: slots, accumulators), and
    for a sharded one ``pieces`` (the slice of the parameters it updates)."""
    def nbytes(v):
        return int(np.prod(v.shape)) * dispatch._itemsize(keras.backend.standardize_dtype(v.dtype))
    layout = getattr(optimizer, "_hora_layout", None)
    return {"state": sum(nbytes(v) for v in optimizer.variables if len(v.shape)),
            "pieces": sum(nbytes(p) for p in layout[3]) if layout else 0}
